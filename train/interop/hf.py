"""Hugging Face checkpoints ↔ `TransformerLM`: Llama-family and GPT-2 models from local safetensors,
and back (`hf_tensors_from_params`, the exporter's half; `train/interop/export_hf.py`).

    model_cfg, model = load_hf_checkpoint("path/to/dir")   # config.json + model.safetensors
                                                           # (or model.safetensors.index.json)

The imported model's float32 logits equal the `transformers` implementation's on the same weights
(tests/test_hf_import.py). Nothing is downloaded, and neither torch nor transformers is used:
tensors are read with `safetensors`' numpy API (BF16 through `ml_dtypes`) and cast to float32.
The architecture (config.json → our model config, and what raises) is `arch.hf_config`'s.

Weights (`params_from_hf`). Names are those `save_pretrained` writes for *ForCausalLM; the base
prefix ("model." / "transformer.") may be absent (e.g. openai-community/gpt2). Our Dense kernels
are in_shape + out_shape; torch `nn.Linear` stores (out, in), hence ᵀ; GPT-2's `Conv1D` stores
(in, out). Per-layer tensors (layer i) are stacked on our leading `layers` axis (L×, not shown).
V vocab, d width, N positions, H / K query / key-value heads, P head width, F = d_ff.

    Llama / Mistral                          shape      ours                                shape
    model.embed_tokens.weight                V×d        embed/embedding                     V×d
    model.layers.i.input_layernorm.weight    d          blocks/attention_residual/norm/scale d
    model.layers.i.self_attn.q_proj.weight   (H·P)×d  ᵀ blocks/attention/query/kernel       d×H×P
    model.layers.i.self_attn.k_proj.weight   (K·P)×d  ᵀ blocks/attention/key/kernel         d×K×P
    model.layers.i.self_attn.v_proj.weight   (K·P)×d  ᵀ blocks/attention/value/kernel       d×K×P
    model.layers.i.self_attn.o_proj.weight   d×(H·P)  ᵀ blocks/attention/output/kernel      H×P×d
    model.layers.i.post_attention_layernorm.weight d    blocks/ffn_residual/norm/scale      d
    model.layers.i.mlp.gate_proj.weight      F×d      ᵀ blocks/ffn/gate/kernel              d×F
    model.layers.i.mlp.up_proj.weight        F×d      ᵀ blocks/ffn/up/kernel                d×F
    model.layers.i.mlp.down_proj.weight      d×F      ᵀ blocks/ffn/down/kernel              F×d
    model.norm.weight                        d          final_norm/scale                    d
    lm_head.weight (untied head)             V×d      ᵀ head/output/kernel                  d×V

    GPT-2                                    shape      ours                                shape
    transformer.wte.weight                   V×d        embed/embedding                     V×d
    transformer.wpe.weight                   N×d        position/table                      N×d
    transformer.h.i.ln_1.weight, .bias       d          blocks/attention_residual/norm/scale, bias
    transformer.h.i.attn.c_attn.weight       d×3d       blocks/attention/{query,key,value}/kernel
                                                        (column thirds [q | k | v])         d×H×P
    transformer.h.i.attn.c_attn.bias         3d         blocks/attention/{query,key,value}/bias
                                                        (thirds)                            H×P
    transformer.h.i.attn.c_proj.weight       d×d        blocks/attention/output/kernel      H×P×d
    transformer.h.i.attn.c_proj.bias         d          blocks/attention/output/bias        d
    transformer.h.i.ln_2.weight, .bias       d          blocks/ffn_residual/norm/scale, bias
    transformer.h.i.mlp.c_fc.weight, .bias   d×F, F     blocks/ffn/up/kernel, bias          d×F, F
    transformer.h.i.mlp.c_proj.weight, .bias F×d, d     blocks/ffn/down/kernel, bias        F×d, d
    transformer.ln_f.weight, .bias           d          final_norm/scale, bias              d
    lm_head.weight (untied head)             V×d      ᵀ head/output/kernel                  d×V

A tied head has no lm_head.weight, or one equal to the embedding (consumed, checked). Ignored
buffers: GPT-2's h.i.attn.bias / h.i.attn.masked_bias (causal masks), Llama's
layers.i.self_attn.rotary_emb.inv_freq. Every other tensor must be consumed and every parameter
filled, else ValueError listing the missing and unexpected names.

Checked, not assumed (the logits tests): HF Llama's `rotate_half` with cos/sin of cat(θ, θ)
rotates feature pairs (j, j + P/2) of a head by t·base^(−2j/P), as `arch.positions.RoPE` does, and
q_proj/k_proj rows are head-major (viewed as H×P), so no permutation is needed; GPT-2's c_attn
columns are [q | k | v], each head-major.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import jax.numpy as jnp
import ml_collections
import ml_dtypes  # noqa: F401 -- registers bfloat16 with numpy: safetensors needs it for BF16
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from arch.accounting import abstract_model
from arch.hf_config import LLAMA_GATED_FFN, model_config_from_hf
from arch.model import TransformerLM
from config import ConfigError, lookup
from config.catalogue import OUTPUT_TABLE, ROTARY, TIES_EMBEDDING, has
from train.data.arguments import read_json_object
from train.interop.safetensors_file import safetensors_problem

BASE_PREFIX = {"llama": "model.", "gpt2": "transformer."}
IGNORED_SUFFIXES = {"llama": (".rotary_emb.inv_freq",), "gpt2": (".attn.bias", ".attn.masked_bias")}
# Components each weight layout fills; `params_from_hf` refuses a config outside them.
LAYOUTS = {
    "llama": {"attention.name": "mha", "norm.name": "rmsnorm", "position.name": "rope",
              "residual.name": "prenorm",
              "ffn.name": tuple(sorted(set(LLAMA_GATED_FFN.values()))), "linear_bias": False},
    "gpt2": {"attention.name": "mha", "norm.name": "layernorm", "position.name": "learned",
             "residual.name": "prenorm", "ffn.name": ("mlp",), "linear_bias": True},
}
COMMON_LAYOUT = {"head.name": ("tied", "untied"), "head.bias": False, "norm.final": True,
                 "use_ffn": True, "fixnorm": False, "reversible": False}


# Weights ------------------------------------------------------------------------------------------

Transform = Callable[[np.ndarray], np.ndarray]
# (Hugging Face name, its shape, [(our path, transform to our shape), ...]); per-layer names are
# relative to the layer prefix and our paths to `blocks`.
Rule = tuple[str, tuple[int, ...], list[tuple[tuple[str, ...], Transform]]]


def _layout(cfg) -> str:
    """Which weight layout fills `cfg`'s parameters; ValueError if the config is in neither."""
    layout = "llama" if has("position", cfg.position.name, ROTARY) else "gpt2"
    for field, valid in {**LAYOUTS[layout], **COMMON_LAYOUT}.items():
        allowed = valid if isinstance(valid, tuple) else (valid,)
        if (value := lookup(cfg, field)) not in allowed:
            raise ValueError(f"model.{field}={value!r} is not in the {layout} weight "
                             "layout "
                             f"(needs {' or '.join(map(repr, allowed))})")
    return layout


