"""The Gated Residual path decomposition (train/instruments/gr_paths.py): its figures on a
hand-built case, exactness on a real model (Σ_i c_{i→j} = h_j), and the script."""

import json

import numpy as np
import pytest
from flax import nnx

from arch.residual import PathTerm
from scripts import gr_paths as gr_paths_script
from tests.helpers import random_tokens, tiny_config, tiny_model, write_run
from tests.test_gated_residual import randomize
from train.instruments import gr_paths


def test_hand_built_two_sublayers():
    """n = 2 branches, D = 2, one token. Read 0 takes the embedding x⁰ = (3, 4) through gates
    ½, ½; sublayer 0 writes F = (0, 2) with strengths 1 and 3. Read 1: gate·gain·(1/rms) is
    1·1·½ = ½ on branch 0 and ¼·2·1 = ½ on branch 1, so
        embedding: c⁰ = c¹ = ½x⁰ (norms 2.5, 2.5), c = x⁰ (norm 5);
        sublayer 0: c⁰ = ½·1·F = (0, 1), c¹ = ½·3·F = (0, 3), c = (0, 4) (norm 4)."""
    one = (1, 1)  # B×T
    x0 = np.array([3.0, 4.0]).reshape(*one, 2)
    read_gates = [np.full((*one, 2, 1), 0.5), np.array([[1.0], [0.25]]).reshape(*one, 2, 1)]
    gains = [np.ones((2, 2)), np.array([[1.0, 1.0], [2.0, 2.0]])]
    inverse_rms = [np.ones((*one, 2, 1)), np.array([0.5, 1.0]).reshape(*one, 2, 1)]
    strengths = [np.array([[1.0, 1.0], [3.0, 3.0]]).reshape(*one, 2, 2),  # channelwise
                 np.ones((*one, 2, 1))]
    outputs = [np.array([0.0, 2.0]).reshape(*one, 2), np.ones((*one, 2))]
    result = gr_paths.path_contributions(read_gates, gains, inverse_rms, strengths, outputs, x0)
    np.testing.assert_allclose(result["contribution"], [[1, 5 / 9], [0, 4 / 9], [0, 0]])
    np.testing.assert_allclose(result["branch_contribution"],
                               [[[0.5, 2.5 / 9], [0, 1 / 9], [0, 0]],
                                [[0.5, 2.5 / 9], [0, 3 / 9], [0, 0]]])
    np.testing.assert_allclose(result["reads"][1], [[[3.0, 8.0]]])
    # skips: embedding → read 0: 1, embedding → read 1: 2, sublayer 0 → read 1: 1
    np.testing.assert_allclose(result["skip"], [(4.5 + 5 + 1) / (4.5 + 2.5 + 1),
                                                (4.5 + 5 + 3) / (4.5 + 2.5 + 3)])
    np.testing.assert_allclose(result["skip_writes"], [1.0, 1.0])
    np.testing.assert_allclose(gr_paths.per_layer(result["contribution"], 2),
                               [[(1 + 5 / 9) / 2], [(4 / 9) / 2]])
    # Mixing M_0 = [[1, 1], [0, 1]] at sublayer 0's write acts before F_0 is added: the
    # embedding reaches read 1 as M_0·1 = (2, 1) copies (c⁰ = x⁰, c¹ = ½x⁰, c = 1.5x⁰), F_0 as
    # before; M_1 acts after the last read.
    mixing = [np.array([[1.0, 1.0], [0.0, 1.0]]), np.full((2, 2), 7.0)]
    mixed = gr_paths.path_contributions(read_gates, gains, inverse_rms, strengths, outputs, x0,
                                        mixing=mixing)
    np.testing.assert_allclose(mixed["contribution"][:, 1], [7.5 / 11.5, 4 / 11.5, 0])
    np.testing.assert_allclose(mixed["branch_contribution"][:, :, 1],
                               [[5 / 11.5, 1 / 11.5, 0], [2.5 / 11.5, 3 / 11.5, 0]])
    np.testing.assert_allclose(mixed["reads"][1], [[[4.5, 10.0]]])


@pytest.mark.parametrize("switches", [dict(), dict(gated_residual__mixing=True,
                                                   gated_residual__channelwise_read=False,
                                                   gated_residual__read_top_k=2)],
                         ids=["channelwise", "mixing-scalar-reads-top2"])
