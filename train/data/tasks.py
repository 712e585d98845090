"""Multiple-choice task files in lm-eval-harness's format: one item a line,
`{"context": str, "choices": [str, ...], "gold": int}` (what its `multiple_choice` tasks read
from a JSON-lines dataset with `doc_to_text: context`, `doc_to_choice: choices`,
`doc_to_target: gold`). `train.instruments.multiple_choice` scores a run on them. No JAX: a
script checks its --task before JAX loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from config import ConfigError


@dataclasses.dataclass(frozen=True)
class Item:
    """One question: the context, the choices that may follow it, and the right one's index."""

    context: str
    choices: tuple[str, ...]
    gold: int


def load_task(path: str | Path) -> list[Item]:
    """The items of a task file; a one-line ConfigError naming the line that is not an item."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--task={path} is not a file; pass a JSON-lines task "
                          '({"context": ..., "choices": [...], "gold": k} a line)')
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            item = Item(record["context"], tuple(record["choices"]), record["gold"])
            valid = (isinstance(item.context, str) and len(item.choices) >= 2
                     and all(isinstance(c, str) and c for c in item.choices)
                     and isinstance(item.gold, int) and 0 <= item.gold < len(item.choices))
        except (json.JSONDecodeError, KeyError, TypeError):
            valid = False
        if not valid:
            raise ConfigError(f"--task={path} line {number} is not an item: it needs a string "
                              '"context", two or more non-empty string "choices" and a "gold" '
                              "index into them")
        items.append(item)
    if not items:
        raise ConfigError(f"--task={path} holds no items")
    return items


def task_digest(path: str | Path) -> str:
    """The SHA-256 of a task file's bytes (which items a result counts)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def write_task(items: Sequence[Item], path: str | Path) -> None:
    """`items` as a task file (JSON lines, `load_task`'s format)."""
    lines = [json.dumps({"context": item.context, "choices": list(item.choices),
                         "gold": item.gold}, ensure_ascii=False) for item in items]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
