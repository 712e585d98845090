"""Instruments that run a model: per-depth probes, pruning and head ablation (`probes`), the
probe report of a run (`probe_report`), the looped-depth early-exit losses (`early_exit`),
depth-mixing heatmaps (`depth_mixing`), the Gated Residual path decomposition (`gr_paths`),
Hugging Face checkpoint import (`hf`, `import_hf`) and
the eager PyTorch twin of the plain decoder that scripts/bench.py times against (`torch_model`,
the one module that imports torch; nothing imports it unless torch is installed).

They sit above the trainer: an instrument may import anything in `train`, `arch`, `sharding` and
`config`; nothing outside this package imports it (the import-linter contracts in
pyproject.toml). The scripts in scripts/ are thin command lines over these modules."""
