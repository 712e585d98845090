"""The config schema: every field with its default (`base_config()`, with its `model` section
from `model_config()`, one subsection per component, and its `execution` section from
`execution_config()`). This module is the leaf of the import graph: it imports no JAX, so a
config can be built and checked before anything heavy loads. Names of earlier versions:
`config/legacy.py`.
"""

from __future__ import annotations

import ml_collections

from config import catalogue

# The initialization groups a config can name (`model.init.<group>`); arch/init.py binds them.
INIT_GROUPS = ("embedding", "query", "key", "value", "attention_output", "ffn_input", "ffn_output",
               "head")


def model_config() -> ml_collections.ConfigDict:
    """A small Pre-Norm RMSNorm/RoPE/SwiGLU decoder. Each component is a section whose `name`
    picks it from its registry; a section's other fields are that component's options. A
    component may declare its options' section in its record instead (`config.catalogue`:
    `section`, `options`), added here."""
    model = _model_fields()
    for section, options in catalogue.option_sections().items():
        if section in model:
            raise ValueError(f"model.{section}: declared by a catalogue record and here")
        model[section] = options()
    return ml_collections.ConfigDict(model)


def _model_fields() -> dict:
    """The `model` section's fields declared here (see `model_config`)."""
    return dict(
        vocab_size=256,           # ≥ the tokenizer's (data.tokenizer); 0: the tokenizer's
        d_model=256,
        num_layers=4,
        max_seq_len=ml_collections.FieldReference(None, field_type=int),  # default: seq_len
        dtype="float32",          # compute dtype; parameters are always float32
        attention=dict(
            name="mha",           # arch.attention.ATTENTION
            num_heads=4,
            num_kv_heads=4,       # = num_heads: MHA; 1: MQA; in between: GQA
            head_dim=ml_collections.FieldReference(None, field_type=int),  # default d / h
            width=ml_collections.FieldReference(None, field_type=int),     # h·p if ≠ d
            window=0,             # sliding window W: attend to the W most recent positions,
                                  # KV cache a ring of W slots (0: full causal attention)
        ),
        mla=dict(                 # attention.name="mla" (arch.attention.MultiHeadLatentAttention)
            kv_rank=64,           # key/value latent width d_c (cached per token)
            q_rank=0,             # query latent width d_c'; 0 = full-rank query projection
            rope_dim=16,          # width of the decoupled rotary query/key parts (even)
            nope_dim=ml_collections.FieldReference(None, field_type=int),  # default head_dim
            v_dim=ml_collections.FieldReference(None, field_type=int),     # default head_dim
            absorb=False,         # cached attention in the latent space (W_UK absorbed)
        ),
        deltanet=dict(            # gated_deltanet layers (arch.deltanet.GatedDeltaNet)
            num_heads=ml_collections.FieldReference(None, field_type=int),  # default attention's
            head_dim=ml_collections.FieldReference(None, field_type=int),   # key width K; default
                                  # attention.head_dim
            value_dim=ml_collections.FieldReference(None, field_type=int),  # V; default head_dim
            conv_width=4,         # short causal depthwise convolution on q, k, v, width W
            chunk=64,             # tokens per chunk of the chunkwise-parallel training form
        ),
        layer_pattern="",         # hybrid stack, repeated over the layers: "L" a gated_deltanet
                                  # block, "A" one of attention.name (e.g. "LLLA"); "": all "A"
        position=dict(
            name="rope",          # arch.positions.POSITIONS
            rope_base=10_000.0,
        ),
        norm=dict(
            name="rmsnorm",       # arch.norms.NORMS
            eps=1e-6,
            final=True,           # a norm after the last block
            batchnorm_momentum=0.9,  # batchnorm/causal_batchnorm: running-average momentum
            dyt_alpha_init=0.5,   # dyt: initial scalar α (Zhu et al. 2025 default α₀)
            gated_rank=16,        # gatednorm: rank r of the gate's d→r→d projection
        ),
        fixnorm=False,            # FixNorm: ℓ2-normalized embedding rows (needs head.name="tied")
        fixnorm_scale=ml_collections.FieldReference(None, field_type=float),  # row norm; default 1
        ffn=dict(
            name="swiglu",        # arch.ffn.FFNS
            d_ff=ml_collections.FieldReference(None, field_type=int),  # default ratio·d
            ratio=4.0,
            width="ratio",        # d_ff if not given: "ratio" (ratio·d) or "match_mlp" (gated: 2/3)
            multiple_of=1,        # round a derived d_ff up to a multiple of this
            activation="gelu",    # arch.ffn.ACTIVATIONS (used by name="mlp")
            leaky_relu_slope=0.01,  # negative slope α of activation="leaky_relu"
        ),
        use_ffn=True,             # False: attention-only blocks (rank-collapse ablation)
        linear_bias=False,        # + b on attention q/k/v/output and FFN projections (GPT-2); mha
                                  # and dense FFNs only (not mla, not moe)
        moe=dict(                 # ffn.name="moe" (arch.moe.MixtureOfExperts)
            experts=8,            # number of routed experts E
            top_k=2,              # experts per token k (token choice), 1 ≤ k ≤ E
            every=1,              # every k-th block is MoE, the others use moe.dense_ffn
            dense_ffn="swiglu",   # with every > 1: the FFN of the dense blocks
            d_ff=ml_collections.FieldReference(None, field_type=int),  # expert width; default d_ff
            expert_ffn="swiglu",  # expert FFN kind (arch.ffn.FFNS; gated if 3 projections)
            capacity_factor=1.25,  # slots per expert C = ⌈factor·k·T/E⌉ per sequence
            dropless=False,       # C = T, no token dropped (O(B·T·E·T) dispatch memory)
            renormalize=True,     # top-k gates renormalized to sum 1 (Mixtral); else raw
            shared_experts=0,     # always-on shared experts s (DeepSeekMoE), width s·moe.d_ff
            balance_coef=0.01,    # load-balancing loss coefficient α (Switch eq. 4)
            z_coef=1e-3,          # router z-loss coefficient β (ST-MoE eq. 5)
        ),
        residual=dict(
            name="prenorm",       # arch.residual.RESIDUALS (prenorm, postnorm, deepnorm, noskip,
                                  # rezero, attnres, block_attnres, hc, mhc, width,
                                  # gated_residual)
            streams=4,            # hc/mhc/width/gated_residual: streams or branches n
            dynamic=True,         # hc/mhc/gated_residual: input-dependent part on (False: static)
        ),
        hyper=dict(               # residual.name="hc"/"mhc" (arch.hyper)
            dynamic_scale=0.01,   # initial scale s of the tanh dynamic weights
            sinkhorn_tolerance=1e-3,  # mhc: doubly stochastic to max|column sum − 1| ≤ this
            sinkhorn_iters=20,    # mhc: the most steps of that projection (arch.kernels)
        ),
        attnres=dict(             # residual.name="attnres"/"block_attnres" (arch.attnres)
            block_size=4,         # block_attnres: sublayers per block S (1: Full AttnRes)
            query="static",       # "static" pseudo-query, or "input": + c·W·(current state)
            query_scale=1.0,      # query="input": c (1/d: as fast under Adam as the static part)
            heads=1,              # depth-attention heads (divides d)
            weights="softmax",    # softmax | sigmoid | static (DenseFormer-style)
            key_norm=True,        # RMS-normalized keys (False: raw sources)
            window=0,             # attend to the W most recent sources only (0: all)
        ),
        gated_residual=dict(      # residual.name="gated_residual" (arch.gated_residual)
            rank=16,              # rank of the read-gate predictor
            channelwise=True,     # per-channel reads and writes (False: scalar per branch)
            channelwise_read=ml_collections.FieldReference(None, field_type=bool),   # reads and
            channelwise_write=ml_collections.FieldReference(None, field_type=bool),  # writes, per
                                  # channel or scalar per branch; None: follow channelwise
            static=True,          # static gate logits b_read, b_write (False: the gates are the
                                  # dynamic part only; needs residual.dynamic)
            static_frozen=False,  # True: b_read, b_write keep their initial values (no gradient)
            init="graded",        # write strengths "graded" or "random" at init
            read_top_k=0,         # read the k branches of largest gate per token, the others'
                                  # gates zeroed (0: all n)
            mixing=False,         # add back an n×n branch-mixing operator
            state_dtype="float32",  # branch dtype: float32, bfloat16, float8_e4m3fn
        ),
        branch_scale=dict(        # a multiplier on each sublayer output (arch.branch_scale)
            name="none",          # "none", "layerscale" (learned per-channel γ), "fixed" (c)
            layerscale_init=ml_collections.FieldReference(None, field_type=float),  # γ₀; default
                                  # by depth (CaiT): 0.1 for L ≤ 18 blocks, 1e-5 ≤ 24, else 1e-6
            multiplier=ml_collections.FieldReference(None, field_type=float),  # fixed: c; default
                                  # 1/√(2L), one over the root of the number of sublayers
        ),
        head=dict(
            name="tied",          # arch.heads.HEADS
            bias=False,           # output bias b ∈ R^V on every head
            mos_components=4,     # K for mos/moc (Yang et al. 2018)
            mos_tied=True,        # mos/moc: output projection = the input embedding
            mtp_depth=0,          # k multi-token prediction modules (arch/mtp.py; training only)
            mtp_weight=0.3,       # λ: loss = CE + (λ/k) Σ_j CE_j (DeepSeek-V3: 0.3, then 0.1)
        ),
        # Initialization scheme (arch.init.INITS) per parameter group; None: `default`.
        init=dict(default="fan_in", **{group: ml_collections.FieldReference(None, field_type=str)
                                       for group in INIT_GROUPS}),
        reversible=False,         # RevNet/Reformer coupling, activations O(1) in depth (prenorm)
        # Inverted dropout in training (arch/dropout.py), a rate p ∈ [0, 1) per site; keys from
        # (seed, step, layer, site). Evaluation and generation never drop.
        dropout=dict(
            embedding=0.0,        # x⁰ after the position embedding
            attention_probs=0.0,  # softmax probabilities (explicit-scores xla kernel only)
            attention_output=0.0,  # the attention sublayer's output, before the residual write
            ffn_hidden=0.0,       # FFN (and MoE expert) hidden activations, before W₂
            residual=0.0,         # every sublayer's update u, before the residual write
        ),
        loop_count=1,             # R: the block stack applied R times, shared parameters
                                  # (looped depth; single-stream residuals, no pipeline)
        loop_inject=False,        # looped depth: add the embedding x⁰ to the stream before
                                  # every pass after the first
    )


