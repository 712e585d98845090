"""The config schema's leaf: its defaults (`config.defaults`), its rules and their one owner,
`resolve(config, device_count, slice_count)` (`config.resolution`), the error type and the check
helper. Nothing in this package imports JAX, so errors in a config are reported in a fraction of a
second; every other package may import it, and it imports none of them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in the config: one line naming the field, the bad value and what is valid."""


def lookup(config, path: str):
    """The field at dotted `path` of a ConfigDict (or dict): lookup(model, "ffn.name")."""
    for part in path.split("."):
        config = config[part]
    return config


def is_int(value) -> bool:
    """Whether `value` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check(condition: bool, field: str, value, valid: str) -> None:
    """Raise `ConfigError` "`field`=`value` is invalid: `valid`" unless `condition`."""
    if not condition:
        raise ConfigError(f"{field}={value!r} is invalid: {valid}")


from config.resolution import is_resolved, resolve  # noqa: E402  (after the helpers it uses)

__all__ = ["ConfigError", "check", "is_int", "is_resolved", "lookup", "resolve"]
