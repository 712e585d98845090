"""Residual-mechanism accounting (I/O, history, added parameters) and the depth-mixing heatmaps."""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from arch.accounting import (
    added_parameters,
    books,
    parameter_count,
    residual_accounting,
    residual_history,
    residual_io,
    residual_state_elements_per_token,
)
from arch.layers import Dense
from arch.model import TransformerLM
from arch.residual import RESIDUALS, PreNormSum, ResidualMechanism, SumStream, record
from config import catalogue, resolve
from config.defaults import model_config
from scripts import depth_mixing as depth_mixing_script
from tests.helpers import override, random_tokens, tiny_config, tiny_model, write_run
from train.instruments import depth_mixing
from train.restore import restore_run


def resolved(**model):
    """A validated tiny model config (nothing built: accounting works from shapes alone)."""
    config = tiny_config(**model)
    config = resolve(config, 1)
    return config.model


def model_cfg(residual: str, sublayers: int, **fields) -> ml_collections.ConfigDict:
    """The default model config with `residual` and `sublayers` sublayers (attention and FFN per
    block): all that the closed forms read."""
    cfg = model_config()
    override(cfg, residual=residual, num_layers=sublayers // 2, use_ffn=True, **fields)
    return cfg


def io_of(residual: str, sublayers: int, block_size: int = 1, streams: int = 1, **fields):
    return residual_io(model_cfg(residual, sublayers, attnres__block_size=block_size,
                                 residual__streams=streams, **fields))


# The AttnRes report's residual I/O per token per sublayer at L = 128 sublayers, S = 16, n = 4.
@pytest.mark.parametrize("mechanism,expected", [
    ("prenorm", 3), ("postnorm", 3), ("deepnorm", 3), ("noskip", 3), ("block_attnres", 5.5),
    ("attnres", 24), ("hc", 34), ("mhc", 34), ("width", 8), ("gated_residual", 18)])
def test_residual_io_reproduces_the_reported_numbers(mechanism, expected):
    io = io_of(mechanism, sublayers=128, block_size=16, streams=4)
    assert io.total == expected
    assert io.reads + io.writes == io.total


def test_residual_io_itemization_and_closed_forms():
    mhc = io_of("mhc", sublayers=128, block_size=16, streams=4)
    assert (mhc.reads, mhc.writes, mhc.scalars) == (5 * 4 + 1, 3 * 4 + 1, 2 * 16 + 4 * 4)
    for n in (1, 2, 8):
        assert io_of("hc", sublayers=8, streams=n).total == 8 * n + 2
        assert io_of("width", sublayers=8, streams=n).total == n + 4
        assert io_of("gated_residual", sublayers=8, streams=n).total == 4 * n + 2
        mixed = io_of("gated_residual", sublayers=8, streams=n, gated_residual__mixing=True)
        assert mixed.total == 6 * n + 2
        assert mixed.state_total() == 6 * n  # all but the gated read (d) and the output (d)
    for L, S in ((128, 16), (32, 4), (64, 8)):
        assert io_of("attnres", sublayers=L, block_size=S).total == L / S + S
        assert io_of("block_attnres", sublayers=L, block_size=S).total == L / S / S + 5
    with pytest.raises(ValueError, match="no residual I/O model for 'bogus'; modelled: prenorm"):
        io_of("bogus", sublayers=4)


def test_residual_history_per_token():
    assert residual_history(model_cfg("prenorm", sublayers=128)) == 1
    assert residual_history(model_cfg("attnres", sublayers=128)) == 129
    assert residual_history(model_cfg("block_attnres", sublayers=128,
                                      attnres__block_size=16)) == 9
    assert residual_history(model_cfg("mhc", sublayers=128, residual__streams=4)) == 4


@pytest.mark.parametrize("mechanism", list(RESIDUALS))
def test_every_registered_mechanism_has_its_books(mechanism):
    """Every registered mechanism states its residual I/O and history (the accounting hooks of
    `arch.residual.ResidualMechanism`), keeps at least the stream it declares, and adds the
    parameters that the same model with a plain Pre-Norm sum lacks."""
    cfg = resolved(residual=mechanism, num_layers=3)
    books = residual_accounting(cfg)
    assert books["io_per_token_per_sublayer"] >= 3
    assert books["state_elements_per_token"] >= books["history_elements_per_token"] >= cfg.d_model
    prenorm = resolved(residual="prenorm", num_layers=3)
    assert books["added_parameters"] == parameter_count(cfg) - parameter_count(prenorm)


@pytest.mark.parametrize("residual,use_ffn,dtype", [("prenorm", True, "float32"),
                                                    ("noskip", False, "bfloat16")])
def test_accounting_of_the_plain_sums(residual, use_ffn, dtype):
    cfg = resolved(residual=residual, use_ffn=use_ffn, dtype=dtype, num_layers=3)
    books = residual_accounting(cfg)
    d, itemsize = cfg.d_model, {"float32": 4, "bfloat16": 2}[dtype]
    assert books["sublayers"] == (6 if use_ffn else 3)
    assert books["added_parameters"] == 0
    assert books["io_per_token_per_sublayer"] == 3
    assert books["io_elements_per_token_per_sublayer"] == 3 * d
    assert books["io_bytes_per_token_per_sublayer"] == 3 * d * itemsize
    assert books["history_elements_per_token"] == books["state_elements_per_token"] == d


def expected_added_parameters(cfg) -> int:
    """What each mechanism's files create (arch/attnres.py, arch/hyper.py,
    arch/gated_residual.py), minus the plain sum's RMSNorm gain (d) per sublayer, where a
    mechanism has no Pre-Norm of its own."""
    L, n, d, r = 2 * cfg.num_layers, cfg.residual.streams, cfg.d_model, cfg.gated_residual.rank
    if cfg.residual.name in ("attnres",
                             "block_attnres"):  # pseudo-queries w_0 … w_L, final read's too
        return (L + 1) * d
    if cfg.residual.name == "hc":  # static a, A_r, b; norm of H̄, W_m, W_r, W_β, s_α, s_β
        return L * (n + n * n + n + (d + d + d * n + d + 2) * cfg.residual.dynamic)
    if cfg.residual.name == "mhc":  # biases; norm over n·d, φ_pre, φ_post, φ_res, three α
        return L * (2 * n + n * n + (n * d + 2 * n * d * n + n * d * n * n + 3)
                    * cfg.residual.dynamic)
    if cfg.residual.name == "width":
        return L * n
    if cfg.residual.name == "gated_residual":  # gains, W_down, two gates (bias + W_up) − the norm
        def gate(which):
            switch = cfg.gated_residual[f"channelwise_{which}"]
            width = d if (cfg.gated_residual.channelwise if switch is None else switch) else 1
            return n * width * cfg.gated_residual.static + r * n * width * cfg.residual.dynamic
        return L * (n * d + n * d * r * cfg.residual.dynamic + gate("read") + gate("write")
                    + n * n * cfg.gated_residual.mixing - d)
    raise AssertionError(cfg.residual.name)


MECHANISMS = [dict(residual="attnres"), dict(residual="block_attnres", attnres__block_size=2),
              dict(residual="hc"), dict(residual="hc", residual__dynamic=False),
              dict(residual="mhc"), dict(residual="width"), dict(residual="gated_residual"),
              dict(residual="gated_residual", gated_residual__channelwise=False,
                   gated_residual__mixing=True,
                   gated_residual__state_dtype="float8_e4m3fn"),
              dict(residual="gated_residual", gated_residual__channelwise_read=False),
              dict(residual="gated_residual", gated_residual__channelwise=False,
                   gated_residual__channelwise_write=True),
              dict(residual="gated_residual", gated_residual__static=False),
              dict(residual="gated_residual", gated_residual__init="random",
                   gated_residual__read_top_k=2)]


@pytest.mark.parametrize("model", MECHANISMS, ids=lambda m: ",".join(map(str, m.values())))
def test_accounting_of_the_mechanisms(model):
    if model["residual"] not in RESIDUALS:
        pytest.skip(f"{model['residual']} is not registered")
    cfg = resolved(num_layers=3, **model)
    books = residual_accounting(cfg)
    d, n, L = cfg.d_model, cfg.residual.streams, 6
    assert books["added_parameters"] == expected_added_parameters(cfg)
    io = residual_io(cfg)
    assert books["io_per_token_per_sublayer"] == io.total
    history = {"attnres": L + 1, "block_attnres": 3 + 1}.get(cfg.residual.name, n) * d
    assert books["history_elements_per_token"] == history
    # what the scan carries: AttnRes adds a cached 1/rms per source and head, FP8 a scale per row
    extra = {"attnres": L + 1, "block_attnres": 3 + 1}.get(cfg.residual.name, 0)
    extra += n if cfg.gated_residual.state_dtype == "float8_e4m3fn" else 0
    assert books["state_elements_per_token"] == history + extra
    # float8: branches at 1 byte (+ scale), the rest float32
    if cfg.gated_residual.state_dtype == "float8_e4m3fn":
        state = io.state_total()
        assert books["io_bytes_per_token_per_sublayer"] == pytest.approx(
            d * (state * (1 + 4 / d) + (io.total - state) * 4))


# A recording mechanism for the heatmap tests (removed from the registry afterwards): Pre-Norm
# plus an input-dependent read gate σ(W·x) over 3 columns, a constant 2×2 "mixing matrix", and a
# final read that records the same gate shape.
class _GateStream(SumStream):
    def __init__(self, cfg, *, rngs):
        self.gate = Dense((cfg.d_model,), (3,), ("embed",), (None,), rngs=rngs)

    def end(self, stream_BxTxD):
        record(self, "read_gates", jax.nn.sigmoid(self.gate(stream_BxTxD)))
        return stream_BxTxD


class _RecordingPreNorm(PreNormSum):
    residual_io = ResidualMechanism.residual_io  # the default: no I/O model

    def __init__(self, cfg, *, rngs):
        super().__init__(cfg, rngs=rngs)
        self.gate = Dense((cfg.d_model,), (3,), ("embed",), (None,), rngs=rngs)

    @classmethod
    def stream(cls, cfg, *, execution=None, rngs):
        return _GateStream(cfg, rngs=rngs)

    def read(self, stream_BxTxD):
        record(self, "read_gates", jax.nn.sigmoid(self.gate(stream_BxTxD)))
        record(self, "mixing_matrix", jax.numpy.eye(2) * self.gate.kernel[0, 0])
        return super().read(stream_BxTxD)


@pytest.fixture
def recording_mechanism(register_component):
    """The name of `_RecordingPreNorm`, registered (a single stream, as Pre-Norm) for one test."""
    return register_component(RESIDUALS, "test_recording", _RecordingPreNorm,
                              capabilities=frozenset({catalogue.SINGLE_STREAM}))


def test_accounting_measures_added_parameters_and_state_generically(recording_mechanism):
    name = recording_mechanism
    cfg = resolved(residual=name, num_layers=3)
    with pytest.raises(ValueError, match="no residual I/O model for 'test_recording'"):
        residual_accounting(cfg)
    # 6 sublayer gates and the final read's gate, d×3 each
    assert added_parameters(cfg) == 7 * cfg.d_model * 3
    assert residual_state_elements_per_token(cfg) == cfg.d_model


def test_mixing_rows_follow_network_order_with_interleaved_moe():
    # With model.moe.every=k the scan runs groups of k blocks (attributes block_j, stacked over
    # groups g: block g·k + j). Each sublayer's read weights are set to 10·g + j (+ 0.5 for the
    # ffn), so the rows must come out as 0, 0.5, 1, 1.5, 10, ... in network order.
    cfg, model = tiny_model(residual="width", ffn="moe", moe__every=2, num_layers=4,
                            moe__experts=4)
    n = cfg.residual.streams
    for j in range(2):
        block = getattr(model.blocks, f"block_{j}")
        for offset, residual in ((0.0, block.attention_residual), (0.5, block.ffn_residual)):
            values = 10.0 * np.arange(2) + j + offset
            residual.branch_weights[...] = jnp.asarray(np.repeat(values[:, None], n, axis=1))
    quantities, _ = depth_mixing.capture_mixing(model, random_tokens((2, 5)))
    weights = quantities["read_weights"]
    assert weights["rows"] == [f"layer {b} {m}" for b in range(4) for m in ("attention", "ffn")]
    assert [float(v[0]) for v in weights["values"]] == [0, 0.5, 1, 1.5, 10, 10.5, 11, 11.5]
    assert all(np.shape(v) == (n,) for v in weights["values"])


@pytest.mark.slow
def test_depth_mixing_script_plots_and_writes_the_captured_numbers(tmp_path, capsys,
                                                                   recording_mechanism):
    name = recording_mechanism
    config = tiny_config(residual=name)
    config.mesh.data = -1
    write_run(config, tmp_path, step=2)
    out = tmp_path / "plots" / "mixing.png"
    assert depth_mixing_script.main(["--workdir", str(tmp_path), "--out", str(out),
                              "--batch", "8"]) == 0
    program, step, state = restore_run(tmp_path)
    model = nnx.merge(program.graphdef, state["params"], state["model_state"])
    from train.data import in_memory
    from train.data.in_memory import VALIDATION_SEED
    tokens = in_memory.load(config.data, "validation").batch(0, 8, 16, VALIDATION_SEED)[:, :-1]
    _, captured = nnx.capture(model, nnx.Intermediate)(tokens)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads(out.with_suffix(".json").read_text())
    assert (written["mechanism"], written["step"], written["seq_len"]) == (name, 2, 16)
    gates = written["quantities"]["read_gates"]
    attention = captured["blocks"]["attention_residual"]["read_gates"].get_value()[0]
    final = captured["residual_stream"]["read_gates"].get_value()[0]
    np.testing.assert_allclose(gates["values"][2], attention[1].mean(axis=(0, 1)), rtol=1e-5)
    np.testing.assert_allclose(gates["values"][-1], final.mean(axis=(0, 1)), rtol=1e-5)
    assert gates["rows"][2] == "layer 1 attention" and gates["shape"] == [3]
    matrix = written["quantities"]["mixing_matrix"]
    kernel = state["params"]["blocks"]["ffn_residual"]["gate"]["kernel"][...]
    np.testing.assert_allclose(matrix["values"][1], np.eye(2) * float(kernel[0, 0, 0]),
                               rtol=1e-6)
    printed = capsys.readouterr().out
    assert "mixing_matrix, read_gates" in printed
    raw = captured["blocks"]["ffn_residual"]["mixing_matrix"].get_value()[0]  # layers × B×T×n×n
    assert written["stochastic_error"]["row_max"] == pytest.approx(
        float(np.abs(raw.sum(axis=-1) - 1).max()), rel=1e-6)
    assert "distance from doubly stochastic over 8×16 tokens" in printed


def test_the_stochastic_error_of_hand_built_and_of_mhc_mixing_matrices():
    exact = np.full((2, 3, 3), 1 / 3)  # two tokens of a uniform doubly stochastic matrix
    skewed = np.array([[0.5, 0.5, 0.0], [0.5, 0.25, 0.25], [0.25, 0.25, 0.5]])  # rows sum to 1
    error = depth_mixing.stochastic_error([exact, skewed[None]])
    assert error["column_max"] == pytest.approx(0.25)  # column 0 sums to 1.25
    assert error["column_mean"] == pytest.approx(0.5 / 9)  # 0.25 + 0 + 0.25 over 9 columns
    assert error["row_max"] == pytest.approx(0, abs=1e-12)
    _, model = tiny_model(residual="mhc")
    _, intermediates = depth_mixing.capture_mixing(model, random_tokens((2, 5)))
    values = depth_mixing.recorded(intermediates)[0]["mixing_matrix"]["values"]
    assert depth_mixing.stochastic_error(values)["row_max"] < 1e-5  # Sinkhorn ends on rows


def test_depth_mixing_refuses_plain_sums_and_missing_runs(tmp_path, capsys):
    cfg = resolved()  # traced only: a plain sum sows nothing
    captured = jax.eval_shape(lambda tokens: nnx.capture(TransformerLM(
        ml_collections.FrozenConfigDict(cfg), rngs=nnx.Rngs(0)), nnx.Intermediate)(tokens)[1],
        random_tokens((2, 8)))
    assert depth_mixing.mixing_quantities(captured, batch=2, seq_len=8, d_model=32) == {}
    assert depth_mixing_script.main(["--workdir", str(tmp_path)]) == 2
    assert "holds no config.json" in capsys.readouterr().err


def test_depth_summary_figures_of_a_hand_built_read():
    rows = ["layer 0 attention", "layer 0 ffn", "layer 1 attention", "output"]
    values = [np.array([1.0, 0, 0]), np.array([0.5, 0.5, 0]), np.array([0.2, 0.2, 0.6]),
              3 * np.array([0.7, 0.1, 0.2])]  # unnormalized (sigmoid-like): same figures
    summary = depth_mixing.depth_summary(rows, values)
    assert summary["embedding_weight"] == pytest.approx((0.5 + 0.2 + 0.7) / 3)
    assert summary["recent_weight"] == pytest.approx((0.5 + 0.6 + 0.2) / 3)
    assert summary["mean_distance"] == pytest.approx((0.5 + 0.6 + 1.5) / 3)
    entropy = -(2 * 0.2 * np.log(0.2) + 0.6 * np.log(0.6))
    assert summary["breadth"] == pytest.approx({"ffn": 2.0, "attention": np.exp(entropy),
                                                "output": summary["breadth"]["output"]})
    uniform = (1 / 2 + 1 / 3 + 1 / 3) / 3
    assert summary["source_share"] == pytest.approx(
        {0: (0.5 + 0.2 + 0.7) / 3 / uniform, 1: (0.5 + 0.2 + 0.1) / 3 / uniform, 2: 1.2})
    assert summary["sinks"] == []
    assert depth_mixing.depth_summary(rows, values, sink_ratio=1.1)["sinks"] == [0, 2]


def test_attnres_prefill_history_bytes_per_sequence_and_per_device():
    """The AttnRes report's example: a 128K-token prefill with eight blocks keeps about 15 GB of
    block summaries (N·T·d at d = 7168 in bfloat16) before sequence sharding; the books count
    the embedding source too, (N + 1)·T·d."""
    cfg = resolved(residual="block_attnres", num_layers=8, attnres__block_size=2,
                   d_model=7168, attention__num_heads=56, attention__num_kv_heads=8,
                   dtype="bfloat16", max_seq_len=131072)
    tokens, d, blocks = 131072, 7168, 8
    history = books(cfg, tokens, sequence_shards=8)["residual"]
    assert history["history_bytes_per_sequence"] == (blocks + 1) * tokens * d * 2
    assert blocks * tokens * d * 2 / 1e9 == pytest.approx(15.03, abs=0.01)
    assert history["history_bytes_per_device"] == history["history_bytes_per_sequence"] / 8


def test_attnres_depth_reads_are_counted_in_the_flops_per_token():
    """AttnRes's depth reads by hand (d = 32, 2 layers: n = 4 sublayers and the final read):
    read l has 1 + ⌈l/S⌉ sources, each 2d for its score and 2d for its share of the mixture;
    the plain sums add nothing, and the rest of the count is the Pre-Norm model's."""
    from arch import accounting
    from tests.helpers import tiny_model

    prenorm, _ = tiny_model(num_layers=2)  # (the resolved model config, the model)
    base = accounting.flops_per_token(prenorm, 16, training=False)
    cases = [(dict(residual="attnres"), 4 * 32 * (1 + 2 + 3 + 4 + 5)),
             (dict(residual="block_attnres", attnres=dict(block_size=2)),
              4 * 32 * (1 + 2 + 2 + 3 + 3)),
             (dict(residual="block_attnres", attnres=dict(block_size=2, weights="static")),
              2 * 32 * (1 + 2 + 2 + 3 + 3)),
             (dict(residual="attnres", attnres=dict(window=2)), 4 * 32 * (1 + 2 + 2 + 2 + 2))]
    for overrides, expected in cases:
        cfg, _ = tiny_model(num_layers=2, **overrides)
        assert accounting.flops_per_token(cfg, 16, training=False) == base + expected
        assert accounting.flops_per_token(cfg, 16, training=True) == 3 * (base + expected)
        assert accounting.flops_per_token(cfg, 16, depth_mixing=False) == 3 * base
