"""Configs in sections: every old flat name maps to an existing field (`config.legacy`), a
config.json written before the sections restores through that one mapping, an old name on the
command line is refused in one line that names its new place, and a misspelled component name is
refused before JAX loads (`config.catalogue`)."""

from __future__ import annotations

import ast
import json
import re
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
    # What the rules need is declared once, on the record: the classes do not repeat it.
    assert not any(hasattr(ffn, "projections") for ffn in FFNS.values())
    assert not any(hasattr(mechanism, "single_stream") for mechanism in RESIDUALS.values())
    assert not any(hasattr(mixer, "cache_per_token") for mixer in ATTENTION.values())


def test_registering_leaves_the_catalogue_alone_and_the_fixture_restores_both(
        register_component):
    """`Registry.register` changes only the live registry (the config leaf keeps no state that
    `arch` writes); the fixture puts a test's component in both and the next test sees neither."""
    from arch.residual import RESIDUALS, PreNormSum

    before = dict(catalogue.records("residual"))
    RESIDUALS.register("test_only_live")(PreNormSum)
    try:
        assert catalogue.records("residual") == before
    finally:
        dict.__delitem__(RESIDUALS, "test_only_live")
    register_component(RESIDUALS, "test_both", PreNormSum,
                       capabilities=frozenset({catalogue.SINGLE_STREAM}))
    assert RESIDUALS["test_both"] is PreNormSum
    assert catalogue.has("residual", "test_both", catalogue.SINGLE_STREAM)
    assert catalogue.module_path("residual", "test_both") == "arch.residual"


def test_the_previous_test_registered_components_are_gone():
    from arch.residual import RESIDUALS

    assert "test_both" not in RESIDUALS and "test_both" not in catalogue.names("residual")


# A literal that is a component name and also an ordinary value of other fields ("none": no
# quantization, no branch scale) counts only where it is compared with a component field.
AMBIGUOUS = {"none"}
COMPONENT_FIELD = re.compile(r"\b(attention|norm|position|ffn|residual|head)(\.name\b|\[.name.\])"
                             r"|activation|\binit\b")


def component_comparisons(package: str) -> list[str]:
    """"path:line: source" of each comparison in `package` with a literal component name of the
    catalogue (`x == "mha"`, `x in ("batchnorm", ...)`, ...)."""
    components = {name for family in catalogue.FAMILIES for name in catalogue.names(family)}
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            literals = set()
            for operand in operands:
                sequence = isinstance(operand, ast.Tuple | ast.List | ast.Set)
                for leaf in operand.elts if sequence else [operand]:
                    if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str):
                        literals.add(leaf.value)
            named = literals & components
            if named - AMBIGUOUS or (named and COMPONENT_FIELD.search(ast.unparse(node))):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("package", ["config", "sharding", "train"])
def test_no_component_name_is_compared_outside_arch(package):
    """The rules ask the records (`config.catalogue.has`, `record`, `letters`), never compare a
    component's name: adding a component is its module, its record and its defaults section."""
    assert component_comparisons(package) == []


def test_the_comparison_search_finds_what_it_looks_for(tmp_path, monkeypatch):
    """The search above is not vacuous: it finds each kind of comparison it should."""
    package = tmp_path / "lib"
    package.mkdir()
    (package / "rules.py").write_text(
        'a = cfg.attention.name == "mla"\n'
        'b = model.norm.name not in ("batchnorm", "causal_batchnorm")\n'
        'c = cfg.position.name != "none"\n'
        'd = config.quantization.method != "none"\n'
        'e = name == "gated_deltanet"\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [line.split(":")[1] for line in component_comparisons("lib")] == ["1", "2", "3", "5"]


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


def test_a_records_options_section_is_in_the_schema_and_its_rule_runs(register_component):
    """A component may declare its options' section in its record (`section`, `options`): the
    schema has it, with its defaults, and `resolve` runs the record's rule on it."""
    from arch.attention import ATTENTION, MultiHeadAttention
    from config import ConfigError
    from config.component_rules import positive_int

    def rule(cfg):
        width = cfg.test_mixer.width
        if not positive_int(width):
            raise ConfigError(f"model.test_mixer.width={width!r} is invalid")

    register_component(ATTENTION, "test_mixer", MultiHeadAttention, section="test_mixer",
                       options=lambda: dict(width=3), rules=rule,
                       capabilities=frozenset({catalogue.SEQUENCE_PARALLEL}))
    config = base_config()
    assert config.model.test_mixer.to_dict() == {"width": 3}
    config.model.attention.name = "test_mixer"
    config.model.test_mixer.width = 0
    with pytest.raises(ConfigError, match=re.escape("model.test_mixer.width=0 is invalid")):
        resolve(config, 1)
    config.model.attention.name = "mha"  # the rule runs for the components in use only
    assert resolve(config, 1).model.test_mixer.width == 0
