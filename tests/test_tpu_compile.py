"""The TPU compiler on this CPU host (libtpu, the `tpu` extra): accelerator types and their
topologies, the collectives read from compiled HLO, and `scripts/dry_run.py --target` end to end:
the quickstart compiled for v5e-4, FSDP's collectives (parameters all-gathered, every weight
gradient reduce-scattered, none all-reduced at full size), per-chip argument bytes against
stage 1's sharding arithmetic, data parallelism across 2 slices over DCN, and the one-line refusals.

The rest of the suite runs on CPU devices; these tests build compile-only TPU devices in the
same process (`jax.experimental.topologies`), which leaves the CPU backend as it is.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from config import ConfigError, resolve
from scripts import dry_run
from sharding.collectives import _array_bytes, collectives, execution_counts
from sharding.tpu import parse_target, target_devices
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "experiments" / "quickstart.py")


@pytest.mark.parametrize("name, generation, chips, topology", [
    ("v4-32", "v4", 16, "2x2x4"), ("v5p-8", "v5p", 4, "2x2x1"), ("v5p-128", "v5p", 64, "4x4x4"),
    ("v5p-256", "v5p", 128, "4x4x8"), ("v5e-16", "v5e", 16, "4x4"),
    ("v5litepod-16", "v5e", 16, "4x4"), ("v5e-8", "v5e", 8, "2x4"), ("v6e-64", "v6e", 64, "8x8"),
    ("v6e-1", "v6e", 1, "1x1")])
def test_accelerator_types_name_chips_or_cores_as_cloud_tpu_does(name, generation, chips,
                                                                 topology):
    target = parse_target(name)
    assert (target.chip.generation, target.chips, target.topology) == (generation, chips,
                                                                       topology)


def test_topology_devices_are_one_per_chip_and_slices_multiply_them():
    v4 = target_devices(parse_target("v4-16"))  # 8 chips, each one megacore device
    assert len(v4) == 8 and v4[0].device_kind == "TPU v4"
    two = target_devices(parse_target("v5e-4", slices=2))
    assert len(two) == 8 and {d.slice_index for d in two} == {0, 1}
    assert two[0].device_kind == "TPU v5 lite"


@pytest.mark.parametrize("name, message", [
    ("v5q-8", "is not a Cloud TPU accelerator type"),
    ("v5p-4", "v5p-N counts TensorCores (2 per chip)"),
    ("v6e-12", "power-of-two chip count")])
def test_bad_accelerator_types_are_one_line(name, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_target(name)


LOOPED_HLO = """\
HloModule m

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %c = s32[] constant(6)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%all-reduce-scatter.3 (input: f32[64,8]) -> f32[16,8] {
  %input = f32[64,8]{1,0:T(8,128)} parameter(0)
  %all-reduce.1 = f32[64,8]{1,0:T(8,128)} all-reduce(%input), replica_groups={{0,1,2,3}}
  ROOT %ds = f32[16,8]{1,0} dynamic-slice(%all-reduce.1, %z, %z), dynamic_slice_sizes={16,8}
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %ag = (bf16[2,8], bf16[8,8]) all-gather-start(%x), replica_groups=[2,4]<=[8], dimensions={0}
  %agd = bf16[8,8] all-gather-done(%ag)
  %rs = f32[16,8] fusion(%y), kind=kCustom, calls=%all-reduce-scatter.3
  ROOT %t = (s32[], f32[8]) tuple(%i, %v)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0:T(256)} parameter(0)
  %w = (s32[], f32[8]) while(%t0), condition=%cond, body=%body
  %cp = (f32[8], f32[8], u32[], u32[]) collective-permute-start(%a), source_target_pairs={{0,4}}
  %cpd = f32[8] collective-permute-done(%cp)
  ROOT %ar = f32[8]{0} all-reduce(%a), replica_groups=mesh['x'=2,'y'=4] {'x'}, to_apply=%add
}
"""


def test_collectives_count_async_starts_fused_scatters_loop_trips_and_dcn_groups():
    assert execution_counts(__import__("sharding.collectives", fromlist=["_computations"])
                            ._computations(LOOPED_HLO))["body"] == 6
    report = collectives(LOOPED_HLO, slice_of=[0, 0, 0, 0, 1, 1, 1, 1])
    gather = report["all-gather"]  # [2,4]<=[8]: groups {0-3}, {4-7}: within a slice
    assert (gather["count"], gather["bytes"]) == (6, 6 * 128)
    assert gather["ici_traffic_bytes"] == 6 * 128 * 3 // 4 and gather["dcn_traffic_bytes"] == 0
    scatter = report["reduce-scatter"]  # the fused all-reduce-scatter, its input's bytes
    assert (scatter["count"], scatter["fused"], scatter["bytes"]) == (6, 6, 6 * 64 * 8 * 4)
    permute = report["collective-permute"]  # one -start, pairs across slices
    assert (permute["count"], permute["bytes"], permute["dcn_traffic_bytes"]) == (1, 32, 32)
    reduce = report["all-reduce"]  # mesh x=2,y=4 varying x: {0,4}, ... span both slices
    assert reduce["count"] == 1 and reduce["dcn_traffic_bytes"] == 32  # 2 (n-1)/n × 32 B


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "dry_run.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_quickstart_compiles_for_v5e_4_with_memory_collectives_and_step_estimate():
    # The quickstart, narrowed so the TPU compile takes seconds (the full one: tens of seconds).
    result = _run("--config", QUICKSTART, "--target", "v5e-4", "--json",
                  "--config.model.d_model=64", "--config.model.num_layers=2",
                  "--config.model.attention.num_heads=2", "--config.seq_len=32")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # libtpu's TPU-VM warnings are quieted for compiling
    tpu = json.loads(result.stdout)["tpu"]
    assert (tpu["device_kind"], tpu["chips"], tpu["topology"]) == ("TPU v5 lite", 4, "2x2")
    train = tpu["train"]
    assert train["fits"] and 0 < train["peak_bytes"] < tpu["hbm_bytes"]
    # data parallelism over 4 chips (mesh.data=-1): the gradients are all-reduced, nothing else
    kinds = {kind for kind, entry in train["collectives"].items() if entry["count"]}
    assert kinds == {"all-reduce"}
    roof = train["roofline"]
    assert roof["step_s"] == max(roof[k] for k in ("compute_s", "hbm_s", "ici_s", "dcn_s")) > 0
    assert 0 < roof["mfu"] <= 1 and roof["chip_hours"] == pytest.approx(
        roof["step_s"] * 300 * 4 / 3600)
    # the KV cache, batch-sharded over the 4 chips: 16 sequences × 32 positions × 2 layers ×
    # (k, v) × 2 KV heads × head dim 32 × f32
    decode = tpu["decode"]
    assert decode["fits"] and decode["cache_bytes"] == 16 * 32 * 2 * 2 * 2 * 32 * 4 // 4


@pytest.mark.slow
def test_a_config_that_does_not_fit_is_refused_in_one_line():
    result = _run("--config", QUICKSTART, "--target", "v5e-1", "--no_decode",
                  "--config.model.d_model=8192", "--config.model.num_layers=2",
                  "--config.model.attention.num_heads=64", "--config.seq_len=32")
    assert result.returncode == 2
    line, = result.stderr.strip().splitlines()
    # 32 GiB of temporaries: the TPU compiler itself refuses, and says by how much
    assert line.startswith(f"error: {QUICKSTART} does not fit v5e-1: the TPU compiler: ")
    assert "exceeds available HBM (15.75G)" in line
    assert "mesh.fsdp" in line and "execution.remat" in line and "accumulation_steps" in line


def test_a_compiled_step_whose_peak_exceeds_hbm_is_refused_in_one_line():
    # compiled, but arguments + temporaries exceed the chip's HBM: the dry run's own check
    report = {"target": "v5e-4", "hbm_bytes": 16 * 1024**3,
              "train": {"fits": False, "peak_bytes": 20 * 1024**3}}
    line = dry_run._does_not_fit("experiments/x.py", report)
    assert line.startswith("error: experiments/x.py does not fit v5e-4: peak 20.0 GiB per chip "
                           "> 16.0 GiB HBM; ") and "config.mesh.fsdp" in line
    assert dry_run._does_not_fit("x", {**report, "train": {"fits": True}}) is None


def test_target_without_libtpu_is_one_line_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setattr("sharding.tpu.libtpu_available", lambda: False)
    assert dry_run.main(["--config", QUICKSTART, "--target", "v5e-4"]) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert "libtpu" in line and "pip install -e '.[tpu]'" in line


def _compile(accelerator_type: str, slices: int = 1, d_model: int = 512, **mesh
             ) -> tuple[dict, dict]:
    """(stage 1's sharding report, the TPU report) of a small config on the target, mesh axes as
    given: 2 layers of d = 512 and 4 heads of 128 by default, widths that fill the TPU's
    (8, 128) tiles (a narrower model's gradients can be all-reduced and sliced rather than
    reduce-scattered, when the shards would not fill a tile; compiling takes as long)."""
    config = tiny_config()
    config.model.d_model, config.model.attention.num_heads = d_model, 4
    config.model.attention.num_kv_heads = 4
    dcn = mesh.pop("dcn", {})
    config.mesh.update(mesh)
    if dcn:
        config.mesh.dcn.update(dcn)
    target = parse_target(accelerator_type, slices)
    config = resolve(config, target.devices, slices)
    return dry_run.sharding_report(config), dry_run.tpu_report(config, target, decode=False)


@pytest.fixture(scope="module")
def fsdp():
    return _compile("v5p-8", fsdp=4)


@pytest.mark.slow
def test_fsdp_gathers_parameters_and_reduce_scatters_every_gradient(fsdp):
    stage1, tpu = fsdp
    found = tpu["train"]["collectives"]
    assert found["all-gather"]["count"] > 0  # parameters gathered over fsdp before use
    # every weight gradient reduce-scattered over fsdp (the TPU's fused all-reduce-scatter),
    # the layers' inside the layer loop: 2 layers × 7 matrices, and the embedding's
    assert found["reduce-scatter"]["count"] >= 2 * 7 + 1
    assert found["reduce-scatter"]["fused"] == found["reduce-scatter"]["count"]
    # no all-reduce moves a parameter's gradient at full size: every array all-reduced (the
    # replicated norm scales' gradients, the loss and the norms) is smaller than the smallest
    # weight matrix's f32 gradient, one layer's, or the embedding's
    smallest = min(4 * math.prod(p["shape"][1:] if p["path"].startswith("blocks/") else
                                 p["shape"]) for p in stage1["parameters"]
                   if len(p["shape"]) >= 3 or p["path"].startswith("embed/"))
    all_reduced = [size for _, shape in found["all-reduce"]["largest"]
                   for size in _array_bytes(shape)]
    assert max(all_reduced) < smallest, found["all-reduce"]["largest"]


def test_per_chip_argument_bytes_are_stage_ones_sharding_arithmetic(fsdp):
    stage1, tpu = fsdp
    train = tpu["train"]
    step_counter = 4
    assert train["argument_bytes_unpadded"] == (
        stage1["parameter_bytes"] + stage1["optimizer_bytes"] + stage1["model_state_bytes"]
        + stage1["batch_bytes"] + step_counter)
    # what the TPU allocates: the same arrays, each padded to its layout's tile
    assert train["argument_bytes"] == train["argument_bytes_padded"]


@pytest.mark.slow
def test_data_parallelism_across_two_slices_crosses_dcn_only_for_the_gradient_all_reduce():
    _, tpu = _compile("v5e-4", slices=2, d_model=64, data=8, dcn={"data": 2})
    assert tpu["chips"] == 8 and tpu["chips_per_slice"] == 4
    found = tpu["train"]["collectives"]
    assert found["all-reduce"]["dcn_traffic_bytes"] > 0
    assert all(entry["dcn_traffic_bytes"] == 0 for kind, entry in found.items()
               if kind != "all-reduce")
    assert tpu["train"]["roofline"]["dcn_s"] > 0


def test_every_paper_scale_declares_a_target_that_its_mesh_resolves_for():
    found = dry_run.experiments_with_targets()
    assert len(found) >= 13  # every experiment file with a paper scale
    for path, arg, accelerator_type, vocab in found:
        config = __import__("config.cli", fromlist=["load_experiment"]).load_experiment(
            f"{path}:{arg}")
        config.model.vocab_size = config.model.vocab_size or vocab
        target = parse_target(accelerator_type)
        resolve(config, target.devices, 1)  # the mesh fits the target's chips


def test_all_writes_its_rows_into_the_table_and_keeps_the_others(tmp_path):
    doc = tmp_path / "pods.md"
    old = "| `python scripts/dry_run.py --config experiments/a.py:x,paper --target v5e-8` | old |"
    doc.write_text(f"intro\n{dry_run.TABLE_BEGIN}\n{dry_run.TABLE_HEAD}\n{old}\n"
                   f"{dry_run.TABLE_END}\nrest\n")
    new = "| `python scripts/dry_run.py --config experiments/b.py:y,paper --target v5p-8` | new |"
    dry_run.write_table({"experiments/b.py": new}, str(doc))
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{dry_run.TABLE_END}\nrest\n")
    assert old in text and new in text and text.index(old) < text.index(new)
    replaced = new.replace("| new |", "| newer |")
    dry_run.write_table({"experiments/b.py": replaced}, str(doc))
    assert replaced in doc.read_text() and new not in doc.read_text()
