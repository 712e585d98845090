"""Hugging Face export (arch/hf_config.py `hf_config_from_model`, train/interop/hf.py
`hf_tensors_from_params`, train/interop/export_hf.py): tiny Llama- and GPT-2-layout runs with
randomized parameters are exported, loaded by `transformers`, whose float32 logits must equal
ours; importing the export gives back the same parameters; the byte tokenizer's tokenizer.json
gives the byte ids; what cannot be exported is refused naming the field."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from arch.hf_config import hf_config_from_model
from config import ConfigError, resolve
from scripts import export_hf as export_hf_script
from tests.helpers import tiny_config
from train.checkpoint import Checkpointer
from train.data.tokenizer import ByteTokenizer
from train.interop.export_hf import export_run
from train.interop.hf import load_hf_checkpoint
from train.restore import restore_run
from train.step import build_program, resolve_for_job

TOKENS_BxT = np.random.default_rng(1).integers(0, 256, (2, 16))
RUNS = {  # name → model overrides of tests.helpers.tiny_config
    "llama": dict(attention__num_kv_heads=2, head="untied", position__rope_base=500.0),
    "mistral": dict(attention__num_kv_heads=1, attention__window=6),  # binds: 16 tokens
    # d = 32 not a multiple of 3 heads: MistralConfig takes it (LlamaConfig does not: refused)
    "mistral_head_dim": dict(attention__num_heads=3, attention__num_kv_heads=1,
                             attention__head_dim=16, attention__width=48, attention__window=6),
    # trained with dropout and two MTP modules, which the next-token export leaves out
    "llama_mtp_dropout": dict(head__mtp_depth=2, dropout=dict(residual=0.1)),
    "gpt2": dict(position="learned", norm="layernorm", ffn="mlp", linear_bias=True,
                 attention__num_kv_heads=4),
}


def write_run(workdir, **overrides):
    """A run directory as `python -m train` leaves it at step 0, every parameter moved by
    N(0, 0.3²) so that no norm is the identity and attention is sharp."""
    config = tiny_config(**overrides)
    config.mesh.data = -1  # every device, as the trainer would take them
    config = resolve_for_job(config)
    program = build_program(config)
    state = program.init(0)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(state["params"]))))
    state["params"] = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(keys), p.shape),
                                   state["params"])
    workdir.mkdir()
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    with Checkpointer(workdir) as checkpointer:
        checkpointer.save(0, state, {"next_step": 0, "seed": 0}, force=True)
    model = nnx.merge(program.graphdef, state["params"], state["model_state"])
    return config, model


@pytest.mark.parametrize("name", sorted(RUNS))
@pytest.mark.slow
def test_transformers_computes_the_exported_runs_logits(name, tmp_path):
    config, model = write_run(tmp_path / "run", **RUNS[name])
    out = tmp_path / "hf"
    assert export_hf_script.main(["--workdir", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == name.split("_")[0]
    reference = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = reference(torch.as_tensor(TOKENS_BxT)).logits.float().numpy()
    ours = np.asarray(model(jnp.asarray(TOKENS_BxT)))
    assert np.abs(ours).max() > 1.0  # randomized: the logits are not near zero
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    # import(export(run)): the same architecture and bit-equal parameters (but the MTP modules)
    model_cfg, imported = load_hf_checkpoint(out)
    assert hf_config_from_model(model_cfg) == hf_config_from_model(config.model)
    exported = {path: variable for path, variable in
                nnx.to_flat_state(nnx.state(model, nnx.Param)) if path[0] != "mtp"}
    for path, got in nnx.to_flat_state(nnx.state(imported, nnx.Param)):
        np.testing.assert_array_equal(got[...], exported.pop(path)[...], err_msg=str(path))
    assert not exported
    # the byte-level run's tokenizer.json encodes text to its byte ids and back
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "In the beginning — Génesis 1:1\n"
    assert tokenizer.encode(text, add_special_tokens=False) \
        == ByteTokenizer().encode(text).tolist()
    assert tokenizer.decode(ByteTokenizer().encode(text)) == text


def test_restore_run_reads_no_optimizer_state(tmp_path):
    write_run(tmp_path / "run")
    _, step, state = restore_run(tmp_path / "run")
    assert step == 0 and set(state) == {"step", "params", "model_state"}


@pytest.mark.slow
def test_what_cannot_be_exported_is_refused_naming_the_field(tmp_path, capsys):
    for overrides, message in (
            (dict(residual="attnres"), "model.residual.name='attnres' cannot be exported as "
                                       "llama: its config.json would give 'prenorm'"),
            (dict(ffn="mlp"), "model.ffn.name='mlp' cannot be exported as llama: its FFN is "
                              "gated (geglu, glu, reglu, swiglu)"),
            (dict(position="learned", ffn="mlp", norm="layernorm", linear_bias=True),
             "model.attention.num_kv_heads=2 cannot be exported as gpt2: its config.json would "
             "give 4"),
            (dict(position="none"), "model.position.name='none' cannot be exported: llama needs "
                                    "'rope', gpt2 'learned'")):
        config = tiny_config(**overrides)
        config = resolve(config, 1)
        with pytest.raises(ValueError) as error:
            hf_config_from_model(config.model)
        assert str(error.value) == message
    write_run(tmp_path / "run", branch_scale="layerscale")
    assert export_hf_script.main(["--workdir", str(tmp_path / "run"),
                                  "--out", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == ("error: model.branch_scale.name='layerscale' cannot be "
                                       "exported as llama: its config.json would give 'none'\n")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("overrides,message", [
    (dict(vocab_size=97), "model.vocab_size=97 cannot be exported: the run's tokenizer (byte) "
                          "has 256 tokens"),
    (dict(attention__num_heads=3, attention__num_kv_heads=1, attention__head_dim=16,
          attention__width=48),
     "model.attention.num_heads=3 cannot be exported as llama: transformers' LlamaConfig "
     "requires hidden_size (model.d_model=32) to be a multiple of num_attention_heads"),
], ids=["vocab-below-tokenizer", "heads-not-dividing-width"])
@pytest.mark.slow
def test_an_export_that_would_not_load_back_is_refused(tmp_path, overrides, message):
    """`export_run` refuses after restoring too (scripts/export_hf.py refuses before JAX:
    tests/test_bad_inputs.py), writing nothing; the rules are transformers' own."""
    config, _ = write_run(tmp_path / "run", **overrides)
    with pytest.raises(ConfigError) as error:
        export_run(tmp_path / "run", tmp_path / "hf")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert not (tmp_path / "hf").exists()
    if "vocab_size" in overrides:  # the byte tokenizer's ids reach past a 97-row embedding
        assert ByteTokenizer().vocab_size > config.model.vocab_size
        return
    model = config.model
    shape = dict(hidden_size=model.d_model, num_attention_heads=model.attention.num_heads,
                 num_key_value_heads=model.attention.num_kv_heads,
                 head_dim=model.attention.head_dim)
    with pytest.raises(Exception, match="not a multiple of the number of attention heads"):
        transformers.LlamaConfig(**shape)
    transformers.MistralConfig(**shape)  # a sliding window's config takes it (exported above)