def _llama_rules(cfg) -> tuple[list[Rule], list[Rule]]:
    attention = cfg.attention
    d, h, k, p, f, v = (cfg.d_model, attention.num_heads, attention.num_kv_heads,
                        attention.head_dim, cfg.ffn.d_ff, cfg.vocab_size)
    transpose = lambda w: w.T
    top = [("model.embed_tokens.weight", (v, d), [(("embed", "embedding"), np.asarray)]),
           ("model.norm.weight", (d,), [(("final_norm", "scale"), np.asarray)])]
    if has("head", cfg.head.name, OUTPUT_TABLE):
        top.append(("lm_head.weight", (v, d), [(("head", "output", "kernel"), transpose)]))
    layer = [
        ("input_layernorm.weight", (d,), [(("attention_residual", "norm", "scale"), np.asarray)]),
        ("self_attn.q_proj.weight", (h * p, d),
         [(("attention", "query", "kernel"), lambda w: w.T.reshape(d, h, p))]),
        ("self_attn.k_proj.weight", (k * p, d),
         [(("attention", "key", "kernel"), lambda w: w.T.reshape(d, k, p))]),
        ("self_attn.v_proj.weight", (k * p, d),
         [(("attention", "value", "kernel"), lambda w: w.T.reshape(d, k, p))]),
        ("self_attn.o_proj.weight", (d, h * p),
         [(("attention", "output", "kernel"), lambda w: w.T.reshape(h, p, d))]),
        ("post_attention_layernorm.weight", (d,),
         [(("ffn_residual", "norm", "scale"), np.asarray)]),
        ("mlp.gate_proj.weight", (f, d), [(("ffn", "gate", "kernel"), transpose)]),
        ("mlp.up_proj.weight", (f, d), [(("ffn", "up", "kernel"), transpose)]),
        ("mlp.down_proj.weight", (d, f), [(("ffn", "down", "kernel"), transpose)]),
    ]
    return top, layer


