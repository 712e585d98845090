"""The model zoo. Importing any part of it registers every component in its registry: the modules
below, by name, which are exactly those the records of `config.catalogue` name (tests/
test_architecture.py checks both ways). A new component is its module, imported here, and its
record."""

from arch import (  # noqa: F401  (imported for their registrations)
    attention,
    attnres,
    batchnorm,
    deltanet,
    differential_attention,
    ffn,
    gated_residual,
    heads,
    hyper,
    init,
    mamba2,
    moe,
    norms,
    positions,
    residual,
    rezero,
)
