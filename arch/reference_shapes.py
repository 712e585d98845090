"""Named reference shapes for `scripts/accounting.py`: the seeds' worked examples and the public
configurations of well-known open models, with the parameter counts they must reproduce.

Open models are built from their public Hugging Face `config.json` (the fields below, copied from
the released files) through `arch.hf_config.model_config_from_hf`, the importer's own mapping,
and counted by `arch.accounting` with `jax.eval_shape` (nothing allocated).
`PUBLISHED_PARAMETERS` holds the exact tensor totals of the released checkpoints (the model cards
round them: GPT-2 "124M", GPT-2 medium "355M", Llama 2 7B "6.74B" (7B), Llama 3 8B "8.03B",
Mistral 7B v0.3 "7.25B").
"""

from __future__ import annotations

import ml_collections

from arch.accounting import parameter_breakdown
from arch.hf_config import model_config_from_hf
from config.defaults import model_config
from config.model_rules import resolve_model

_GPT2 = dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12,
             n_head=12, n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
             tie_word_embeddings=True, scale_attn_by_inverse_layer_idx=False,
             reorder_and_upcast_attn=False)
_LLAMA2_7B = dict(model_type="llama", vocab_size=32000, hidden_size=4096,
                  intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, hidden_act="silu", max_position_embeddings=4096,
                  rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                  tie_word_embeddings=False, attention_bias=False)

PUBLIC_CONFIGS: dict[str, dict] = {
    "gpt2": _GPT2,
    "gpt2-medium": {**_GPT2, "n_embd": 1024, "n_layer": 24, "n_head": 16},
    "llama-2-7b": _LLAMA2_7B,
    "llama-3-8b": {**_LLAMA2_7B, "vocab_size": 128256, "intermediate_size": 14336,
                   "num_key_value_heads": 8, "max_position_embeddings": 8192,
                   "rope_theta": 500000.0},
    "mistral-7b-v0.3": {**_LLAMA2_7B, "model_type": "mistral", "vocab_size": 32768,
                        "intermediate_size": 14336, "num_key_value_heads": 8,
                        "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                        "sliding_window": None},
}

PUBLISHED_PARAMETERS = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "mistral-7b-v0.3": 7_248_023_552,
}


def open_model(name: str) -> ml_collections.ConfigDict:
    """The resolved model config of a public open model in `PUBLIC_CONFIGS`."""
    if name not in PUBLIC_CONFIGS:
        raise ValueError(f"unknown open model {name!r}; known: {', '.join(PUBLIC_CONFIGS)}")
    return model_config_from_hf(PUBLIC_CONFIGS[name])


def _resolved(**fields) -> ml_collections.ConfigDict:
    cfg = model_config()
    cfg.update(fields)
    if cfg.max_seq_len is None:
        cfg.max_seq_len = 512
    resolve_model(cfg)
    return cfg


def transformer_base_block() -> ml_collections.ConfigDict:
    """One encoder stack of the original Transformer base (Vaswani et al. 2017, Table 3 "base"):
    d = 512, d_ff = 2048, h = 8, ReLU FFN, biases on every projection, Post-LN LayerNorm,
    sinusoidal positions (no parameters), 37,000-token shared BPE vocabulary with the embedding
    tied to the pre-softmax projection (§3.4), N = 6 layers."""
    return _resolved(vocab_size=37000, d_model=512, num_layers=6, linear_bias=True,
                     attention=dict(num_heads=8, num_kv_heads=8),
                     ffn=dict(name="mlp", d_ff=2048, activation="relu"),
                     norm=dict(name="layernorm", final=False), residual=dict(name="postnorm"),
                     position=dict(name="none"), head=dict(name="tied"))


def transformer_base_parameters() -> dict[str, int]:
    """The encoder–decoder Transformer base counted from this framework's components (the
    decoder-only model has no cross-attention, so the decoder is assembled from the same parts):
    encoder layer = attention + FFN + 2 LayerNorms; decoder layer = encoder layer + a
    cross-attention + its LayerNorm; one embedding table shared by encoder input, decoder input
    and the output projection. Returns the totals and `ffn_share_of_block` (FFN weights over a
    block's weight matrices, biases excluded: 2·d·d_ff / (4d² + 2·d·d_ff) = 2/3)."""
    cfg = transformer_base_block()
    parts = parameter_breakdown(cfg)
    layers, d, d_ff = cfg.num_layers, cfg.d_model, cfg.ffn.d_ff
    attention, norm = parts["attention"] // layers, parts["norms"] // (2 * layers)
    encoder = parts["attention"] + parts["ffn"] + parts["norms"]
    decoder = encoder + layers * (attention + norm)
    return {"total": parts["embedding"] + encoder + decoder, "embedding": parts["embedding"],
            "encoder": encoder, "decoder": decoder,
            "ffn_share_of_block": 2 * d * d_ff / (4 * d * d + 2 * d * d_ff)}


def worked_examples() -> dict[str, ml_collections.ConfigDict]:
    """The seeds' worked shapes (parameter-only examples):

      tying      V = 50,000, d = 2,048: tying the output projection to the embedding saves
                 V·d = 102.4M parameters (`parameter_breakdown(...)["tying_savings"]`);
      wide_glu   d = 4,096 with 32 heads (p = 128) and a 14,336-wide gated FFN: 3·d·d_ff =
                 10.5·d² FFN parameters per block (the Llama 3 8B / Mistral 7B block).
    """
    return {
        "tying": _resolved(vocab_size=50000, d_model=2048, num_layers=1,
                           attention=dict(num_heads=16, num_kv_heads=16),
                           head=dict(name="untied")),
        "wide_glu": _resolved(vocab_size=32000, d_model=4096, num_layers=1,
                              attention=dict(num_heads=32, num_kv_heads=32),
                              ffn=dict(name="swiglu", d_ff=14336)),
    }
