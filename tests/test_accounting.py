"""Accounting from the config alone: parameters by component, KV-cache bytes, the seeds' worked
numbers, published open-model counts, and scripts/accounting.py end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from arch.accounting import kv_cache_bytes_per_token, parameter_breakdown
from arch.reference_shapes import (
    PUBLISHED_PARAMETERS,
    open_model,
    transformer_base_parameters,
    worked_examples,
)
from config.model_rules import resolve_model
from experiments.common import model_config
from tests.helpers import one_device_env, override

ROOT = Path(__file__).resolve().parents[1]


def resolved(**fields):
    cfg = model_config()
    override(cfg, max_seq_len=64, **fields)
    resolve_model(cfg)
    return cfg


def test_components_sum_to_the_total_and_match_closed_forms():
    v, d, layers, h, k, p, f = 256, 64, 3, 8, 2, 8, 96
    cfg = resolved(vocab_size=v, d_model=d, num_layers=layers, attention__num_heads=h,
                   attention__num_kv_heads=k,
                   ffn__d_ff=f, head="untied", position="learned", head__bias=True)
    books = parameter_breakdown(cfg)
    attention = d * h * p + 2 * d * k * p + h * p * d            # Q, K, V (GQA), output
    assert books["attention"] == layers * attention
    assert books["ffn"] == layers * 3 * d * f                    # SwiGLU: gate, up, down
    assert books["norms"] == layers * 2 * d + d                  # two pre-norms + final norm
    assert books["embedding"] == v * d + 64 * d                  # token and position tables
    assert books["head"] == d * v + v                            # untied projection + bias
    assert books["residual"] == 0
    parts = ("embedding", "attention", "ffn", "norms", "residual", "head")
    assert sum(books[name] for name in parts) == books["total"] == books["active"]
    assert books["vocabulary"] == v * d + 64 * d + d * v + v
    assert books["non_embedding"] == books["total"] - books["vocabulary"]
    assert books["tying_savings"] == v * d
    # A residual mechanism's own parameters are "residual"; its per-sublayer norm stays "norms".
    hc = parameter_breakdown(resolved(residual="hc", d_model=d, attention__num_heads=h,
                                      attention__num_kv_heads=k))
    assert hc["residual"] > 0 and hc["norms"] == 4 * 2 * d + d


@pytest.mark.parametrize("fields, per_layer", [
    (dict(attention__num_heads=8, attention__num_kv_heads=8),
     2 * 8 * 16),             # MHA: keys and values
    (dict(attention__num_heads=8, attention__num_kv_heads=2), 2 * 2 * 16),             # GQA
    (dict(attention__num_heads=8, attention__num_kv_heads=1), 2 * 1 * 16),             # MQA
    (dict(attention="mla", mla__kv_rank=24, mla__rope_dim=8), 24 + 8),  # latent + rotary key
], ids=["mha", "gqa", "mqa", "mla"])
def test_kv_cache_bytes_per_token(fields, per_layer):
    cfg = resolved(d_model=128, num_layers=5, **fields)
    assert kv_cache_bytes_per_token(cfg) == 5 * per_layer * 4
    assert kv_cache_bytes_per_token(cfg, "bfloat16") == 5 * per_layer * 2


def test_seeds_worked_numbers():
    base = transformer_base_parameters()
    assert base["ffn_share_of_block"] == pytest.approx(2 / 3)
    assert base["total"] == 63_082_496  # Vaswani et al. 2017, Table 3: "65M" (rounded up)
    assert abs(base["total"] / 65e6 - 1) < 0.05
    examples = worked_examples()
    assert parameter_breakdown(examples["tying"])["tying_savings"] == 102_400_000
    wide = examples["wide_glu"]
    assert wide.attention.head_dim == 128
    assert parameter_breakdown(wide)["ffn"] == 10.5 * 4096**2


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_open_models_reproduce_their_published_parameter_counts(name):
    assert parameter_breakdown(open_model(name))["total"] == PUBLISHED_PARAMETERS[name]


@pytest.mark.slow
def test_accounting_script_prints_json_for_a_config_and_shapes(tmp_path):
    env = one_device_env()
    out = tmp_path / "books.json"
    command = [sys.executable, str(ROOT / "scripts" / "accounting.py"),
               "--config", str(ROOT / "experiments" / "quickstart.py"),
               "--shape", "gpt2", "--shape", "transformer_base", "--seq_len", "128",
               "--format", "json", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    books = json.loads(out.read_text())
    assert set(books) == {"quickstart", "gpt2", "transformer_base"}
    assert books["gpt2"]["published"] == {"parameters": 124_439_808, "reproduced": True}
    assert books["gpt2"]["kv_cache"]["bytes_per_sequence"] == 12 * 2 * 768 * 4 * 128
    quickstart = books["quickstart"]
    assert quickstart["flops"]["training_per_token"] == 3 * quickstart["flops"][
        "inference_per_token"]
    bad = subprocess.run([*command[:2], "--shape", "gpt-5"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--shape: unknown ['gpt-5']" in bad.stderr
