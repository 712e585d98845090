"""Interchange with other ecosystems: Hugging Face checkpoints in and out (`hf`, `import_hf`,
`export_hf`; checked before JAX loads by `exportable` and `safetensors_file`), post-training
quantization (`quantize`) and the eager PyTorch twin of the plain decoder that scripts/bench.py
times against (`torch_model`, the one module that imports torch; nothing imports it unless torch
is installed). Above the trainer; it may use the instruments."""
