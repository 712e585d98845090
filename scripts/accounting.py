"""The books of a model from its config alone (`jax.eval_shape`: nothing is allocated).

    python scripts/accounting.py --config experiments/quickstart.py [--config.FIELD=VALUE ...]
    python scripts/accounting.py --shape llama-3-8b --shape gpt2 [--seq_len 2048]
    python scripts/accounting.py --shape all [--format markdown|json|csv] [--out FILE]

For each model (an experiment file, and/or named reference shapes, `--shape all` for every one):

  parameters        total (unique, storage) and active per token (MoE: k of E routed experts);
                    by component (embedding, attention, ffn, norms, residual, head, mtp; they sum to
                    the total); vocabulary-indexed tables and the non-embedding rest; the tied
                    vs untied difference (V·d) — `arch.accounting.parameter_breakdown`
  flops             matmul FLOPs per token, training (3× forward) and inference, causal
                    attention counted as t + 1 keys at position t (min(t + 1, W) with a
                    sliding window W), at --seq_len
                    (`arch.accounting.flops_per_token`; what MFU divides by)
  kv_cache          bytes per token over all layers and per sequence of --seq_len, at the
                    compute dtype (MLA stores its latent), plus Gated DeltaNet layers' constant
                    recurrent state per sequence — `kv_cache_bytes_per_token`,
                    `recurrent_state_bytes`; the positions held per sequence: --seq_len, or with
                    a sliding window (model.attention.window W) min(--seq_len, W), a ring buffer
  residual          I/O per token per sublayer (units of d), history per token (elements),
                    its bytes per sequence and per device (÷ mesh.sequence), and the residual
                    mechanism's added parameters — `residual_accounting`
  published         for open models: the released checkpoint's parameter count, and whether
                    the total reproduces it exactly

Reference shapes (`arch/reference_shapes.py`): the open models gpt2, gpt2-medium, llama-2-7b,
llama-3-8b, mistral-7b-v0.3 from their public config.json; `tying` (V = 50,000, d = 2,048:
tying saves 102.4M) and `wide_glu` (d = 4,096, 32 heads of p = 128, a 14,336-wide gated FFN:
10.5·d² per block); `transformer_base`, the encoder–decoder of Vaswani et al. 2017 assembled from
this framework's parts (63.1M; the paper's Table 3 rounds to 65M), parameters only.

--seq_len defaults to the experiment's seq_len, else 2,048 (capped at the model's max_seq_len).
--format markdown (default) prints one table per model; json one object {name: books}; csv one
row per (model, quantity). --out writes to a file instead of stdout.

A bad argument is one line on stderr and exit status 2; the config (`config.resolve`), --seq_len
and --out are checked before JAX loads, --shape's names after (they live in arch).
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from pathlib import Path

from config import ConfigError, resolve
from config.cli import ArgumentParser, parse_with_config
from config.mesh_shape import MESH_AXES
from train.data.arguments import output_file


def shape_books(name: str, seq_len: int) -> dict:
    """The books of one named reference shape."""
    from arch import reference_shapes as shapes
    from arch.accounting import books

    if name == "transformer_base":
        return {"parameters": shapes.transformer_base_parameters()}
    examples = shapes.worked_examples()
    if name in examples:
        return books(examples[name], seq_len)
    result = books(shapes.open_model(name), seq_len)
    published = shapes.PUBLISHED_PARAMETERS[name]
    result["published"] = {"parameters": published,
                           "reproduced": result["parameters"]["total"] == published}
    return result


# The reference shapes' names, checked before JAX loads: a copy of arch.reference_shapes's
# (transformer_base, the worked examples, the public configs), which imports JAX; a test keeps
# the two equal.
SHAPES = ("transformer_base", "tying", "wide_glu", "gpt2", "gpt2-medium", "llama-2-7b",
          "llama-3-8b", "mistral-7b-v0.3")


def _rows(books: dict, prefix: str = ""):
    for key, value in books.items():
        if isinstance(value, dict):
            yield from _rows(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _format_value(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:.4g}"


def render(all_books: dict[str, dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(all_books, indent=2)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["model", "quantity", "value"])
        for name, books in all_books.items():
            writer.writerows((name, key, value) for key, value in _rows(books))
        return out.getvalue()
    tables = []
    for name, books in all_books.items():
        lines = [f"## {name}", "", "| quantity | value |", "|---|---:|"]
        lines += [f"| {key} | {_format_value(value)} |" for key, value in _rows(books)]
        tables.append("\n".join(lines))
    return "\n\n".join(tables) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/accounting.py", __doc__)
    parser.add_argument("--shape", action="append", default=[],
                        help="a reference shape (repeatable), or 'all'")
    parser.add_argument("--seq_len", type=int, default=None,
                        help="sequence length for FLOPs and KV cache")
    parser.add_argument("--format", choices=["markdown", "json", "csv"], default="markdown",
                        help="output format")
    parser.add_argument("--out", default=None, help="write to this file instead of stdout")
    config, args = parse_with_config(parser, argv, required=False)
    if config is None and not args.shape:
        parser.error("give --config PATH and/or --shape NAME (or --shape all)")
    if args.seq_len is not None and args.seq_len < 1:
        parser.error(f"--seq_len={args.seq_len} is invalid: must be a positive integer")
    names = list(SHAPES) if "all" in args.shape else list(args.shape)
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        parser.error(f"--shape: unknown {unknown}; known: all, {', '.join(SHAPES)}")
    try:
        if args.out:
            output_file(args.out)
        if config is not None:
            # The books need no devices: resolve for the mesh the config asks for.
            sizes = [config.mesh[axis] for axis in MESH_AXES]
            slices = math.prod(config.mesh.dcn[axis] for axis in MESH_AXES)
            config = resolve(config, math.prod(size for size in sizes if size > 0), slices)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from arch.accounting import books  # JAX loads here, after the checks

    all_books = {}
    if config is not None:
        all_books[Path(args.config.partition(":")[0]).stem] = books(
            config.model, args.seq_len or config.seq_len, max(1, config.mesh.sequence))
    for name in names:
        print(f"accounting: {name}", file=sys.stderr)
        all_books[name] = shape_books(name, args.seq_len or 2048)
    text = render(all_books, args.format)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
