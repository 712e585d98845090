"""Configs in sections: every old flat name maps to an existing field (`config.legacy`), a
config.json written before the sections restores through that one mapping, an old name on the
command line is refused in one line that names its new place, and a misspelled component name is
refused before JAX loads (`config.catalogue`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from config import catalogue, lookup, resolve
from config.cli import UsageError, apply_override, load_module
from config.defaults import base_config
from config.legacy import MOVED, upgrade
from config.validate import check_fields
from train import rundir

ROOT = Path(__file__).resolve().parents[1]


def test_every_old_name_moves_to_an_existing_field_and_none_is_still_in_use():
    current = json.loads(base_config().to_json_best_effort())
    for old, new in MOVED.items():
        lookup(current, new)  # KeyError if the mapping points nowhere
        if not new.startswith(old + "."):  # model.attention → model.attention.name: a section
            with pytest.raises(KeyError):
                lookup(current, old)


def test_upgrade_moves_flat_fields_and_merges_the_remat_switches():
    old = {"steps": 7, "model": {"attnres_block_size": 2, "gr_static": False, "d_model": 64,
                                 "remat": True, "remat_policy": None,
                                 "pipeline_microbatches": 8, "attention_chunk": 64}}
    new = upgrade(old)
    assert new == {"steps": 7,
                   "model": {"d_model": 64, "attnres": {"block_size": 2},
                             "gated_residual": {"static": False}},
                   "execution": {"remat": "full", "attention_chunk": 64,
                                 "pipeline": {"microbatches": 8}}}
    assert "attnres_block_size" in old["model"]  # the argument is not changed
    assert upgrade({"model": {"remat": False, "remat_policy": "dots_saveable"}}) == {
        "model": {}, "execution": {"remat": "dots_saveable"}}
    today = json.loads(base_config().to_json_best_effort())
    assert upgrade(today) == today


def test_a_run_written_with_flat_names_restores_as_the_study_file_builds_it_today():
    """The committed runs of the AttnRes study predate the sections: each upgrades to exactly the
    config its study file builds now (the check a resume makes), and validates."""
    study = load_module(str(ROOT / "experiments/attnres_ablation.py"), "--study")
    defaults = json.loads(base_config().to_json_best_effort())
    for arm in ("baseline", "block", "full"):
        run = ROOT / f"docs/results/attnres_ablation/{arm}/seed0"
        saved = json.loads((run / "config.json").read_text())
        assert "d_ff" in saved["model"] and "residual_streams" in saved["model"]  # flat names
        restored = rundir.saved_config(run, defaults)
        built = study.get_config(f"{arm},cpu")
        built.update(seed=0, mesh=dict(data=1))
        built = resolve(built, 1)
        assert rundir.identity_differences(restored, rundir._as_json(built), resolved=True) == []
        config = base_config()
        config.update(restored)
        check_fields(config)
    assert (config.model.residual.name, config.model.ffn.name) == ("attnres", "mlp")


def test_the_replication_trains_the_tuned_runs_configs_at_the_picked_rates():
    """experiments/attnres_replication.py: each arm's rate is its pick in the ablation's
    tuning.json, and its config (seed aside) is what the committed tuned run of seed 0 trained."""
    replication = load_module(str(ROOT / "experiments/attnres_replication.py"), "--study")
    results = ROOT / "docs/results/attnres_ablation"
    picks = json.loads((results / "tuning.json").read_text())["cells"]
    defaults = json.loads(base_config().to_json_best_effort())
    for arm in replication.ARMS:
        assert replication.RATES[arm] == picks[arm]["pick"] and picks[arm]["interior"]
        restored = rundir.saved_config(results / f"tuned/{arm}/seed0", defaults)
        built = replication.get_config(f"{arm},cpu")
        built.update(seed=0, mesh=dict(data=1))
        assert rundir.identity_differences(restored, rundir._as_json(resolve(built, 1)),
                                           resolved=True) == []
    assert not set(replication.SEEDS) & {0, 1, 2, 3, 100}  # fresh seeds


@pytest.mark.parametrize("field,message", [
    ("model.attnres_block_size", "--config.model.attnres_block_size: "
     "model.attnres_block_size moved to model.attnres.block_size; use "
     "--config.model.attnres.block_size=VALUE"),
    ("model.pipeline_microbatches", "--config.model.pipeline_microbatches: "
     "model.pipeline_microbatches moved to execution.pipeline.microbatches; use "
     "--config.execution.pipeline.microbatches=VALUE"),
    ("model.remat", "--config.model.remat: model.remat moved to execution.remat, which names a "
     "policy (arch.remat): use --config.execution.remat=full for remat=True"),
    ("model.residual", "--config.model.residual: model.residual is a section; set its fields, "
     "e.g. --config.model.residual.name=VALUE"),
])
def test_an_old_name_on_the_command_line_names_its_new_place(field, message):
    with pytest.raises(UsageError) as error:
        apply_override(base_config(), field, "2")
    assert str(error.value) == message


def test_the_catalogue_names_the_live_registries_both_ways():
    """Every component `config.catalogue` names is registered by the module it names, with the
    properties it records, and every registered component is in the catalogue."""
    from arch.attention import ATTENTION
    from arch.ffn import ACTIVATIONS, FFNS
    from arch.heads import HEADS
    from arch.init import INITS
    from arch.norms import NORMS
    from arch.positions import POSITIONS
    from arch.residual import RESIDUALS

    live = dict(attention=ATTENTION, norm=NORMS, position=POSITIONS, ffn=FFNS,
                activation=ACTIVATIONS, residual=RESIDUALS, head=HEADS, init=INITS)
    assert set(live) == set(catalogue.FAMILIES)
    for family, registry in live.items():
        assert registry.family == family
        assert set(catalogue.names(family)) == set(registry), family
    for family in ("attention", "norm", "position", "ffn", "residual", "head", "init"):
        for name in catalogue.names(family):
            assert live[family][name].__module__ == catalogue.module_path(family, name)
    assert catalogue.FFN_PROJECTIONS == {name: ffn.projections for name, ffn in FFNS.items()}
    assert set(catalogue.SINGLE_STREAM_RESIDUALS) == {
        name for name, mechanism in RESIDUALS.items() if mechanism.single_stream}


def test_a_misspelled_component_is_refused_before_jax_loads():
    script = ("import sys\n"
              "from config import ConfigError\n"
              "from config.defaults import base_config\n"
              "from config.catalogue import check_names\n"
              "config = base_config()\n"
              "config.model.norm.name = 'rmsnrom'\n"
              "try:\n"
              "    check_names(config.model)\n"
              "except ConfigError as error:\n"
              "    print(error, 'jax' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.strip() == ("model.norm.name='rmsnrom' is invalid: valid norms: batchnorm, "
                                   "causal_batchnorm, dyt, gatednorm, layernorm, none, rmsnorm, "
                                   "scalenorm False")