def execution_config() -> ml_collections.ConfigDict:
    """How the model runs, apart from what it computes: kernels, rematerialization, the layer
    loop and the pipeline schedule. A run may resume with different execution settings."""
    return ml_collections.ConfigDict(dict(
        attention_implementation="auto",  # auto, xla, blocked, cudnn, splash (arch/kernels/)
        attention_chunk=128,      # blocked: query/key tile length (memory O(T·chunk)); splash block
        sequence_attention="all_gather",  # mesh.sequence > 1: "all_gather" keys/values, or
                                  # "ring" (ppermute around the sequence axis; mha only)
        remat="none",             # what a block keeps for its backward pass (arch.remat.
                                  # REMAT_POLICIES): none, full (recompute each block), ...
        scan_unroll=1,            # layers per loop iteration of the layer scan (its unroll;
                                  # not the pipeline's nor two-phase AttnRes's own scan)
        depth_read="xla",         # AttnRes's one-head softmax read: "xla" or "pallas" (fused)
        # Pipeline parallelism, with mesh.stage > 1 (sharding/pipeline.py); bubble fraction
        # (P − 1)/(V·M + P − 1) for P = mesh.stage, V virtual stages, M microbatches.
        pipeline=dict(
            schedule="gpipe",     # "gpipe" (one chunk of layers per device) or "circular"
            microbatches=4,       # M ≥ mesh.stage, dividing each data shard's rows
            virtual_stages=1,     # circular: layer chunks per device V (chunk v·P + p on p)
            transfer="cached",    # what crosses stages: "cached" (AttnRes: only the source
                                  # slots the next stage lacks) or "full" (the whole state)
        ),
    ))