@pytest.mark.slow
def test_contributions_sum_to_the_read_the_model_computed(switches):
    _, model = tiny_model(residual="gated_residual", num_layers=2, **switches)
    for block in (model.blocks.attention_residual, model.blocks.ffn_residual):
        randomize(block, std=0.5)  # gates and mixing differ by token and from the identity
    tokens = random_tokens((2, 6))
    result = gr_paths.capture_paths(model, tokens)
    _, terms = nnx.capture(model, PathTerm)(tokens)
    reads = [*terms["blocks"]["attention_residual"]["read"].get_value()[0],
             *terms["blocks"]["ffn_residual"]["read"].get_value()[0]]
    reads = [reads[0], reads[2], reads[1], reads[3]]  # network order
    assert result["rows"] == [f"layer {b} {m}" for b in range(2) for m in ("attention", "ffn")]
    for j, h in enumerate(reads):
        np.testing.assert_allclose(result["reads"][j], h, rtol=1e-5, atol=1e-5)
    assert result["read_error"] < 1e-5
    contribution = result["contribution"]
    np.testing.assert_allclose(contribution.sum(axis=0), 1.0)
    np.testing.assert_allclose(result["branch_contribution"].sum(axis=(0, 1)), 1.0)
    # row s (0: embedding, s: sublayer s − 1) reaches read j if and only if s ≤ j
    assert np.all(contribution[np.tril_indices(5, -1, 4)] == 0)
    assert np.all(contribution[np.triu_indices(5, 0, 4)] > 0)
    # The ordinary capture (depth-mixing heatmaps) does not see the path terms.
    _, intermediates = nnx.capture(model, nnx.Intermediate)(tokens)
    assert set(intermediates["blocks"]["attention_residual"]) <= {
        "read_gates", "write_strengths", "mixing_matrix"}


@pytest.mark.slow
def test_script_writes_json_and_png_and_refuses_other_mechanisms(tmp_path, capsys):
    config = tiny_config(residual="gated_residual")
    config.mesh.data = -1  # the 8 simulated devices
    write_run(config, tmp_path / "gr", step=3)
    out = tmp_path / "plots" / "paths.png"
    assert gr_paths_script.main(["--workdir", str(tmp_path / "gr"), "--out", str(out),
                          "--batch", "8"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads(out.with_suffix(".json").read_text())
    assert (written["mechanism"], written["step"], written["seq_len"]) == ("gated_residual", 3, 16)
    assert written["sources"] == ["embedding", *written["reads"]] and len(written["reads"]) == 4
    np.testing.assert_allclose(np.sum(written["contribution"], axis=0), 1.0)
    assert np.shape(written["branch_contribution"]) == (4, 5, 4)
    assert np.shape(written["layer_contribution"]) == (3, 2)
    np.testing.assert_allclose(written["skip_layers"], np.array(written["skip_sublayers"]) / 2)
    assert written["read_error"] < 1e-5
    printed = capsys.readouterr().out  # after the data set's own messages
    summary = [line for line in printed.splitlines() if line.startswith("layer 0 → layer 1: C = ")]
    assert len(summary) == 1 and "skip length per branch (layers): " in summary[0]

    # --step reads an older checkpoint: a second one, at step 5, holds another initialization
    config.seed = 1
    write_run(config, tmp_path / "gr", step=5)
    for step, expected in ((None, 5), (3, 3)):
        flags = [] if step is None else ["--step", str(step)]
        assert gr_paths_script.main(["--workdir", str(tmp_path / "gr"), "--out", str(out),
                              "--batch", "8", *flags]) == 0
        again = json.loads(out.with_suffix(".json").read_text())
        assert again["step"] == expected
        assert (again["contribution"] == written["contribution"]) == (expected == 3)
    capsys.readouterr()
    assert gr_paths_script.main(["--workdir", str(tmp_path / "gr"), "--step", "4"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --workdir={tmp_path / 'gr'} holds no restorable checkpoint at step 4 "
                   "(its checkpoints: [3, 5])\n")

    prenorm = tiny_config(residual="prenorm")
    prenorm.mesh.data = -1
    write_run(prenorm, tmp_path / "prenorm", step=1)
    assert gr_paths_script.main(["--workdir", str(tmp_path / "prenorm"), "--batch", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.residual.name='prenorm' records no read gates/write "
                          "strengths")
    assert err.count("\n") == 1, err
