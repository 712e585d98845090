"""Hugging Face config.json ↔ our model config: the architecture half of the checkpoint importer
and exporter (`train/interop/hf.py` converts the weights). Pure functions of a dict, so the
accounting of public models (`arch.reference_shapes`) reads them without the importer.
`hf_config_from_model` is the inverse of `model_config_from_hf` below, refusing what the table
cannot express.

Architecture (`model_config_from_hf`: config.json → `config.defaults.model_config()` fields):

    ours                    llama / mistral                          gpt2
    vocab_size              vocab_size                               vocab_size
    d_model                 hidden_size                              n_embd
    num_layers              num_hidden_layers                        n_layer
    attention.num_heads     num_attention_heads                      n_head
    attention.num_kv_heads  num_key_value_heads (default: heads)     n_head
    attention.head_dim      head_dim (default: hidden/heads; h·p ≠ d n_embd/n_head
                            sets attention.width)
    ffn.d_ff                intermediate_size                        n_inner (default: 4·n_embd)
    norm.eps                rms_norm_eps                             layer_norm_epsilon
    position.rope_base      rope_theta or rope_parameters.rope_theta —
    max_seq_len             max_position_embeddings                  n_positions
    attention.window        mistral sliding_window (null, or ≥       —
                            max_position_embeddings: 0, full causal)
    head.name               tie_word_embeddings (default false)      tie_word_embeddings (default
                            → "tied" / "untied"                      true)
    ffn.name                hidden_act silu, swish / relu / sigmoid  "mlp"
                            / gelu_new, gelu_pytorch_tanh
                            → swiglu / reglu / glu / geglu
    ffn.activation          —                                        activation_function gelu_new,
                                                                     gelu_pytorch_tanh / relu /
                                                                     silu, swish / tanh / sigmoid
                                                                     → gelu / relu / silu / tanh /
                                                                     sigmoid
    norm.name, position.name "rmsnorm", "rope"                       "layernorm", "learned"
    linear_bias             False                                    True

Both: the defaults for the rest (attention.name="mha", residual.name="prenorm", norm.final=True,
head.bias=False, dtype float32).
Our "gelu" is the tanh approximation, which is HF's gelu_new / gelu_pytorch_tanh (HF's "gelu" is
the erf form and raises). What the framework cannot represent raises ValueError naming the field
and value, never a silently different model: any `rope_scaling` (or `rope_parameters` other than
plain {rope_type: default, rope_theta}); llama `attention_bias` / `mlp_bias` true; gpt2
`scale_attn_weights` false, `scale_attn_by_inverse_layer_idx` true, `add_cross_attention` true;
an activation without an exact counterpart; any other model_type.
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_collections

from config.defaults import model_config
from config.model_rules import resolve_model

LLAMA_FAMILY = ("llama", "mistral")
MODEL_TYPES = (*LLAMA_FAMILY, "gpt2")
# Hugging Face activation name → our gated FFN (Llama: φ(x W_gate) ⊙ x W_up) and our activation
# (GPT-2 MLP). Only exact counterparts: our "gelu" is the tanh approximation (HF gelu_new).
LLAMA_GATED_FFN = {"silu": "swiglu", "swish": "swiglu", "relu": "reglu", "sigmoid": "glu",
                   "gelu_new": "geglu", "gelu_pytorch_tanh": "geglu"}
GPT2_ACTIVATION = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu",
                   "silu": "silu", "swish": "silu", "tanh": "tanh", "sigmoid": "sigmoid"}

def _unsupported(field: str, value, why: str) -> ValueError:
    return ValueError(f"config.json {field}={value!r} is not supported: {why}")


def _required(hf_config: Mapping, field: str):
    if hf_config.get(field) is None:
        raise ValueError(f"config.json has no {field!r}, which a model_type="
                         f"{hf_config.get('model_type')!r} checkpoint must give")
    return hf_config[field]


def _rope_base(hf_config: Mapping) -> float:
    """θ of plain RoPE; any frequency scaling raises (ours has none). Reads both the
    transformers ≥ 5 form (`rope_parameters`) and the older `rope_theta` + `rope_scaling`."""
    if hf_config.get("rope_scaling") is not None:
        raise _unsupported("rope_scaling", hf_config["rope_scaling"],
                           "blockbench's RoPE has no frequency scaling; only rope_scaling=null "
                           "imports exactly")
    parameters = hf_config.get("rope_parameters")
    if parameters is None:
        return float(hf_config.get("rope_theta", 10_000.0))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind != "default" or set(parameters) - {"rope_type", "type", "rope_theta"}:
        raise _unsupported("rope_parameters", parameters,
                           "blockbench's RoPE has no frequency scaling; only {'rope_type': "
                           "'default', 'rope_theta': θ} imports exactly")
    return float(parameters.get("rope_theta", hf_config.get("rope_theta", 10_000.0)))


def _llama_fields(hf: Mapping) -> dict:
    model_type = hf["model_type"]
    if model_type == "llama":
        for field in ("attention_bias", "mlp_bias"):
            if hf.get(field):
                raise _unsupported(field, hf[field], "blockbench's Llama layout has no biases "
                                   "(model.linear_bias puts them on attention and FFN together)")
    max_positions = int(_required(hf, "max_position_embeddings"))
    # Mistral's band: key s visible to query t iff t − W < s ≤ t (transformers'
    # `sliding_window_overlay`), which is attention.window=W
    # (`arch.kernels.attention_implementations.allowed_mask`).
    window = hf.get("sliding_window") if model_type == "mistral" else None
    window = int(window) if window is not None and window < max_positions else 0
    hidden_act = hf.get("hidden_act", "silu")
    if hidden_act not in LLAMA_GATED_FFN:
        raise _unsupported("hidden_act", hidden_act, "supported: "
                           f"{', '.join(sorted(LLAMA_GATED_FFN))} (gated FFN φ(x W_gate) ⊙ x W_up)")
    d, heads = int(_required(hf, "hidden_size")), int(_required(hf, "num_attention_heads"))
    head_dim = int(hf.get("head_dim") or d // heads)
    return dict(
        vocab_size=int(_required(hf, "vocab_size")), d_model=d,
        num_layers=int(_required(hf, "num_hidden_layers")), max_seq_len=max_positions,
        attention=dict(num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                       head_dim=head_dim, window=window,
                       width=None if heads * head_dim == d else heads * head_dim),
        ffn=dict(name=LLAMA_GATED_FFN[hidden_act], d_ff=int(_required(hf, "intermediate_size"))),
        norm=dict(name="rmsnorm", eps=float(_required(hf, "rms_norm_eps"))),
        position=dict(name="rope", rope_base=_rope_base(hf)), linear_bias=False,
        head=dict(name="tied" if hf.get("tie_word_embeddings", False) else "untied"))


def _gpt2_fields(hf: Mapping) -> dict:
    for field, exact in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                         ("add_cross_attention", False)):
        if hf.get(field, exact) != exact:
            raise _unsupported(field, hf[field], f"only {field}={str(exact).lower()} imports "
                               "exactly (blockbench scales attention scores by 1/√P in every "
                               "layer and has no cross-attention)")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATION:
        raise _unsupported("activation_function", activation,
                           f"supported: {', '.join(sorted(GPT2_ACTIVATION))} (blockbench's "
                           "'gelu' is the tanh approximation, HF's gelu_new; HF's 'gelu' is the "
                           "erf form)")
    d = int(_required(hf, "n_embd"))
    heads = int(_required(hf, "n_head"))
    return dict(
        vocab_size=int(_required(hf, "vocab_size")), d_model=d,
        num_layers=int(_required(hf, "n_layer")), max_seq_len=int(_required(hf, "n_positions")),
        attention=dict(num_heads=heads, num_kv_heads=heads),
        ffn=dict(name="mlp", d_ff=int(hf.get("n_inner") or 4 * d),
                 activation=GPT2_ACTIVATION[activation]),
        norm=dict(name="layernorm", eps=float(_required(hf, "layer_norm_epsilon"))),
        position=dict(name="learned"), linear_bias=True,
        head=dict(name="tied" if hf.get("tie_word_embeddings", True) else "untied"))


# Our model fields that do not change the function a Llama or GPT-2 computes: how it was
# initialized and trained (dtype, dropout, the multi-token-prediction modules, which next-token
# generation never runs and the export leaves out), how d_ff was derived, and the options of
# components it does not use (which a run may still carry). Every other field must survive the
# round trip model → config.json → model, or the export is refused.
INERT_FIELDS = ("init.", "dtype", "dropout.", "head.mtp_", "ffn.ratio", "ffn.width",
                "ffn.multiple_of", "ffn.leaky_relu_slope", "mla.", "moe.", "hyper.", "attnres.",
                "gated_residual.", "deltanet.", "residual.streams", "residual.dynamic",
                "norm.batchnorm_momentum", "norm.dyt_alpha_init", "norm.gated_rank", "head.mos_",
                "fixnorm_scale", "branch_scale.layerscale_init", "branch_scale.multiplier")


def _flat(config: Mapping, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _inverse(names: Mapping[str, str]) -> dict[str, str]:
    """ours → the first Hugging Face name that maps to it (silu before swish, gelu_new first)."""
    inverse: dict[str, str] = {}
    for theirs, ours in names.items():
        inverse.setdefault(ours, theirs)
    return inverse


def hf_config_from_model(cfg) -> dict:
    """The Hugging Face config.json dict of a resolved model config: the inverse of
    `model_config_from_hf`. RoPE models export as "llama" ("mistral" with a sliding window),
    learned positions as "gpt2" (float32 weights, `architectures` set for
    `AutoModelForCausalLM`). Raises ValueError in one line,
    naming the first field whose value the exported config.json would not reproduce (an AttnRes
    stream, a LayerScale, a MoE FFN, ...)."""
    if cfg.position.name == "rope":
        gated = _inverse(LLAMA_GATED_FFN)
        if cfg.ffn.name not in gated:
            raise ValueError(f"model.ffn.name={cfg.ffn.name!r} cannot be exported as llama: its "
                             f"FFN is gated ({', '.join(sorted(gated))})")
        window = cfg.attention.window
        hf = dict(model_type="mistral" if window else "llama",
                  architectures=["MistralForCausalLM" if window else "LlamaForCausalLM"],
                  **(dict(sliding_window=window) if window else {}),
                  vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                  intermediate_size=cfg.ffn.d_ff, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.attention.num_heads,
                  num_key_value_heads=cfg.attention.num_kv_heads,
                  head_dim=cfg.attention.head_dim, hidden_act=gated[cfg.ffn.name],
                  max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm.eps,
                  rope_theta=cfg.position.rope_base, rope_scaling=None,
                  attention_bias=False, mlp_bias=False,
                  tie_word_embeddings=cfg.head.name == "tied")
    elif cfg.position.name == "learned":
        activations = _inverse(GPT2_ACTIVATION)
        if cfg.ffn.activation not in activations:
            raise ValueError(f"model.ffn.activation={cfg.ffn.activation!r} cannot be exported as "
                             f"gpt2 (has: {', '.join(sorted(activations))})")
        hf = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"],
                  vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_layer=cfg.num_layers,
                  n_head=cfg.attention.num_heads, n_inner=cfg.ffn.d_ff,
                  n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm.eps,
                  activation_function=activations[cfg.ffn.activation],
                  tie_word_embeddings=cfg.head.name == "tied")
    else:
        raise ValueError(f"model.position.name={cfg.position.name!r} cannot be exported: llama "
                         "needs 'rope', gpt2 'learned'")
    hf["torch_dtype"] = "float32"
    ours = _flat(cfg.to_dict())
    theirs = _flat(model_config_from_hf(hf).to_dict())
    for field, value in ours.items():
        if not field.startswith(INERT_FIELDS) and theirs.get(field) != value:
            raise ValueError(f"model.{field}={value!r} cannot be exported as {hf['model_type']}: "
                             f"its config.json would give {theirs.get(field)!r}")
    return hf


def model_config_from_hf(hf_config: Mapping) -> ml_collections.ConfigDict:
    """Our (resolved) model config for a Hugging Face config.json dict: model_type "llama",
    "mistral" (Llama with a sliding window: `attention.window`) or "gpt2".
    Raises ValueError naming the field and value for anything not represented exactly."""
    model_type = hf_config.get("model_type")
    if model_type in LLAMA_FAMILY:
        fields = _llama_fields(hf_config)
    elif model_type == "gpt2":
        fields = _gpt2_fields(hf_config)
    else:
        raise _unsupported("model_type", model_type, f"supported: {', '.join(MODEL_TYPES)}")
    cfg = model_config()
    cfg.update(fields)  # over the defaults: mha, prenorm, a final norm, no head bias, float32
    resolve_model(cfg)
    return cfg

