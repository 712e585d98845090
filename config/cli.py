"""The command line of every entry point: argparse, with experiment files and config overrides.

    --config PATH[:ARG]           run the experiment file PATH and take `get_config(ARG)`
                                  (`get_config()` without ARG)
    --config.FIELD=VALUE          set a field; FIELD is dotted (`model.d_model`, `mesh.dcn.data`)
    --config.FIELD VALUE          the same
    --config.FIELD                a bool field: True (`--noconfig.FIELD`: False)

VALUE is read as the type of the field it replaces: int (`12`, `0x10`), float (`3e-4`, `nan`),
bool (`true`/`false`/`t`/`f`/`1`/`0`, any case), str (as given), tuple and list (a Python literal,
`'(1, 2)'`; a lone unquoted item is a one-element tuple). A field that is None reads VALUE as the
type declared by its `ml_collections.FieldReference(None, field_type=...)`, or as a Python
literal (else a string) when it declares none; `None` sets such a field back to None. These are
the rules of ml_collections' `config_flags`, which the entry points used before.

Every error is one line, `error: MESSAGE` on stderr, with exit status 2: an unknown field (naming
the nearest one), a value of the wrong type (naming the flag, the value and the type), an
experiment file that is missing, broken or without `get_config`, and argparse's own usage errors.
`--help` prints the entry point's docstring and its options. This module imports only the standard
library, ml_collections and `config`, so an entry point reports these errors before importing JAX.

Options that several entry points share: `add_timing_arguments` (--steps and --block of a timed,
interleaved comparison: scripts/bench.py, scripts/attention_bench.py) and `analysis_parser`
(--workdir, --out, --batch, --seq_len, --step of a script that draws a saved run on one batch:
scripts/depth_mixing.py, scripts/gr_paths.py).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import os
import sys
import types
from collections.abc import Sequence
from typing import Any, NoReturn

import ml_collections

from config import ConfigError
from config.legacy import moved_hint

PREFIX = "--config."
NEGATED = "--noconfig."
TRUE, FALSE = ("true", "t", "1"), ("false", "f", "0")


class UsageError(ConfigError):
    """A command-line error: one line, exit status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the one-line contract: a usage error prints `error: MESSAGE` on stderr (no
    usage dump) and exits with status 2; `--help` prints the usage line, `doc` (the entry
    point's docstring) and the options."""

    def __init__(self, prog: str, doc: str | None = None, **kwargs: Any) -> None:
        super().__init__(prog=prog, description=doc,
                         formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"error: {' '.join(message.splitlines())}", file=sys.stderr)
        sys.exit(2)


def positive_int(text: str) -> int:
    """An argparse `type` for a count ≥ 1 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is invalid: must be a positive integer")
    return value


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str | None]]]:
    """(the other arguments, [(FIELD, VALUE or None), ...]) of a command line, in order.

    `--config.FIELD=VALUE` and `--config.FIELD VALUE` give (FIELD, VALUE); a `--config.FIELD`
    followed by another option or by nothing gives (FIELD, None), a bare bool flag;
    `--noconfig.FIELD` gives (FIELD, "false")."""
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(NEGATED):
            overrides.append((arg[len(NEGATED):], "false"))
        elif arg.startswith(PREFIX):
            field, sep, value = arg[len(PREFIX):].partition("=")
            if sep:
                overrides.append((field, value))
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1
                overrides.append((field, argv[i]))
            else:
                overrides.append((field, None))
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def load_module(path: str, flag: str = "--config") -> types.ModuleType:
    """Run the Python file `path` as a module and return it, with a one-line UsageError naming
    `flag` for a file that is missing or does not load."""
    if not os.path.isfile(path):
        raise UsageError(f"{flag}={path} does not exist; pass an experiment file such as "
                         "experiments/quickstart.py")
    spec = importlib.util.spec_from_file_location("blockbench_experiment", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        raise UsageError(f"{flag}={path} has a syntax error at line {error.lineno}: "
                         f"{error.msg}") from None
    except Exception as error:  # noqa: BLE001 -- any failure of the file is the user's to fix
        raise UsageError(f"{flag}={path} fails to load: {_one_line(error)}") from None
    return module


def load_experiment(value: str) -> ml_collections.ConfigDict:
    """Run the experiment file PATH of `value` (PATH[:ARG]) and return `get_config(ARG)`, with a
    one-line UsageError for a file that is missing, does not load or defines no `get_config`."""
    path, _, arg = value.partition(":")
    module = load_module(path)
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise UsageError(f"--config={path} defines no get_config(arg=None); an experiment file "
                         "returns its ConfigDict from get_config (see experiments/quickstart.py)")
    try:
        config = get_config(arg) if arg else get_config()
    except Exception as error:  # noqa: BLE001
        raise UsageError(f"--config={value}: get_config raised {_one_line(error)}") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise UsageError(f"--config={path}: get_config returned {type(config).__name__}, not an "
                         "ml_collections.ConfigDict")
    return config


def _one_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _holder(config: ml_collections.ConfigDict, field: str,
            flag: str) -> tuple[ml_collections.ConfigDict, str]:
    """(the ConfigDict holding dotted `field`, its last name); UsageError naming the first part
    that does not exist, with the nearest existing name."""
    node, parts = config, field.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            if hint := moved_hint(field):
                raise UsageError(f"{flag}: {hint}")
            parent = ".".join(parts[:depth]) or "the config"
            known = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            close = difflib.get_close_matches(part, known, n=1)
            hint = f"; did you mean {'.'.join(parts[:depth] + close)}?" if close else ""
            raise UsageError(f"{flag}: {parent} has no field {part!r}{hint}")
        if depth < len(parts) - 1:
            node = node[part]
    return node, parts[-1]


def _literal(text: str) -> Any:
    """A Python literal, else the text itself (`true`/`false` read as bools)."""
    try:
        return ast.literal_eval(text.capitalize() if text in ("true", "false") else text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _int(text: str) -> int:
    digits = text.lstrip("+-")
    return int(text, 0) if digits[:2].lower() in ("0x", "0o", "0b") else int(text, 10)


def _bool(text: str) -> bool:
    if text.lower() in TRUE:
        return True
    if text.lower() in FALSE:
        return False
    raise ValueError("expected true or false (also t/f, 1/0, any case)")


def _sequence(text: str, kind: type) -> tuple | list:
    """A tuple or list from a literal; as config_flags' tuple parser, a lone unquoted item (no
    comma, no space) is a one-element sequence of that string. Unquoted items in a sequence,
    `(a, b)`, are an error (config_flags made them one string)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        if "," in text or " " in text:
            raise ValueError("not a Python literal; quote each string item, e.g. "
                             "'(\"a\", \"b\")'") from None
        value = text
    if isinstance(value, tuple | list):
        return kind(value)
    return kind((value,))


