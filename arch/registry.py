"""Small named registries: a config names a component, the registry builds it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from config import catalogue


class Registry(dict):
    """A dict of name → component for one family (norm, attention, ffn, ...).

    Register with the decorator: `@NORMS.register("rmsnorm")`. Looking up an unknown name raises a
    `KeyError` that lists the valid names; config validation reports the same list. The zoo's
    names are in `config.catalogue`, which `config.resolve` checks before JAX loads; a name
    registered at run time is added to it (`catalogue.register`).
    """

    def __init__(self, family: str):
        super().__init__()
        self.family = family

    def register(self, name: str) -> Callable[[Any], Any]:
        def add(component):
            if name in self:
                raise ValueError(f"{self.family} {name!r} is registered twice")
            self[name] = component
            catalogue.register(self.family, name, getattr(component, "__module__", ""))
            return component

        return add

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        catalogue.unregister(self.family, name)

    def __missing__(self, name):
        raise KeyError(f"unknown {self.family} {name!r}; valid: {', '.join(sorted(self))}")