@pytest.mark.slow
def test_ema_exports_the_ema_and_the_default_says_what_it_exports(tmp_path, capsys):
    """issue 61: an EMA run exported its raw parameters without saying so, and its EMA could not
    be exported."""
    from safetensors.numpy import load_file

    from train.interop.hf import hf_tensors_from_params

    config = tiny_config(**RUNS["llama"])
    config.mesh.data = -1
    config.optimizer.ema_decay = 0.9
    config = resolve_for_job(config)
    program = build_program(config)
    state = program.init(0)
    state["ema"] = jax.tree.map(lambda p: p * 0.5 + 0.25, state["params"])  # not the params
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(config.to_json_best_effort(indent=2))
    with Checkpointer(tmp_path / "run") as checkpointer:
        checkpointer.save(3, state, {"next_step": 3, "seed": 0}, force=True)
    for flags, entry, said in (
            ([], "params", "the parameters (not their EMA: --ema exports that) at step 3"),
            (["--ema"], "ema", "the EMA of the parameters (ema_decay=0.9) at step 3")):
        out = tmp_path / f"hf-{entry}"
        assert export_hf_script.main(["--workdir", str(tmp_path / "run"), "--out", str(out),
                                      *flags]) == 0
        assert capsys.readouterr().out.endswith(f"and the tokenizer: {said}\n")
        expected = hf_tensors_from_params(config.model, state[entry])
        written = load_file(out / "model.safetensors")
        assert written.keys() == expected.keys()
        for name in written:
            np.testing.assert_array_equal(written[name], expected[name], err_msg=name)
    write_run(tmp_path / "plain")  # no EMA: --ema is one line, before JAX loads anything
    assert export_hf_script.main(["--workdir", str(tmp_path / "plain"), "--out",
                                  str(tmp_path / "hf-none"), "--ema"]) == 2
    assert capsys.readouterr().err == (
        f"error: --ema is invalid: the run in --workdir={tmp_path / 'plain'} keeps no EMA of its "
        "parameters (optimizer.ema_decay=0); export its parameters without --ema\n")
    assert not (tmp_path / "hf-none").exists()