def _gpt2_rules(cfg) -> tuple[list[Rule], list[Rule]]:
    d, h, p = cfg.d_model, cfg.attention.num_heads, cfg.attention.head_dim
    f, v = cfg.ffn.d_ff, cfg.vocab_size
    same = np.asarray

    def third(j: int, shape: tuple[int, ...]) -> Transform:  # c_attn's columns: [q | k | v]
        return lambda w: np.split(w, 3, axis=-1)[j].reshape(shape)

    def norm(name: str, ours: str) -> list[Rule]:
        return [(f"{name}.weight", (d,), [((ours, "norm", "scale"), same)]),
                (f"{name}.bias", (d,), [((ours, "norm", "bias"), same)])]

    top = [("transformer.wte.weight", (v, d), [(("embed", "embedding"), same)]),
           ("transformer.wpe.weight", (cfg.max_seq_len, d), [(("position", "table"), same)]),
           ("transformer.ln_f.weight", (d,), [(("final_norm", "scale"), same)]),
           ("transformer.ln_f.bias", (d,), [(("final_norm", "bias"), same)])]
    if has("head", cfg.head.name, OUTPUT_TABLE):
        top.append(("lm_head.weight", (v, d), [(("head", "output", "kernel"), lambda w: w.T)]))
    layer = [
        *norm("ln_1", "attention_residual"),
        ("attn.c_attn.weight", (d, 3 * d),
         [(("attention", name, "kernel"), third(j, (d, h, p)))
          for j, name in enumerate(("query", "key", "value"))]),
        ("attn.c_attn.bias", (3 * d,),
         [(("attention", name, "bias"), third(j, (h, p)))
          for j, name in enumerate(("query", "key", "value"))]),
        ("attn.c_proj.weight", (d, d),
         [(("attention", "output", "kernel"), lambda w: w.reshape(h, p, d))]),
        ("attn.c_proj.bias", (d,), [(("attention", "output", "bias"), same)]),
        *norm("ln_2", "ffn_residual"),
        ("mlp.c_fc.weight", (d, f), [(("ffn", "up", "kernel"), same)]),
        ("mlp.c_fc.bias", (f,), [(("ffn", "up", "bias"), same)]),
        ("mlp.c_proj.weight", (f, d), [(("ffn", "down", "kernel"), same)]),
        ("mlp.c_proj.bias", (d,), [(("ffn", "down", "bias"), same)]),
    ]
    return top, layer


RULES = {"llama": _llama_rules, "gpt2": _gpt2_rules}
LAYER_PREFIX = {"llama": "model.layers.", "gpt2": "transformer.h."}
HEAD_NAME = "lm_head.weight"
EMBEDDING_NAME = {"llama": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}


