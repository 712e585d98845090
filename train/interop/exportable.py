"""What a Hugging Face export must satisfy to load back, checked without JAX: scripts/export_hf.py
runs `check_exportable` on the run's config.json before JAX loads, and
`train.interop.export_hf.export_run` on the restored config before it writes anything.

- The vocabulary covers the tokenizer's: the export writes the run's tokenizer (for a byte-level
  run, or an import without a tokenizer file, the 256-token byte tokenizer), so a smaller
  embedding would meet ids past its end in `transformers` and be refused by
  scripts/import_hf.py.
- A Llama export's width divides into its heads: `transformers`' LlamaConfig requires
  hidden_size % num_attention_heads == 0, even with head_dim set (MistralConfig, a sliding
  window's, does not).
"""

from __future__ import annotations

from config import ConfigError
from config.catalogue import ROTARY, has
from train.data.tokenizer import Tokenizer


def check_exportable(model, tokenizer: Tokenizer) -> None:
    """Refuse (`ConfigError`, one line naming the field) a `model` section (a ConfigDict, or the
    JSON data of a run's config.json) whose export with `tokenizer` would not load back (see the
    module docstring)."""
    vocab_size = model["vocab_size"]
    if vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab_size} cannot be exported: the run's tokenizer "
            f"({tokenizer.spec}) has {tokenizer.vocab_size} tokens, so the exported tokenizer "
            "would give ids past the embedding and scripts/import_hf.py would refuse it; export "
            "a run whose model.vocab_size covers its tokenizer (train with model.vocab_size=0)")
    d_model, heads = model["d_model"], model["attention"]["num_heads"]
    if has("position", model["position"]["name"], ROTARY) and not model["attention"]["window"] \
            and d_model % heads:
        raise ConfigError(
            f"model.attention.num_heads={heads} cannot be exported as llama: transformers' "
            f"LlamaConfig requires hidden_size (model.d_model={d_model}) to be a multiple of "
            "num_attention_heads, even with head_dim set")
