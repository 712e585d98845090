"""The config schema: every field with its default (`base_config()`, with its `model` section
from `model_config()`). This module is the leaf of the import graph: it imports no JAX, so a
config can be built and checked before anything heavy loads.
"""

from __future__ import annotations

import ml_collections

# The initialization groups a config can name (`model.init.<group>`); arch/init.py binds them.
INIT_GROUPS = ("embedding", "query", "key", "value", "attention_output", "ffn_input", "ffn_output",
               "head")


def model_config() -> ml_collections.ConfigDict:
    """A small Pre-Norm RMSNorm/RoPE/SwiGLU decoder; registries name every component."""
    return ml_collections.ConfigDict(dict(
        vocab_size=256,           # ≥ the tokenizer's (data.tokenizer); 0: the tokenizer's
        d_model=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,           # = num_heads: MHA; 1: MQA; in between: GQA
        head_dim=ml_collections.FieldReference(None, field_type=int),        # default d / h
        attention_width=ml_collections.FieldReference(None, field_type=int),  # h·p if ≠ d
        d_ff=ml_collections.FieldReference(None, field_type=int),            # default ratio·d
        ffn_ratio=4.0,
        attention="mha",          # arch.attention.ATTENTION
        attention_implementation="auto",  # auto, xla, blocked, cudnn, splash (attention_kernels)
        attention_chunk=128,      # blocked: query/key tile length (memory O(T·chunk)); splash block
        mla_kv_rank=64,           # attention="mla": key/value latent width d_c (cached per token)
        mla_q_rank=0,             # mla: query latent width d_c'; 0 = full-rank query projection
        mla_rope_dim=16,          # mla: width of the decoupled rotary query/key parts (even)
        mla_nope_dim=ml_collections.FieldReference(None, field_type=int),  # mla: default head_dim
        mla_v_dim=ml_collections.FieldReference(None, field_type=int),     # mla: default head_dim
        mla_absorb=False,         # mla: cached attention in the latent space (W_UK absorbed)
        sequence_attention="all_gather",  # mesh.sequence > 1: "all_gather" keys/values, or
                                  # "ring" (ppermute around the sequence axis; attention="mha")
        norm="rmsnorm",           # arch.norms.NORMS
        norm_eps=1e-6,
        batchnorm_momentum=0.9,   # norm="batchnorm"/"causal_batchnorm": running-average momentum
        dyt_alpha_init=0.5,       # norm="dyt": initial scalar α (Zhu et al. 2025 default α₀)
        gated_norm_rank=16,       # norm="gatednorm": rank r of the gate's d→r→d projection
        fixnorm=False,            # FixNorm: ℓ2-normalized embedding rows (needs head="tied")
        fixnorm_scale=ml_collections.FieldReference(None, field_type=float),  # row norm; default 1
        position="rope",          # arch.positions.POSITIONS
        rope_base=10_000.0,
        max_seq_len=ml_collections.FieldReference(None, field_type=int),  # default: seq_len
        ffn="swiglu",             # arch.ffn.FFNS
        activation="gelu",        # arch.ffn.ACTIVATIONS (used by ffn="mlp")
        leaky_relu_slope=0.01,    # negative slope α of activation="leaky_relu"
        ffn_width="ratio",        # d_ff if not given: "ratio" (ratio·d) or "match_mlp" (gated: 2/3)
        ffn_multiple_of=1,        # round a derived d_ff up to a multiple of this
        moe_experts=8,            # ffn="moe": number of routed experts E
        moe_top_k=2,              # moe: experts per token k (token choice), 1 ≤ k ≤ E
        moe_every=1,              # moe: every k-th block is MoE, the others use moe_dense_ffn
        moe_dense_ffn="swiglu",   # moe with moe_every > 1: the FFN of the dense blocks
        moe_d_ff=ml_collections.FieldReference(None, field_type=int),  # moe: expert width; d_ff
        moe_expert_ffn="swiglu",  # moe: expert FFN kind (arch.ffn.FFNS; gated if 3 projections)
        moe_capacity_factor=1.25,  # moe: slots per expert C = ⌈factor·k·T/E⌉ per sequence
        moe_dropless=False,       # moe: C = T, no token dropped (O(B·T·E·T) dispatch memory)
        moe_renormalize=True,     # moe: top-k gates renormalized to sum 1 (Mixtral); else raw
        moe_shared_experts=0,     # moe: always-on shared experts s (DeepSeekMoE), width s·moe_d_ff
        moe_balance_coef=0.01,    # moe: load-balancing loss coefficient α (Switch eq. 4)
        moe_z_coef=1e-3,          # moe: router z-loss coefficient β (ST-MoE eq. 5)
        residual="prenorm",       # arch.residual.RESIDUALS (prenorm, postnorm, deepnorm, noskip,
                                  # attnres, block_attnres, hc, mhc, width, gated_residual)
        residual_streams=4,       # hc/mhc/width/gated_residual: streams or branches n
        residual_dynamic=True,    # hc/mhc/gated_residual: input-dependent part on (False: static)
        hc_dynamic_scale=0.01,    # hc/mhc: initial scale s of the tanh dynamic weights
        mhc_sinkhorn_iters=20,    # mhc: Sinkhorn iterations onto doubly-stochastic matrices
        attnres_block_size=4,     # block_attnres: sublayers per block S (1: Full AttnRes)
        attnres_query="static",   # attnres: "static" pseudo-query, or "input": + W·(current state)
        attnres_heads=1,          # attnres: depth-attention heads (divides d)
        attnres_weights="softmax",  # attnres: softmax | sigmoid | static (DenseFormer-style)
        attnres_key_norm=True,    # attnres: RMS-normalized keys (False: raw sources)
        attnres_window=0,         # attnres: attend to the W most recent sources only (0: all)
        gr_rank=16,               # gated_residual: rank of the read-gate predictor
        gr_channelwise=True,      # gated_residual: per-channel reads and writes (False: scalar)
        gr_channelwise_read=ml_collections.FieldReference(None, field_type=bool),   # gr: reads
        gr_channelwise_write=ml_collections.FieldReference(None, field_type=bool),  # gr: writes;
                                  # per channel or scalar per branch; None: gr_channelwise
        gr_static=True,           # gated_residual: static gate logits b_read, b_write (False:
                                  # the gates are the dynamic part only; needs residual_dynamic)
        gr_init="graded",         # gated_residual: write strengths "graded" or "random" at init
        gr_read_top_k=0,          # gated_residual: read the k branches of largest gate per
                                  # token, the others' gates zeroed (0: all n)
        gr_mixing=False,          # gated_residual: add back an n×n branch-mixing operator
        gr_state_dtype="float32",  # gated_residual: branch dtype: float32, bfloat16, float8_e4m3fn
        use_ffn=True,             # False: attention-only blocks (rank-collapse ablation)
        linear_bias=False,        # + b on attention q/k/v/output and FFN projections (GPT-2); mha
                                  # and dense FFNs only (not mla, not moe)
        head="tied",              # arch.heads.HEADS
        # Initialization scheme (arch.init.INITS) per parameter group; None: `default`.
        init=dict(default="fan_in", **{group: ml_collections.FieldReference(None, field_type=str)
                                       for group in INIT_GROUPS}),
        head_bias=False,          # output bias b ∈ R^V on every head
        mos_components=4,         # K for head="mos"/"moc" (Yang et al. 2018)
        mos_tied=True,            # mos/moc: output projection = the input embedding
        final_norm=True,
        dtype="float32",          # compute dtype; parameters are always float32
        remat=False,              # recompute each block in the backward pass (= remat_policy full)
        remat_policy=ml_collections.FieldReference(None, field_type=str),  # arch.remat; None: remat
        scan_unroll=1,            # layers per loop iteration of the layer scan (its unroll;
                                  # not the pipeline's nor two-phase AttnRes's own scan)
        # Pipeline parallelism, with mesh.stage > 1 (sharding/pipeline.py); bubble fraction
        # (P − 1)/(V·M + P − 1) for P = mesh.stage, V virtual stages, M microbatches.
        pipeline_schedule="gpipe",  # "gpipe" (one chunk of layers per device) or "circular"
        pipeline_microbatches=4,  # M ≥ mesh.stage, dividing each data shard's rows
        pipeline_virtual_stages=1,  # circular: layer chunks per device V (chunk v·P + p on p)
        pipeline_transfer="cached",  # what crosses stages: "cached" (AttnRes: only the source
                                     # slots the next stage lacks) or "full" (the whole state)
        reversible=False,         # RevNet/Reformer coupling, activations O(1) in depth (prenorm)
    ))


