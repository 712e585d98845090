"""Huge pages for XLA:CPU's per-step temporary buffer, by re-executing the process.

XLA:CPU mallocs each step's temporary buffer (hundreds of MB for a small model) and frees it
after; glibc serves an allocation that large with a fresh mmap, so every step faults the buffer
in 4 KiB at a time, and the first op to touch it (often the zero-fill of a layer scan's stacked
outputs) pays for it (docs/performance.md, "Huge pages for the per-step temporary buffer").
glibc's tunable `glibc.malloc.hugetlb=1` (glibc ≥ 2.35) makes malloc madvise such mappings for
transparent huge pages. Tunables are read when a process starts, so `reexec()` runs the same
command line again with the tunable added to GLIBC_TUNABLES.

It does so only where it applies: Linux with glibc ≥ 2.35, transparent huge pages in `always` or
`madvise` mode, GLIBC_TUNABLES not already naming the tunable (`GLIBC_TUNABLES=
glibc.malloc.hugetlb=0` keeps 4 KiB pages), and the interpreter's command line known
(`sys.orig_argv`). The entry points (`python -m train`, `scripts/bench.py`) call it first thing;
JAX is not imported yet, and execve keeps the process id.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent huge page mode (the bracketed word), or "" where unknown."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def tuned_environment(environ: Mapping[str, str], system: str, libc: tuple[str, str],
                      mode: str) -> dict[str, str] | None:
    """The environment to re-execute with, or None where the tunable does not apply or is
    already set. `libc` is `platform.libc_ver()`, `mode` is `thp_mode()`."""
    name, version = libc
    numbers = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    tunables = environ.get("GLIBC_TUNABLES", "")
    if (system != "Linux" or name != "glibc" or numbers < (2, 35)
            or mode not in ("always", "madvise") or TUNABLE in tunables):
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, f"{TUNABLE}=1"]))}


def reexec() -> None:
    """Re-execute this process's command line with huge pages for malloc, where that applies
    (module docstring); otherwise return."""
    environment = tuned_environment(os.environ, platform.system(), platform.libc_ver(),
                                    thp_mode())
    command = getattr(sys, "orig_argv", None)
    if environment is None or not command:
        return
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(sys.executable, command, environment)