def quantization_config() -> ml_collections.ConfigDict:
    """A post-training quantized run (written by scripts/quantize.py; arch/quantized.py): which
    method quantized the attention and FFN projections of the layer stack, and the shapes of its
    stored arrays. method "none": a float32 run."""
    return ml_collections.ConfigDict(dict(
        method="none",            # "none", "int8"/"int4"/"int3" (round-to-nearest), "llm_int8"
                                  # (vector-wise int8 + float32 outlier features), "gptq4", "gptq3"
        bits=32,                  # bits per quantized weight (written with the method)
        group_size=0,             # int8/gptq: input rows sharing a scale; 0: one per output column
        threshold=6.0,            # llm_int8: calibration |activation| above which a feature is
                                  # multiplied in float32
        outliers="",              # llm_int8: float32 feature rows each quantized layer holds
                                  # (the most of any stacked layer), "attention/query=2,…"
                                  # (written by scripts/quantize.py)
        calibration_batches=0,    # batches of the training split the calibration read
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
        execution=execution_config(),
        quantization=quantization_config(),
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
            ema_decay=0.0,        # > 0: an EMA of the parameters in the train state, after each
                                  # update ema ← d·ema + (1 − d)·params (from the initial params;
                                  # no bias correction); eval_loss_ema, generate --ema. 0: none
        ),
        # What the step minimizes beyond next-token cross-entropy (and MoE auxiliary losses).
        objective=dict(
            ema_distill_weight=0.0,  # w > 0: + w·KL(softmax(z_ema/τ) ‖ softmax(z/τ)), teacher
                                  # logits z_ema of the EMA parameters, stop-gradient (needs
                                  # optimizer.ema_decay > 0)
            ema_distill_temperature=1.0,  # τ > 0 of both softmaxes in that KL
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
            verify=True,          # name="prepared": check each shard's SHA-256 against its
                                  # metadata, once per process (docs/data.md); False: skip it
            data_dir="",          # tfds data dir; default ~/.cache/blockbench/tfds
            validation_fraction=0.05,  # name="text": the tail kept for validation
            validation="chapters",  # name="kjv": "chapters" (every 20th chapter is validation)
                                  # or "books" (whole books never trained on: validation_books)
            validation_books=(),  # validation="books": the held-out books by name; () takes
                                  # config.validate.VALIDATION_BOOKS
            tuning_fraction=0.0,  # f > 0: hold out the last fraction f of the train split as a
                                  # tuning split; the run trains on the rest and evaluates on it
                                  # instead of validation (a learning-rate sweep, scripts/
                                  # sweep.py --tune). 0: train on all of it, evaluate on
                                  # validation. Not for name="prepared"
            text_key=ml_collections.FieldReference(None, field_type=str),  # tfds text feature
        ),
        # Total size of each mesh axis; one may be -1: the remaining devices.
        mesh=dict(data=-1, fsdp=1, tensor=1, sequence=1, stage=1, expert=1,
                  # Multi-slice TPU: the across-slice (DCN) factor of each axis, which must divide
                  # the axis's size (mesh.<axis> = ICI × DCN); the factors multiply to the number
                  # of slices. Usually only data, e.g. 2 slices: mesh.dcn.data=2.
                  dcn=dict(data=1, fsdp=1, tensor=1, sequence=1, stage=1, expert=1)),
    ))