PARSERS = {bool: _bool, int: _int, float: float, str: str,
           tuple: lambda text: _sequence(text, tuple), list: lambda text: _sequence(text, list)}
TYPE_NAMES = {bool: "a bool", int: "an int", float: "a float", str: "a str", tuple: "a tuple",
              list: "a list"}


def parse_value(text: str | None, field_type: type, nullable: bool) -> Any:
    """`text` read as `field_type` (ValueError if it is not one); `None` as None if `nullable`,
    and a missing value (a bare flag) as True for a bool."""
    if text is None:
        if field_type is bool:
            return True
        raise ValueError("a value is required (--config.FIELD=VALUE)")
    if nullable and text == "None":
        return None
    if field_type is type(None):
        return _literal(text)
    if field_type not in PARSERS:
        raise ValueError(f"fields of type {field_type.__name__} cannot be set on the command line")
    return PARSERS[field_type](text)


def apply_override(config: ml_collections.ConfigDict, field: str, text: str | None,
                   flag: str | None = None) -> None:
    """Set dotted `field` of `config` to `text` read as the field's type; a one-line UsageError
    names the flag (`--config.FIELD`, or `flag FIELD` for another flag that sets fields), the
    value and the expected type, or for an unknown field the nearest existing one."""
    holder, name = _holder(config, field, f"{flag} {field}" if flag else PREFIX + field)
    current = holder[name]
    if isinstance(current, ml_collections.ConfigDict):
        example = "name" if "name" in current else next(iter(current.keys()), "FIELD")
        raise UsageError(f"{flag or PREFIX + field}: {field} is a section; set its fields, e.g. "
                         f"{PREFIX}{field}.{example}=VALUE")
    field_type = holder.get_type(name)
    reference = isinstance(holder._fields.get(name), ml_collections.FieldReference)
    try:
        value = parse_value(text, field_type, nullable=reference or current is None)
        holder[name] = value
    except (ValueError, TypeError) as error:
        expected = TYPE_NAMES.get(field_type, field_type.__name__)
        given = f"{flag} {field}" if flag else f"flag {PREFIX}{field}"
        given += "" if text is None else f"={text}"
        raise UsageError(f"{given}: {str(error).splitlines()[0]}; {field} is {expected}") from None


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: Sequence[tuple[str, str | None]]) -> None:
    """`apply_override` for each (FIELD, VALUE) of `split_overrides`, in order."""
    for field, text in overrides:
        apply_override(config, field, text)


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """Add `--config PATH[:ARG]` (and the help line of its overrides) to `parser`."""
    parser.add_argument(
        "--config", metavar="PATH[:ARG]", default=None,
        help="experiment file; get_config(ARG) gives the config. Set its fields with "
             "--config.FIELD=VALUE (dotted FIELD, VALUE read as the field's type)")


