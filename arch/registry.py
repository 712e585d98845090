"""Small named registries: a config names a component, the registry builds it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Registry(dict):
    """A dict of name → component for one family (norm, attention, ffn, ...).

    Register with the decorator: `@NORMS.register("rmsnorm")`. Looking up an unknown name raises a
    `KeyError` that lists the valid names; config validation reports the same list. Each name's
    record (module, capabilities, rules) is in `config.catalogue`, which `config.resolve` checks
    before JAX loads; tests/test_config_sections.py checks that the two name the same
    components. A test's component goes into both through the `register_component` fixture
    (tests/conftest.py), which restores both afterwards.
    """

    def __init__(self, family: str):
        super().__init__()
        self.family = family

    def register(self, name: str) -> Callable[[Any], Any]:
        def add(component):
            if name in self:
                raise ValueError(f"{self.family} {name!r} is registered twice")
            self[name] = component
            return component

        return add

    def __missing__(self, name):
        raise KeyError(f"unknown {self.family} {name!r}; valid: {', '.join(sorted(self))}")
