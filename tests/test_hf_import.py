"""Hugging Face import (arch/hf_config.py, train/interop/hf.py and import_hf.py): tiny random
Llama, Mistral and GPT-2 models built with `transformers`, saved as safetensors, imported, and
their float32 logits compared with transformers' own; BF16 and prefix-less checkpoints; the exact
errors for an unsupported config field and for missing/unexpected tensors; the run-directory
round trip."""

import json
import re
from pathlib import Path

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from arch.hf_config import model_config_from_hf
from config import ConfigError
from config.model_rules import resolve_model
from experiments.common import model_config
from scripts import import_hf as import_hf_script
from train.interop.hf import (
    load_hf_checkpoint,
    params_from_hf,
    read_hf_config,
    read_safetensors,
)
from train.restore import restore_run

VOCAB = 97
TOKENS_BxT = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
ATOL = 1e-4
LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=VOCAB, max_position_embeddings=64)
REFERENCES = {  # name → (model class, config, save_pretrained options)
    # GQA (2 KV heads), untied head, non-default θ
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        **LLAMA, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500.0), {}),
    # MQA, tied head, head_dim 16 (H·P = 64 ≠ d = 32), sharded files with an index
    "llama_tied_sharded": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        **LLAMA, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True),
        {"max_shard_size": "20KB"}),
    # a sliding window that never binds (≥ max_position_embeddings) is accepted
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig(
        **LLAMA, num_key_value_heads=2, sliding_window=64), {}),
    # a binding window (8 < the 16 tokens): attention.window=8; eager attention builds the
    # explicit band mask (test_transformers_applies_the_mistral_window)
    "mistral_window": (transformers.MistralForCausalLM, transformers.MistralConfig(
        **LLAMA, num_key_value_heads=2, sliding_window=8, attn_implementation="eager"), {}),
    "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32,
        bos_token_id=0, eos_token_id=0), {}),
}


def _randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter (norm gains and biases too) moved by N(0, 0.3²): attention is then sharp
    (a RoPE or head-layout error changes the logits by O(1), not by 1e-3 as at the 0.02
    initialization) and no norm is the identity."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return model.eval()


def _reference_logits(model: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(TOKENS_BxT)).logits.float().numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, np.ndarray]]:
    """name → (saved checkpoint directory, transformers' float32 logits on TOKENS_BxT)."""
    torch.manual_seed(0)
    saved = {}
    for name, (model_class, config, options) in REFERENCES.items():
        model = _randomized(model_class(config))
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory, safe_serialization=True, **options)
        saved[name] = (directory, _reference_logits(model))
    return saved


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_logits_equal_transformers(checkpoints, name):
    directory, reference = checkpoints[name]
    model_cfg, model = load_hf_checkpoint(directory)
    logits = np.asarray(model(jnp.asarray(TOKENS_BxT)))
    error = float(np.abs(logits - reference).max())
    print(f"{name}: max |Δlogit| = {error:.2e} (max |logit| {np.abs(reference).max():.1f})")
    assert error < ATOL
    assert (directory / "model.safetensors.index.json").exists() == name.endswith("sharded")
    expected = {"llama": ("rope", "untied", 2, 32, 500.0), "mistral": ("rope", "untied", 2, 32,
                                                                      10_000.0),
                "mistral_window": ("rope", "untied", 2, 32, 10_000.0),
                "llama_tied_sharded": ("rope", "tied", 1, 64, 10_000.0),
                "gpt2": ("learned", "tied", 4, 32, 10_000.0)}[name]
    assert (model_cfg.position.name, model_cfg.head.name, model_cfg.attention.num_kv_heads,
            model_cfg.attention.width, model_cfg.position.rope_base) == expected
    assert model_cfg.attention.window == (8 if name == "mistral_window" else 0)


def test_transformers_applies_the_mistral_window(checkpoints):
    """The reference the windowed import matches really is banded: transformers' Mistral
    without the window gives other logits from position W on, and the same before it."""
    directory, windowed = checkpoints["mistral_window"]
    full = transformers.MistralForCausalLM.from_pretrained(
        directory, sliding_window=None, attn_implementation="eager")
    difference = np.abs(_reference_logits(full.eval()) - windowed).max(axis=(0, 2))
    assert difference[:8].max() < 1e-5 and difference[8:].min() > 1e-2, difference


def test_bf16_and_prefixless_checkpoints_give_the_same_parameters(checkpoints, tmp_path):
    directory, _ = checkpoints["llama"]
    model = _randomized(REFERENCES["llama"][0](REFERENCES["llama"][1]))
    model.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    model_cfg, imported = load_hf_checkpoint(tmp_path)  # BF16 tensors, read through ml_dtypes
    q_proj = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(imported.blocks.attention.query.kernel[...][1],
                                  q_proj.T.reshape(32, 4, 8))
    # GPT-2 as openai-community/gpt2 stores it: no "transformer." prefix, causal-mask buffers
    gpt2_dir, _ = checkpoints["gpt2"]
    gpt2_cfg = model_config_from_hf(read_hf_config(gpt2_dir))
    tensors = read_safetensors(gpt2_dir)
    bare = {name.removeprefix("transformer."): value for name, value in tensors.items()}
    bare |= {f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 32, 32), np.float32)) for i in range(2)}
    for (path, ours), (_, theirs) in zip(nnx.to_flat_state(params_from_hf(gpt2_cfg, tensors)),
                                         nnx.to_flat_state(params_from_hf(gpt2_cfg, bare)),
                                         strict=True):
        np.testing.assert_array_equal(ours[...], theirs[...], err_msg=str(path))