def parse_with_config(parser: ArgumentParser, argv: Sequence[str] | None = None, *,
                      required: bool = True
                      ) -> tuple[ml_collections.ConfigDict | None, argparse.Namespace]:
    """Add `--config` to `parser`, parse `argv` (default sys.argv[1:]) and return (the config
    with its --config.FIELD overrides applied, the other arguments); `args.config` keeps the
    PATH[:ARG] text. Every error exits 2 with one line (`parser.error`). Without --config the
    config is None, an error if `required`, as are overrides without --config."""
    argv = sys.argv[1:] if argv is None else list(argv)
    add_config_argument(parser)
    rest, overrides = split_overrides(argv)
    args, extras = parser.parse_known_args(rest)
    if extras:
        hint = "" if extras[0].startswith("-") else "; fields are set as --config.FIELD=VALUE"
        parser.error(f"unrecognized argument {extras[0]!r}{hint}")
    if args.config is None:
        if required or overrides:
            parser.error("--config is required, e.g. --config experiments/quickstart.py")
        return None, args
    try:
        config = load_experiment(args.config)
        apply_overrides(config, overrides)
    except UsageError as error:
        parser.error(str(error))
    return config, args


def add_timing_arguments(parser: argparse.ArgumentParser, *, steps: int, block: int,
                         steps_help: str, block_help: str) -> None:
    """Add --steps and --block, positive ints with these defaults and help lines: the `steps`
    and `block` of `train.instruments.timing.time_interleaved`."""
    parser.add_argument("--steps", type=positive_int, default=steps, help=steps_help)
    parser.add_argument("--block", type=positive_int, default=block, help=block_help)


def analysis_parser(prog: str, doc: str | None, default_out: str) -> ArgumentParser:
    """The parser of a script that draws a saved run on one batch of its validation data:
    --workdir, --out (None: WORKDIR/`default_out`), --batch, --seq_len (None: the run's) and
    --step (None: the newest checkpoint)."""
    parser = ArgumentParser(prog, doc)
    parser.add_argument("--workdir", required=True, help="the run directory")
    parser.add_argument("--out", default=None, help=f"PNG path; default WORKDIR/{default_out}")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=None, help="default: the run's seq_len")
    parser.add_argument("--step", type=int, default=None,
                        help="the checkpoint to read; default: the newest")
    return parser