def base_config() -> ml_collections.ConfigDict:
    """Every training field with its default."""
    return ml_collections.ConfigDict(dict(
        seed=0,
        steps=1000,
        batch_size=32,            # global, in sequences
        accumulation_steps=1,     # microbatches per step (gradients summed in-step); divides batch
        seq_len=128,
        log_every=10,
        eval_every=200,
        eval_batches=8,
        checkpoint_every=200,
        keep_checkpoints=3,       # newest checkpoints kept (≥ 1); older ones of this run rotate out
        resume_mode="resume",     # "resume": continue the run in --workdir (same model, data and
                                  # batch order); "finetune": start a new run from finetune_from
        finetune_from="",         # resume_mode="finetune": the run directory to start from
        nonfinite_policy="stop",  # non-finite loss or state: "stop" (exit 1, nothing bad saved) or
                                  # "skip" (keep the previous state, count it in skipped_steps)
        sample_tokens=200,        # length of the sample printed at the end ("" prompt: 0 to skip)
        sample_prompt="And God said",
        temperature=0.8,
        top_k=40,
        model=model_config(),
        optimizer=dict(
            name="adamw",         # "adamw", or "muon": Muon on the hidden matrices (train.optim)
            learning_rate=3e-3,
            schedule="cosine",    # "cosine" (warmup + cosine) or "wsd" (warmup-stable-decay)
            warmup_steps=100,
            decay_fraction=0.2,   # wsd: last fraction of steps spent decaying
            final_lr_fraction=0.1,
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            decay_embeddings=False,
            decay_norms=False,
            decay_biases=False,
            decay_mixing=False,   # residual mixing weights (arch.residual.MixingParam)
            grad_clip=1.0,        # global-norm clip; 0 disables
            muon_momentum=0.95,   # muon: Nesterov momentum β of the orthogonalized matrices
            muon_rms=0.2,         # muon: update RMS per matrix, so AdamW's lr and decay carry over
        ),
        data=dict(
            name="kjv",           # "kjv" (embedded), "text" (local files), "prepared" (shards
                                  # of scripts/prepare_data.py), or a tfds catalog name
            path="",              # glob(s) for name="text"; the directory for name="prepared"
            tokenizer="byte",     # "byte", "hf:PATH" (tokenizer.json), "sentencepiece:PATH"
            packing=True,         # windows span documents (joined by the separator); False:
                                  # each window lies inside one document (name="prepared")
            prefetch=4,           # name="prepared": batches read ahead of the step
            read_threads=2,       # name="prepared": threads reading those batches
            data_dir="",          # tfds data dir; default ~/.cache/blockbench/tfds
            validation_fraction=0.05,  # name="text": the tail kept for validation
            text_key=ml_collections.FieldReference(None, field_type=str),  # tfds text feature
        ),
        # Total size of each mesh axis; one may be -1: the remaining devices.
        mesh=dict(data=-1, fsdp=1, tensor=1, sequence=1, stage=1, expert=1,
                  # Multi-slice TPU: the across-slice (DCN) factor of each axis, which must divide
                  # the axis's size (mesh.<axis> = ICI × DCN); the factors multiply to the number
                  # of slices. Usually only data, e.g. 2 slices: mesh.dcn.data=2.
                  dcn=dict(data=1, fsdp=1, tensor=1, sequence=1, stage=1, expert=1)),
    ))
