"""Block pruning by angular distance and LoRA healing (train/instruments/pruning.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import random_tokens, tiny_model
from train.instruments import pruning


def test_angular_distance_is_the_normalized_angle():
    """x^0 = e1, x^1 = e2 (90°), x^2 = −e2 (180° from x^1): d = 1/2, 1 for n = 1; 1/2 for n = 2."""
    hidden = np.zeros((3, 1, 1, 2))
    hidden[0, 0, 0] = [1.0, 0.0]
    hidden[1, 0, 0] = [0.0, 3.0]
    hidden[2, 0, 0] = [0.0, -2.0]
    np.testing.assert_allclose(pruning.angular_distances(hidden, 1), [0.5, 1.0])
    with pytest.raises(ValueError, match=r"num_drop=2: expected 1 ≤ n < L = 2"):
        pruning.angular_distances(hidden, 2)


def test_angular_selection_finds_the_identity_blocks():
    """Blocks 2 and 3 of 5 (Pre-LN) are the identity (attention and FFN output projections zero):
    d(x², x⁴) = 0, so n = 2 drops exactly them, and n = 1 the shallower of the two."""
    _, model = tiny_model(num_layers=5)
    blocks = model.blocks
    blocks.attention.output.kernel[...] = blocks.attention.output.kernel[...].at[2:4].set(0)
    blocks.ffn.down.kernel[...] = blocks.ffn.down.kernel[...].at[2:4].set(0)
    tokens_BxT1 = random_tokens((2, 17))
    hidden = pruning.boundary_hidden_states(model, tokens_BxT1)
    assert hidden.shape == (6, 2, 16, 32)
    np.testing.assert_array_equal(hidden[2], hidden[4])
    chosen = pruning.select_by_angular_distance(model, tokens_BxT1, 2)
    assert chosen["dropped"] == [2, 3]
    assert chosen["distance"][2] < 1e-6 < np.delete(chosen["distance"], 2).min()
    assert pruning.select_by_angular_distance(model, tokens_BxT1, 1)["dropped"] == [2]


def logits(model, tokens_BxT):
    return np.asarray(model(tokens_BxT))


def test_zero_b_adapter_leaves_logits_unchanged_and_folds_as_x_w_plus_xab():
    _, model = tiny_model(num_layers=2)
    tokens_BxT = random_tokens((2, 16))
    adapters = pruning.init_adapters(model, 4, jax.random.key(0))
    assert set(adapters) == {"attention.query", "attention.key", "attention.value",
                             "attention.output", "ffn.up", "ffn.gate", "ffn.down"}
    np.testing.assert_array_equal(logits(pruning.fold_adapters(model, adapters, 8.0), tokens_BxT),
                                  logits(model, tokens_BxT))
    # Nonzero B: the query projection of block 1 computes x W + (α/r)(x A) B.
    adapters = jax.tree.map(lambda x: x + 0.1, adapters)
    folded = pruning.fold_adapters(model, adapters, 8.0)
    x_NxD = np.asarray(jax.random.normal(jax.random.key(1), (5, 32)))
    kernel = np.asarray(model.blocks.attention.query.kernel[...][1]).reshape(32, -1)
    a, b = (np.asarray(adapters["attention.query"][k][1]) for k in "ab")
    expected = x_NxD @ kernel + 2.0 * (x_NxD @ a) @ b
    got = x_NxD @ np.asarray(folded.blocks.attention.query.kernel[...][1]).reshape(32, -1)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(model.blocks.attention.query.kernel[...][1].reshape(32, -1),
                                  kernel)  # the original is not modified


@pytest.mark.slow
def test_healing_moves_only_the_adapters():
    _, model = tiny_model(num_layers=2)
    params_before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    tokens = random_tokens((4, 17))
    healed, info = pruning.heal(model, lambda step: tokens, 3, rank=2, learning_rate=1e-2)
    assert len(info["losses"]) == 3 and info["losses"][-1] < info["losses"][0]
    base_after = [np.asarray(x) for x in jax.tree.leaves(info["base"])]
    assert len(base_after) == len(params_before)
    for before, after in zip(params_before, base_after, strict=True):
        assert before.tobytes() == after.tobytes()
    assert all(float(jnp.abs(adapter["b"]).max()) > 0 for adapter in info["adapters"].values())
    # The healed model is the base plus the folded adapters, and differs from the base.
    refolded = pruning.fold_adapters(model, info["adapters"], 2.0)
    np.testing.assert_array_equal(logits(healed, tokens[:, :-1]), logits(refolded, tokens[:, :-1]))
    assert not np.allclose(logits(healed, tokens[:, :-1]), logits(model, tokens[:, :-1]))


@pytest.mark.slow
def test_prune_heal_command_line(tmp_path, capsys):
    """The study on a 2-block run: both selections, the shared dropped block healed once, the
    numbers equal to the library's, and an impossible fraction refused in one line."""
    import json

    from scripts import prune_heal
    from tests.helpers import tiny_config, write_run
    from train.data import in_memory
    from train.instruments import ablation
    from train.restore import restore_for_analysis

    config = tiny_config()
    config.mesh.data = -1
    write_run(config, tmp_path / "run", step=1)
    in_memory.load(config.data, "validation")
    out = tmp_path / "out"
    args = ["--workdir", str(tmp_path / "run"), "--out", str(out), "--heal_steps", "1",
            "--batch", "8", "--eval_batches", "1"]
    assert prune_heal.main([*args, "--fractions", "0.5"]) == 0
    report = json.loads((out / "blocks.json").read_text())
    assert (out / "blocks.png").read_bytes()[:4] == b"\x89PNG"
    assert [r["selection"] for r in report["rows"]] == ["influence", "angular"]
    assert report["loss_intact_healed"] < report["loss_intact"]  # the control: one Adam step
    _, _, model, tokens_BxT1 = restore_for_analysis(tmp_path / "run", 8)
    for row in report["rows"]:
        _, pruned = ablation.prune_blocks(model, row["dropped"])
        assert row["loss_pruned"] == pytest.approx(ablation.batch_loss(pruned, tokens_BxT1),
                                                   rel=1e-6)
    capsys.readouterr()
    assert prune_heal.main([*args, "--fractions", "1.0"]) == 2
    assert capsys.readouterr().err == ("error: --fractions=1.0 is invalid: it drops 2 of 2 "
                                       "blocks; expected 1 ≤ round(f·L) < L\n")