def _with_base_prefix(tensors: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """Names as `save_pretrained` writes them for *ForCausalLM: the base prefix added where a
    checkpoint of the bare base model omits it (lm_head.* is outside the base model)."""
    named = {}
    for name, array in tensors.items():
        full = name if name.startswith((prefix, "lm_head.")) else prefix + name
        if full in named:
            raise ValueError(f"checkpoint tensor {full} appears twice (as {name} and {full})")
        named[full] = array
    return named


def _listed(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def params_from_hf(model_cfg, tensors: Mapping[str, np.ndarray]) -> nnx.State:
    """Our parameters (`nnx.Param` State of `TransformerLM(model_cfg)`, float32, layers stacked)
    from Hugging Face tensors by name (see the tables in the module docstring).

    Raises ValueError for a tensor whose shape disagrees with the config, for a config outside
    the two weight layouts, and, listing the names, for missing and unexpected tensors."""
    layout = _layout(model_cfg)
    named = _with_base_prefix(tensors, BASE_PREFIX[layout])
    top_rules, layer_rules = RULES[layout](model_cfg)
    consumed: set[str] = set()
    missing: list[str] = []

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        if name not in named:
            missing.append(name)
            return None
        consumed.add(name)
        if tuple(named[name].shape) != shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(named[name].shape)}; "
                             f"config.json implies {shape}")
        return np.asarray(named[name], dtype=np.float32)

    values: dict[tuple[str, ...], np.ndarray] = {}
    for name, shape, targets in top_rules:
        weight = read(name, shape)
        if weight is not None:
            values.update((path, transform(weight)) for path, transform in targets)
    layer_prefix = LAYER_PREFIX[layout]
    for name, shape, targets in layer_rules:
        per_layer = [read(f"{layer_prefix}{i}.{name}", shape)
                     for i in range(model_cfg.num_layers)]
        if any(weight is None for weight in per_layer):
            continue
        for path, transform in targets:
            values[("blocks", *path)] = np.stack([transform(weight) for weight in per_layer])
    if has("head", model_cfg.head.name, TIES_EMBEDDING) and HEAD_NAME in named:
        consumed.add(HEAD_NAME)
        embedding = named.get(EMBEDDING_NAME[layout])
        if embedding is not None and not np.array_equal(named[HEAD_NAME], embedding):
            raise ValueError(f"config.json ties the head (tie_word_embeddings) but {HEAD_NAME} "
                             f"differs from {EMBEDDING_NAME[layout]}")
    unexpected = sorted(name for name in named if name not in consumed
                        and not name.endswith(IGNORED_SUFFIXES[layout]))
    if missing or unexpected:
        raise ValueError(f"checkpoint tensors do not match config.json ({layout} layout, "
                         f"{model_cfg.num_layers} layers): missing {_listed(missing)}; "
                         f"unexpected {_listed(unexpected)}")

    flat = nnx.to_flat_state(nnx.state(abstract_model(model_cfg), nnx.Param))
    filled = []
    for path, variable in flat:  # a failure here is a rule table out of step with the model
        value = values.get(tuple(map(str, path)))
        if value is None or value.shape != variable.shape:
            raise ValueError(f"no checkpoint tensor fills {'/'.join(map(str, path))} "
                             f"{variable.shape} (got {None if value is None else value.shape})")
        filled.append((path, variable.replace(jnp.asarray(value, jnp.float32))))
    return nnx.from_flat_state(filled)


def hf_tensors_from_params(model_cfg, params: nnx.State) -> dict[str, np.ndarray]:
    """Hugging Face tensors by name (float32, the names `save_pretrained` writes, no lm_head for
    a tied head) from our parameters: the inverse of `params_from_hf`, by the same rule tables.
    Each rule's transforms only move entries (transpose, reshape, split into thirds), so
    applying them to the indices 0…n−1 of the Hugging Face tensor tells where each of our
    entries goes back; every entry must be written exactly once. ValueError (one line) for a
    config outside the two weight layouts."""
    layout = _layout(model_cfg)
    ours = {tuple(map(str, path)): np.asarray(variable[...], np.float32)
            for path, variable in nnx.to_flat_state(params)}
    top_rules, layer_rules = RULES[layout](model_cfg)

    def gather(shape: tuple[int, ...], targets, read) -> np.ndarray:
        index = np.arange(int(np.prod(shape))).reshape(shape)
        flat, written = np.zeros(index.size, np.float32), np.zeros(index.size, int)
        for path, transform in targets:
            where = np.asarray(transform(index)).ravel()
            flat[where] = read(path).ravel()
            written[where] += 1
        assert np.all(written == 1), "a weight rule does not cover its tensor exactly once"
        return flat.reshape(shape)

    tensors = {name: gather(shape, targets, lambda path: ours[path])
               for name, shape, targets in top_rules}
    for name, shape, targets in layer_rules:
        for i in range(model_cfg.num_layers):
            tensors[f"{LAYER_PREFIX[layout]}{i}.{name}"] = gather(
                shape, targets, lambda path, i=i: ours[("blocks", *path)][i])
    return tensors


