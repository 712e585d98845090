"""What code and machine trained a study run: `ROOT/<cell>/seed<k>/provenance.jsonl`, one JSON
line per launch of the run by the sweep runner (a resumed run adds a line), written before the
run starts:

    {"commit": "a954c45…" or null, "dirty": true | false | null, "command": [...],
     "cpu": "AMD EPYC 7B13", "gpus": ["NVIDIA H100 80GB HBM3"], "date": "2026-12-06T10:00:00+00:00"}

`commit` is `git rev-parse HEAD` of the repository the runner runs from (null outside a git
checkout), `dirty` whether its tracked files differed from that commit. A study that registers
`NUMERICS_SINCE` (a commit from which the code gives its numbers) counts a run as trained at
that code when every launch's commit descends from it (`git merge-base --is-ancestor`);
`numerics_reason` says why a run does not. A study that registers its claims after some of
their runs (`REGISTERED`, a UTC time) counts a run as post hoc when its first launch came
before it (`registration_reason`). Whatever a study registers, a run launched from a dirty tree,
or at a commit that is not an ancestor of the reporting checkout's HEAD, is not confirmatory
(`launch_reason`); a sweep launches only from a clean checkout at a commit on main
(`checkout_problem`) unless it is told its runs are exploratory. Standard library only.
"""

from __future__ import annotations

import datetime
import json
import platform
import shutil
import subprocess
from pathlib import Path

PROVENANCE = "provenance.jsonl"
REPOSITORY = Path(__file__).resolve().parents[2]  # the checkout the runner and the trainer run


def _git(*args: str, repository: Path | None = None) -> subprocess.CompletedProcess | None:
    """`git ARGS` in `repository` (default REPOSITORY), or None when git cannot run there."""
    try:
        return subprocess.run(["git", *args], cwd=repository or REPOSITORY,
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _cpu() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else `platform.processor()`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    """The names of the NVIDIA GPUs `nvidia-smi` lists ([] without it)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def current(command: list[str]) -> dict:
    """The provenance of launching `command` now, from this checkout on this machine."""
    head = _git("rev-parse", "HEAD")
    commit = head.stdout.strip() if head is not None and head.returncode == 0 else None
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    dirty = bool(status.stdout.strip()) if status is not None and status.returncode == 0 \
        else None
    return {"commit": commit, "dirty": dirty, "command": list(command), "cpu": _cpu(),
            "gpus": _gpus(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def append(workdir: str | Path, command: list[str]) -> dict:
    """Add the provenance of launching `command` to `workdir/provenance.jsonl`; returns it."""
    entry = current(command)
    with (Path(workdir) / PROVENANCE).open("a") as handle:
        handle.write(json.dumps(entry) + "\n")
    return entry


def read(workdir: str | Path) -> list[dict]:
    """The launches recorded in `workdir/provenance.jsonl` ([] if none); torn lines skipped."""
    path = Path(workdir) / PROVENANCE
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def descends_from(commit: str, boundary: str, repository: Path | None = None) -> bool | None:
    """Whether `commit` is `boundary` or a descendant of it; None when the repository does not
    know one of them."""
    done = _git("merge-base", "--is-ancestor", boundary, commit, repository=repository)
    if done is None or done.returncode not in (0, 1):
        return None
    return done.returncode == 0


MAIN_BRANCHES = ("main", "origin/main")  # what "on main" is checked against, first found first


def checkout_problem(repository: Path | None = None) -> str | None:
    """Why the checkout cannot launch confirmatory runs, or None when its tracked files equal
    HEAD and HEAD is on main (an ancestor of, or equal to, the first of MAIN_BRANCHES there)."""
    head = _git("rev-parse", "HEAD", repository=repository)
    if head is None or head.returncode != 0:
        return "it is not a git checkout, so its runs' code cannot be named"
    commit = head.stdout.strip()
    status = _git("status", "--porcelain", "--untracked-files=no", repository=repository)
    if status is None or status.returncode != 0 or status.stdout.strip():
        return f"its tracked files differ from HEAD {commit[:7]} (a dirty tree): commit them"
    for branch in MAIN_BRANCHES:
        known = _git("rev-parse", "--verify", "--quiet", f"{branch}^{{commit}}",
                     repository=repository)
        if known is None or known.returncode != 0:
            continue
        if descends_from(known.stdout.strip(), commit, repository):
            return None
        return f"HEAD {commit[:7]} is not on {branch}: run from a commit on main"
    return f"it has no branch {' or '.join(MAIN_BRANCHES)} to check HEAD {commit[:7]} against"


def launch_reason(launches: list[dict], repository: Path | None = None) -> str | None:
    """Why a run's launches do not name the code that trained it, for the checkout at
    `repository`: "launched from a dirty tree at COMMIT", "commit COMMIT unknown here", "commit
    COMMIT is not an ancestor of HEAD"; None when every launch is clean at an ancestor of HEAD,
    and for a run without provenance (the registration and NUMERICS_SINCE rules judge those)."""
    for launch in launches:
        commit = launch.get("commit")
        if not commit:
            return "a launch outside a git checkout"
        if launch.get("dirty"):
            return f"launched from a dirty tree at {commit[:7]}"
        descends = descends_from("HEAD", commit, repository)
        if descends is None:
            return f"commit {commit[:7]} unknown here"
        if not descends:
            return f"commit {commit[:7]} is not an ancestor of HEAD"
    return None


def numerics_reason(launches: list[dict], boundary: str,
                    repository: Path | None = None) -> str | None:
    """Why a run with these launches is not known to have trained at code from `boundary` on
    ("no provenance", "trained at COMMIT, before BOUNDARY", ...), or None when every launch's
    commit descends from it."""
    if not launches:
        return "no provenance"
    for launch in launches:
        commit = launch.get("commit")
        if not commit:
            return "a launch outside a git checkout"
        descends = descends_from(commit, boundary, repository)
        if descends is None:
            return f"commit {commit[:7]} unknown here"
        if not descends:
            return f"trained at {commit[:7]}, before {boundary[:7]}"
    return None


def registration_reason(launches: list[dict], registered: str) -> str | None:
    """Why a run with these launches is post hoc for claims registered at `registered` (an ISO
    8601 UTC date or time): "no provenance", or "launched DATE, before the claims were
    registered"; None when its first launch came at or after it."""
    if not launches or not launches[0].get("date"):
        return "no provenance"
    first = launches[0]["date"]
    if utc_time(first) < utc_time(registered):
        return f"launched {first[:16]}, before the claims were registered"
    return None


def utc_time(text: str) -> datetime.datetime:
    """An ISO 8601 date or time as an aware datetime (a naive one is taken as UTC); ValueError
    when it is not one."""
    moment = datetime.datetime.fromisoformat(text)
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)
