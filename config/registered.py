"""The component names registered in `arch/`, read from its sources without importing it.

Every component registers with a literal name, `@NORMS.register("rmsnorm")`, so scanning the
sources finds the same names the registries hold once JAX is loaded (tests/test_legacy.py checks
that they agree). `python -m train` checks the config's component names against them before it
imports JAX, so a misspelled component is reported in a fraction of a second; a component
registered at run time (as tests do) is known to the registries' own check only. No JAX.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from config import check, lookup

ARCH = Path(__file__).resolve().parents[1] / "arch"
# The registry variable of each component field of the model section.
FIELDS = {"attention.name": "ATTENTION", "norm.name": "NORMS", "position.name": "POSITIONS",
          "ffn.name": "FFNS", "ffn.activation": "ACTIVATIONS", "residual.name": "RESIDUALS",
          "head.name": "HEADS"}
_DEFINITION = re.compile(r'^(\w+) = Registry\("(\w+)"\)', re.MULTILINE)
_REGISTRATION = re.compile(r'\b(\w+)\.register\("(\w+)"\)')


@functools.cache
def registries() -> dict[str, tuple[str, frozenset[str]]]:
    """Registry variable → (family, registered names), from the sources of `arch/`."""
    families, names = {}, {}
    for path in sorted(ARCH.glob("*.py")):
        text = path.read_text()
        families.update(_DEFINITION.findall(text))
        for registry, name in _REGISTRATION.findall(text):
            names.setdefault(registry, set()).add(name)
    return {registry: (family, frozenset(names.get(registry, ())))
            for registry, family in families.items()}


def check_choice(field: str, value, family: str, names) -> None:
    """ConfigError "`field`=`value` is invalid: valid <family>s: ..." unless `value` is a name."""
    check(value in names, field, value, f"valid {family}s: {', '.join(sorted(names))}")


def check_names(model) -> None:
    """Check each component name of the `model` section, and each `init` scheme, against the
    registered names (the same one-line errors as the registries' own check, `arch.config`)."""
    found = registries()
    for field, registry in FIELDS.items():
        check_choice(f"model.{field}", lookup(model, field), *found[registry])
    for group, scheme in model.init.items():
        if scheme is not None or group == "default":
            check_choice(f"model.init.{group}", scheme, *found["INITS"])
