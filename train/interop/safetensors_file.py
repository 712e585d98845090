"""A safetensors file's framing, checked without the safetensors library, numpy or JAX.

scripts/import_hf.py runs `safetensors_problem` on a checkpoint's weight files before JAX loads,
and `train.interop.hf` before it reads them, so a truncated or overwritten file is one line
naming it, not a crash inside the reader.
"""

from __future__ import annotations

import json
from pathlib import Path


def safetensors_problem(path: str | Path) -> str | None:
    """What is wrong with the safetensors file `path`, None if its framing is intact: an 8-byte
    little-endian header length, a JSON header of tensors with `data_offsets`, and data that
    ends where the last tensor ends (a truncated or overwritten file fails this)."""
    path = Path(path)
    if path.is_dir():
        return "is a directory, not a file"
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            prefix = file.read(8)
            header_length = int.from_bytes(prefix, "little") if len(prefix) == 8 else None
            if header_length is None or header_length > size - 8:
                return f"is truncated or not safetensors ({size} bytes, no complete header)"
            header = json.loads(file.read(header_length).decode())
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "is not safetensors (its header is not JSON)"
    if not isinstance(header, dict):
        return "is not safetensors (its header is not a JSON object)"
    try:
        end = max((int(entry["data_offsets"][1]) for name, entry in header.items()
                   if name != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        return "is not safetensors (a tensor of its header has no data_offsets)"
    if size != 8 + header_length + end:
        return (f"is truncated or damaged ({size} bytes; its header describes "
                f"{8 + header_length + end})")
    return None