def model_from_params(model_cfg, params: nnx.State) -> TransformerLM:
    """`TransformerLM(model_cfg)` holding `params` (no random initialization is run)."""
    graphdef, _, rest = nnx.split(abstract_model(model_cfg), nnx.Param, ...)
    return nnx.merge(graphdef, params, rest)


# Files --------------------------------------------------------------------------------------------

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
REPLACE_FILE = ("download or copy the checkpoint's files again (e.g. with huggingface-cli "
                "download), then rerun")


def _checkpoint_directory(directory: str | Path) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    return directory


def read_hf_config(directory: str | Path) -> dict:
    """The checkpoint's config.json as a dict."""
    path = _checkpoint_directory(directory) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: a Hugging Face checkpoint directory "
                                f"holds config.json and {SINGLE_FILE} (or {INDEX_FILE})")
    config = read_json_object(path, f"--checkpoint={directory} is invalid", REPLACE_FILE)
    if not isinstance(config.get("model_type"), str):
        raise ConfigError(f"--checkpoint={directory} is invalid: {path} has no model_type "
                          f"string (found {config.get('model_type')!r}); it is left as is: "
                          f"{REPLACE_FILE}")
    return config


def read_safetensors(directory: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint (in its stored dtype) by name, from `model.safetensors` or
    the shards named by `model.safetensors.index.json`."""
    directory = _checkpoint_directory(directory)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json_object(index_path, f"--checkpoint={directory} is invalid",
                                      REPLACE_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(file, str) for file in weight_map.values()):
            raise ConfigError(f"--checkpoint={directory} is invalid: {index_path} has no "
                              "weight_map object of tensor names to shard files; it is left as "
                              f"is: {REPLACE_FILE}")
        files = sorted(set(weight_map.values()))
    elif (directory / SINGLE_FILE).exists():
        weight_map, files = None, [SINGLE_FILE]
    else:
        others = sorted(p.name for p in directory.glob("*.bin"))
        hint = f" (found {', '.join(others)}: convert it to safetensors)" if others else ""
        raise FileNotFoundError(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        path = directory / file
        if not path.exists():
            raise FileNotFoundError(f"{index_path} names the shard {file}, which is missing")
        problem = safetensors_problem(path)
        if problem is None:
            try:
                with safe_open(path, framework="numpy") as shard:
                    for name in shard.keys():
                        if name in tensors:
                            raise ValueError(f"checkpoint tensor {name} appears in two shards")
                        tensors[name] = shard.get_tensor(name)
            except SafetensorError as error:
                problem = f"does not read ({str(error).strip().splitlines()[0]})"
        if problem is not None:
            raise ConfigError(f"--checkpoint={directory} is invalid: {path} {problem}; it is "
                              f"left as is: {REPLACE_FILE}")
    if weight_map is not None and set(weight_map) - set(tensors):
        absent = sorted(set(weight_map) - set(tensors))
        raise ValueError(f"{index_path} lists tensors its shards lack: {_listed(absent)}")
    return tensors


def load_hf_checkpoint(directory: str | Path) -> tuple[ml_collections.ConfigDict, TransformerLM]:
    """(model config, TransformerLM with the checkpoint's weights) from a local Hugging Face
    checkpoint directory: config.json plus model.safetensors or a sharded
    model.safetensors.index.json. FileNotFoundError for a missing directory or file;
    ValueError for anything that would not be imported exactly."""
    model_cfg = model_config_from_hf(read_hf_config(directory))
    params = params_from_hf(model_cfg, read_safetensors(directory))
    return model_cfg, model_from_params(model_cfg, params)
