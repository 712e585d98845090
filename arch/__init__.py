"""The model zoo. Importing any part of it registers every component in its registry."""

from arch import (  # noqa: F401
    attention,
    attnres,
    batchnorm,
    deltanet,
    ffn,
    gated_residual,
    heads,
    hyper,
    moe,
    norms,
    positions,
    residual,
    rezero,
)