def test_unsupported_fields_raise_naming_field_and_value(checkpoints):
    llama = read_hf_config(checkpoints["llama"][0])
    gpt2 = read_hf_config(checkpoints["gpt2"][0])
    llama3_scaling = {"rope_type": "llama3", "factor": 8.0}
    with pytest.raises(ValueError) as error:
        model_config_from_hf({**llama, "rope_scaling": llama3_scaling})
    assert str(error.value) == (
        "config.json rope_scaling={'rope_type': 'llama3', 'factor': 8.0} is not supported: "
        "blockbench's RoPE has no frequency scaling; only rope_scaling=null imports exactly")
    for hf_config, field, value in (
            ({**llama, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
             "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}),
            ({**llama, "attention_bias": True}, "attention_bias", True),
            ({**llama, "mlp_bias": True}, "mlp_bias", True),
            ({**llama, "hidden_act": "gelu"}, "hidden_act", "gelu"),
            ({**gpt2, "scale_attn_by_inverse_layer_idx": True},
             "scale_attn_by_inverse_layer_idx", True),
            ({**gpt2, "activation_function": "gelu"}, "activation_function", "gelu"),
            ({**gpt2, "model_type": "bert"}, "model_type", "bert")):
        with pytest.raises(ValueError, match=re.escape(f"config.json {field}={value!r} is not "
                                                       "supported: ")):
            model_config_from_hf(hf_config)
    # config.json from before transformers 5: top-level rope_theta, rope_scaling null
    legacy = {k: v for k, v in llama.items() if k != "rope_parameters"}
    assert model_config_from_hf({**legacy, "rope_theta": 5e5,
                                 "rope_scaling": None}).position.rope_base \
        == 5e5
    # linear_bias with a component that has no biases is a config error
    cfg = model_config()
    cfg.linear_bias, cfg.attention.name = True, "mla"
    with pytest.raises(ConfigError) as error:
        resolve_model(cfg)
    assert str(error.value) == ("model.linear_bias=True is invalid: model.attention.name='mla' "
                                "has no biases; use attention.name='mha' or linear_bias=False")


def test_missing_and_unexpected_tensors_are_listed(checkpoints, tmp_path):
    directory, _ = checkpoints["llama"]
    model_cfg = model_config_from_hf(read_hf_config(directory))
    tensors = read_safetensors(directory)
    tensors["model.layers.2.mlp.up_proj.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # ignored
    with pytest.raises(ValueError) as error:
        params_from_hf(model_cfg, tensors)
    assert str(error.value) == (
        "checkpoint tensors do not match config.json (llama layout, 2 layers): missing "
        "model.layers.1.mlp.up_proj.weight; unexpected model.layers.2.mlp.up_proj.weight")
    with pytest.raises(FileNotFoundError, match="checkpoint directory .*nowhere does not exist"):
        load_hf_checkpoint(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps(read_hf_config(directory)))
    with pytest.raises(FileNotFoundError, match="holds neither model.safetensors nor "
                                                "model.safetensors.index.json"):
        load_hf_checkpoint(tmp_path)


@pytest.mark.slow
def test_import_script_writes_a_run_that_restore_run_restores(checkpoints, tmp_path, capsys):
    directory, _ = checkpoints["gpt2"]
    workdir = tmp_path / "run"
    assert import_hf_script.main(["--checkpoint", str(directory), "--workdir", str(workdir)]) == 0
    program, step, state = restore_run(workdir)
    assert step == 0 and program.config.seq_len == 32  # the model's context, n_positions
    # The same model config and bit-equal parameters as the imported model, whose logits equal
    # transformers' (test_logits_equal_transformers): the restored run computes the same logits.
    model_cfg, imported = load_hf_checkpoint(directory)
    assert program.config.model.to_dict() == model_cfg.to_dict()
    restored, expected = (nnx.to_flat_state(params) for params in
                          (state["params"], nnx.state(imported, nnx.Param)))
    for (path, ours), (_, theirs) in zip(restored, expected, strict=True):
        np.testing.assert_array_equal(ours[...], theirs[...], err_msg=str(path))
    source = json.loads((workdir / "hf_source.json").read_text())
    assert source["hf_config"]["model_type"] == "gpt2"
    assert ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text())) \
        .data.name == "kjv"
    assert import_hf_script.main(["--checkpoint", str(directory), "--workdir", str(workdir)]) == 2
    assert "already holds a run" in capsys.readouterr().err
