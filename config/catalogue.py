"""The components of the zoo, family by family, with the module of `arch` that defines each and
what the config's rules need to know of them. No JAX: `config.resolve` checks a config's
component names against it before JAX loads, and `arch` imports the modules it names, so adding a
component is its file and one line here. tests/test_config_sections.py checks that this
catalogue and `arch`'s live registries name the same components, both ways, with the same
properties.
"""

from __future__ import annotations

from config import check, lookup

# family → the config field naming it, and each registered name → its module of `arch`.
FAMILIES: dict[str, tuple[str, dict[str, str]]] = {
    "attention": ("attention.name", {  # token mixers
        "mha": "attention", "mla": "attention", "gated_deltanet": "deltanet",
        "differential": "differential_attention",
    }),
    "norm": ("norm.name", {
        "rmsnorm": "norms", "layernorm": "norms", "scalenorm": "norms", "dyt": "norms",
        "gatednorm": "norms", "none": "norms", "batchnorm": "batchnorm",
        "causal_batchnorm": "batchnorm",
    }),
    "position": ("position.name", {
        "rope": "positions", "learned": "positions", "sinusoidal": "positions", "none": "positions",
    }),
    "ffn": ("ffn.name", {
        "mlp": "ffn", "glu": "ffn", "reglu": "ffn", "geglu": "ffn", "swiglu": "ffn", "moe": "moe",
    }),
    "activation": ("ffn.activation", {
        name: "ffn" for name in ("gelu", "hardtanh", "leaky_relu", "relu", "sigmoid", "silu",
                                 "tanh")
    }),
    "residual": ("residual.name", {
        "prenorm": "residual", "postnorm": "residual", "deepnorm": "residual",
        "noskip": "residual", "rezero": "rezero", "attnres": "attnres", "block_attnres": "attnres",
        "hc": "hyper", "mhc": "hyper", "width": "hyper", "gated_residual": "gated_residual",
    }),
    "head": ("head.name", {
        "tied": "heads", "untied": "heads", "mos": "heads", "moc": "heads", "sigsoftmax": "heads",
    }),
    "init": ("init.<group>", {
        name: "init" for name in ("fan_in", "xavier", "bert", "depth_scaled", "deepnorm", "zeros")
    }),
}

# What the rules need of some components (each also an attribute of the component's class).
FFN_PROJECTIONS = {"mlp": 2, "glu": 3, "reglu": 3, "geglu": 3, "swiglu": 3, "moe": 3}
SINGLE_STREAM_RESIDUALS = ("prenorm", "postnorm", "deepnorm", "noskip", "rezero")


def names(family: str) -> dict[str, str]:
    """The registered names of `family` → their modules (of `arch`, or dotted paths)."""
    return FAMILIES[family][1]


def module_path(family: str, name: str) -> str:
    """The dotted path of the module that registers `name` in `family`."""
    module = names(family)[name]
    return module if "." in module else f"arch.{module}"


def modules() -> tuple[str, ...]:
    """Every module of `arch` that the catalogue names, once each (what `arch` imports)."""
    return tuple(dict.fromkeys(module for _, members in FAMILIES.values()
                               for module in members.values() if "." not in module))


def register(family: str, name: str, module: str) -> None:
    """Add a component registered at run time (a test's, a user's plugin) by its module's dotted
    path; `arch.registry.Registry.register` calls this, so the catalogue and the live registries
    stay the same both ways. A name the catalogue has already is left as it is."""
    names(family).setdefault(name, module)


def unregister(family: str, name: str) -> None:
    """Remove a component `register` added (the zoo's stay)."""
    if "." in names(family).get(name, ""):
        del names(family)[name]


def check_choice(field: str, value, family: str) -> None:
    """ConfigError "`field`=`value` is invalid: valid <family>s: ..." unless `value` is a
    registered name of `family`."""
    valid = names(family)
    check(value in valid, field, value, f"valid {family}s: {', '.join(sorted(valid))}")


def check_names(model) -> None:
    """Check each component name of the `model` section, and each `init` scheme."""
    for family, (field, _) in FAMILIES.items():
        if family != "init":
            check_choice(f"model.{field}", lookup(model, field), family)
    for group, scheme in model.init.items():
        if scheme is not None or group == "default":
            check_choice(f"model.init.{group}", scheme, "init")
