"""The model zoo. Importing any part of it registers every component in its registry."""

from arch import attention, batchnorm, ffn, heads, moe, norms, positions, residual  # noqa: F401
