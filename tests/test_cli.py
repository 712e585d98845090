"""config/cli.py: experiment files, --config.FIELD overrides read as each field's type, one-line
errors with exit status 2, parity with ml_collections' config_flags, and every entry point's
--help."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from config.cli import (
    ArgumentParser,
    UsageError,
    apply_overrides,
    load_experiment,
    parse_with_config,
    split_overrides,
)

ROOT = Path(__file__).resolve().parents[1]

EXPERIMENT = '''
import ml_collections


def get_config(arg=None):
    return ml_collections.ConfigDict(dict(
        name=arg or "default", steps=10, rate=0.5, flag=False, shape=(1, 2), sizes=[3, 4],
        plain=None, width=ml_collections.FieldReference(None, field_type=int),
        scale=ml_collections.FieldReference(None, field_type=float),
        init=dict(default="fan_in", query=ml_collections.FieldReference(None, field_type=str)),
        mesh=dict(data=-1, dcn=dict(data=1))))
'''


@pytest.fixture
def experiment(tmp_path) -> str:
    path = tmp_path / "exp.py"
    path.write_text(EXPERIMENT)
    return str(path)


def parse(experiment: str, *argv: str) -> ml_collections.ConfigDict:
    config, _ = parse_with_config(ArgumentParser("test"), ["--config", experiment, *argv])
    return config


def expected(experiment: str, **fields) -> dict:
    config = load_experiment(experiment)
    for path, value in fields.items():
        *parents, name = path.split("__")
        node = config
        for parent in parents:
            node = node[parent]
        node[name] = value
    return config.to_dict()


def one_line_exit_2(capsys, experiment: str, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse(experiment, *argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize("argv,fields", [
    (["--config.steps=12"], dict(steps=12)),
    (["--config.steps", "12"], dict(steps=12)),
    (["--config.steps=0x10"], dict(steps=16)),
    (["--config.rate=3e-4"], dict(rate=3e-4)),
    (["--config.rate", "-1"], dict(rate=-1.0)),
    (["--config.rate=2"], dict(rate=2.0)),
    (["--config.name=a b=c"], dict(name="a b=c")),
    (["--config.name="], dict(name="")),
    (["--config.flag=true"], dict(flag=True)),
    (["--config.flag=True"], dict(flag=True)),
    (["--config.flag=1"], dict(flag=True)),
    (["--config.flag", "T"], dict(flag=True)),
    (["--config.flag"], dict(flag=True)),
    (["--config.flag", "--config.steps=3"], dict(flag=True, steps=3)),
    (["--config.flag=true", "--config.flag=False"], dict(flag=False)),
    (["--config.flag=true", "--noconfig.flag"], dict(flag=False)),
    (["--config.flag=0"], dict(flag=False)),
    (["--config.width=64"], dict(width=64)),
    (["--config.width=64", "--config.width=None"], dict(width=None)),
    (["--config.scale=2"], dict(scale=2.0)),
    (["--config.init.query=normal"], dict(init__query="normal")),
    (["--config.plain=3"], dict(plain=3)),
    (["--config.plain=[1, 2]"], dict(plain=[1, 2])),
    (["--config.plain=true"], dict(plain=True)),
    (["--config.plain=some/path*"], dict(plain="some/path*")),
    (["--config.shape=(4, 5, 6)"], dict(shape=(4, 5, 6))),
    (["--config.shape=[4, 5]"], dict(shape=(4, 5))),
    (["--config.shape=7"], dict(shape=(7,))),
    (["--config.shape=a"], dict(shape=("a",))),
    (["--config.sizes=(8,)"], dict(sizes=[8])),
    (["--config.mesh.data=2", "--config.mesh.dcn.data", "2"],
     dict(mesh__data=2, mesh__dcn__data=2)),
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_overrides_are_read_as_the_field_type(experiment, argv, fields):
    config = parse(experiment, *argv)
    assert config.to_dict() == expected(experiment, **fields)
    for path, value in fields.items():  # the type too: 2.0 == 2 would pass a float field as int
        node = config
        for part in path.split("__"):
            node = node[part]
        assert type(node) is type(value)


def test_path_arg_calls_get_config_with_arg(experiment):
    assert parse(experiment).name == "default"
    assert parse(f"{experiment}:other", "--config.steps=3").to_dict() == expected(
        f"{experiment}:other", steps=3)
    residuals = parse(str(ROOT / "experiments" / "residuals.py") + ":block_attnres")
    assert residuals.model.residual.name == "block_attnres"
    config, args = parse_with_config(ArgumentParser("test"), [f"--config={experiment}:x"])
    assert config.name == "x" and args.config == f"{experiment}:x"


def test_a_reference_set_from_the_command_line_reaches_its_users(tmp_path):
    path = tmp_path / "ref.py"
    path.write_text("import ml_collections\n\ndef get_config():\n"
                    "    c = ml_collections.ConfigDict(dict(seq_len=8, model=dict(context=0)))\n"
                    "    c.model.context = c.get_ref('seq_len')\n    return c\n")
    assert parse(str(path), "--config.seq_len=32").model.context == 32


@pytest.mark.parametrize("argv,message", [
    (["--config.steps=abc"], "error: flag --config.steps=abc: invalid literal for int() with base "
                             "10: 'abc'; steps is an int"),
    (["--config.steps=1.5"], "error: flag --config.steps=1.5: invalid literal for int() with "
                             "base 10: '1.5'; steps is an int"),
    (["--config.rate=fast"], "error: flag --config.rate=fast: could not convert string to float: "
                             "'fast'; rate is a float"),
    (["--config.flag=yes"], "error: flag --config.flag=yes: expected true or false (also t/f, "
                            "1/0, any case); flag is a bool"),
    (["--config.width=wide"], "error: flag --config.width=wide: invalid literal for int() with "
                              "base 10: 'wide'; width is an int"),
    (["--config.steps=None"], "error: flag --config.steps=None: invalid literal for int() with "
                              "base 10: 'None'; steps is an int"),
    (["--config.steps"], "error: flag --config.steps: a value is required "
                         "(--config.FIELD=VALUE); steps is an int"),
    (["--config.shape=(a, b)"], "error: flag --config.shape=(a, b): not a Python literal; quote "
                                "each string item, e.g. '(\"a\", \"b\")'; shape is a tuple"),
    (["--config.stps=3"], "error: --config.stps: the config has no field 'stps'; did you mean "
                          "steps?"),
    (["--config.mesh.dcn.dta=2"], "error: --config.mesh.dcn.dta: mesh.dcn has no field 'dta'; "
                                  "did you mean mesh.dcn.data?"),
    (["--config.steps.x=1"], "error: --config.steps.x: steps has no field 'x'"),
    (["--config.mesh=3"], "error: --config.mesh: mesh is a section; set its fields, e.g. "
                          "--config.mesh.data=VALUE"),
    (["extra"], "error: unrecognized argument 'extra'; fields are set as --config.FIELD=VALUE"),
    (["--nope=1"], "error: unrecognized argument '--nope=1'"),
], ids=["int", "int-from-float", "float", "bool", "reference", "none-not-nullable", "no-value",
        "tuple-literal", "unknown", "unknown-nested", "unknown-parent", "section", "positional",
        "unknown-flag"])
def test_bad_overrides_are_one_line_and_exit_2(capsys, experiment, argv, message):
    assert one_line_exit_2(capsys, experiment, *argv) == message


def test_broken_experiment_files_are_one_line_and_exit_2(capsys, tmp_path):
    files = {"syntax.py": "def get_config(:\n", "no_get_config.py": "CONFIG = 1\n",
             "raises.py": "raise RuntimeError('no data here')\n",
             "get_config_raises.py": "def get_config(arg=None):\n    raise KeyError(arg)\n",
             "not_a_config.py": "def get_config():\n    return {}\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cases = {
        str(tmp_path / "missing.py"): f"--config={tmp_path / 'missing.py'} does not exist; pass "
                                      "an experiment file such as experiments/quickstart.py",
        str(tmp_path / "syntax.py"): "has a syntax error at line 1: invalid syntax",
        str(tmp_path / "no_get_config.py"): "defines no get_config(arg=None)",
        str(tmp_path / "raises.py"): "fails to load: RuntimeError: no data here",
        str(tmp_path / "get_config_raises.py") + ":x": "get_config raised KeyError: 'x'",
        str(tmp_path / "not_a_config.py"): "get_config returned dict, not an ml_collections",
    }
    for value, message in cases.items():
        assert message in one_line_exit_2(capsys, value)
        with pytest.raises(UsageError, match="^--config="):
            load_experiment(value)


def test_config_is_required_unless_optional(capsys, experiment):
    with pytest.raises(SystemExit) as exit_:
        parse_with_config(ArgumentParser("test"), ["--config.steps=1"], required=False)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "error: --config is required, e.g. --config experiments/quickstart.py\n")
    parser = ArgumentParser("test")
    parser.add_argument("--shape", action="append", default=[])
    config, args = parse_with_config(parser, ["--shape", "gpt2"], required=False)
    assert config is None and args.shape == ["gpt2"] and args.config is None
    config, args = parse_with_config(ArgumentParser("test"), ["--config", experiment])
    assert args.config == experiment and config.steps == 10


def test_split_overrides_keeps_the_other_arguments_in_order():
    rest, overrides = split_overrides(["--workdir", "w", "--config.a=1", "--config.b", "-2",
                                       "--json", "--config.c", "--noconfig.d", "--config", "p"])
    assert rest == ["--workdir", "w", "--json", "--config", "p"]
    assert overrides == [("a", "1"), ("b", "-2"), ("c", None), ("d", "false")]


@pytest.mark.parametrize("argv", [
    ["--config.steps=7", "--config.rate=0.25", "--config.name=x", "--config.flag=false"],
    ["--config.flag", "--config.width=3", "--config.scale=1.5", "--config.init.query=normal"],
    ["--config.shape=(3, 4)", "--config.mesh.dcn.data=2", "--config.steps", "9"],
    ["--config.flag=1", "--config.rate=-2", "--config.shape=a"],
])
def test_same_config_as_ml_collections_config_flags(experiment, argv):
    """The command lines that config_flags accepted give the same config."""
    command = ["prog", "--config", experiment, *argv]
    flag_values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values,
                                             lock_config=False, sys_argv=command)
    flag_values(command)
    theirs = holder.value.to_dict()
    assert parse(experiment, *argv).to_dict() == theirs


def test_apply_overrides_in_order(experiment):
    config = load_experiment(experiment)
    apply_overrides(config, [("steps", "1"), ("steps", "2"), ("width", "4")])
    assert (config.steps, config.width) == (2, 4)


ENTRY_POINTS = ["train.__main__", "train.generate",
                *(f"scripts.{path.stem}" for path in sorted((ROOT / "scripts").glob("*.py")))]


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_entry_point_has_help_and_one_line_usage_errors(capsys, module):
    main = importlib.import_module(module).main
    program = ["prog"] if module == "train.__main__" else []  # it takes sys.argv whole
    with pytest.raises(SystemExit) as exit_:
        main([*program, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python ")
    with pytest.raises(SystemExit) as exit_:
        main([*program, "--no_such_flag"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_train_help_and_errors_as_a_command():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    help_ = subprocess.run([sys.executable, "-m", "train", "--help"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0 and "--config.FIELD=VALUE" in help_.stdout, help_.stderr
    bad = subprocess.run([sys.executable, "-m", "train", "--config", "experiments/quickstart.py",
                          "--workdir", "unused", "--config.model.d_modl=8"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == ("error: --config.model.d_modl: model has no field 'd_modl'; did you "
                          "mean model.d_model?\n")
