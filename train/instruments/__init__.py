"""Instruments that run a model to measure it: per-depth probes, gradients by layer, head
ablation and block removal, compiled train-step memory (`probes`, `layer_gradients`, `ablation`,
`step_memory`), pruning and healing (`pruning`, `head_pruning`), the probe report of a run
(`probe_report`, `pruning_report`), the looped-depth early-exit losses (`early_exit`),
depth-mixing heatmaps (`depth_mixing`), the Gated Residual path decomposition (`gr_paths`), op
profiles and timing (`op_profile`, `timing`).

They sit above the trainer: an instrument may import the trainer's core, its data, `arch`,
`sharding` and `config`; the trainer's core and data never import it (the import-linter contracts
in pyproject.toml). The scripts in scripts/ are the command lines over these modules: each parses
its arguments and checks them without JAX (`train.data.arguments`; what several share, without
JAX too: `command_line`), then imports the module."""
