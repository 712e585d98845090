"""The run directory's guards, without JAX: the workdir checks, the workdir lock, config identity
on resume and metrics.jsonl on resume. `python -m train` runs them before it imports JAX (a
fast, one-line refusal) and `train.loop.train` runs them again for every caller. A damaged lock,
config.json or metrics.jsonl is a one-line `WorkdirError` naming the file and the fix, and the
file is left as is.

A run directory holds config.json, checkpoints/<step>/, metrics.jsonl, tensorboard/ and the
lock file `lock` (docs/runs.md). The scripts that read a finished run (evaluation, analysis,
export, quantization) check it with `saved_run` before JAX loads, and bound their --seq_len
with `context_length`. Imports only the standard library and `config` (and so ml_collections).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from config import ConfigError, is_int
from config.defaults import base_config
from config.legacy import upgrade

log = logging.getLogger(__name__)

LOCK_FILE = "lock"
# Fields that may differ between a run's config.json and the config that resumes it: how long
# it runs (the learning-rate schedule follows `steps`), its logging, evaluation and checkpoint
# cadence, the final sample, the mesh, where the data is cached, the guards themselves, and how
# the model executes (kernels, remat, pipeline schedule).
# Every other field defines the model, the optimizer state, the data or the batch order.
MAY_CHANGE_ON_RESUME = ("steps", "log_every", "eval_every", "eval_batches", "checkpoint_every",
                        "keep_checkpoints", "sample_tokens", "sample_prompt", "temperature",
                        "top_k", "mesh", "data.data_dir", "resume_mode", "finetune_from",
                        "nonfinite_policy", "accumulation_steps", "execution", "resolved",
                        "data.verify", "data.prefetch", "data.read_threads")


class WorkdirError(ConfigError):
    """A run directory that cannot be used as asked: one line naming it, the problem and the
    fix (exit status 2, like a config error)."""


class DamagedFile(ValueError):
    """A file that cannot be read as JSON: the message is the problem, as a phrase after the
    file's path ("is not valid JSON (...)"); callers name the file and the fix."""


def read_json(path: str | Path):
    """The JSON value in the file `path`; `DamagedFile` if it is a directory, unreadable, not
    UTF-8 text or not JSON (e.g. truncated)."""
    path = Path(path)
    if path.is_dir():
        raise DamagedFile("is a directory, not a file")
    try:
        return json.loads(path.read_bytes().decode())
    except UnicodeDecodeError:
        raise DamagedFile("holds bytes that are not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise DamagedFile(f"is not valid JSON ({error})") from None
    except OSError as error:
        raise DamagedFile(f"cannot be read ({error.strerror or error})") from None


def check_workdir(workdir: str | Path) -> None:
    """Raise `WorkdirError` unless `workdir` is, or can be created as, a writable directory,
    and its `checkpoints`, if there, a writable directory."""
    path = Path(workdir)
    if path.exists() and not path.is_dir():
        raise WorkdirError(f"--workdir={workdir} is a file, not a directory; pass a directory "
                           "(it is created if missing)")
    if problem := creation_problem(path):
        raise WorkdirError(f"--workdir={workdir} {problem}")
    checkpoints = path / "checkpoints"
    if checkpoints.exists() and not checkpoints.is_dir():
        raise WorkdirError(f"--workdir={workdir}: {checkpoints} is a file, not the directory of "
                           "the run's checkpoints; move it aside and rerun, or use a new --workdir")
    if checkpoints.is_dir() and not os.access(checkpoints, os.W_OK | os.X_OK):
        raise WorkdirError(f"--workdir={workdir}: {checkpoints} is not writable; make it "
                           "writable (e.g. chmod u+w) and rerun, or use a new --workdir")


def creation_problem(path: Path) -> str | None:
    """Why the directory `path` cannot be made (a phrase after its name), or None: its nearest
    existing ancestor, where mkdir would write, must be a directory this user may write."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot be created: {existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" ({existing} is where it would be created)"
        return f"is not writable{where}; pass a directory you can write to"
    return None


@contextlib.contextmanager
def file_lock(path: str | Path):
    """Hold an exclusive `fcntl.flock` on the file at ``path`` (created if absent), so processes
    on this host that share the path take turns; released on exit, and by the kernel on a crash."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def checkpoint_steps(workdir: str | Path) -> list[int]:
    """The steps of `workdir/checkpoints/<step>` directories, ascending (a partial save
    included: the restore decides what is usable)."""
    directory = Path(workdir) / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


# ---------------------------------------------------------------------------------------------
# The workdir lock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _damaged_lock(path: Path, problem: str) -> WorkdirError:
    return WorkdirError(f"--workdir={path.parent}: its lock file {path} {problem}; it is left as "
                        "is: if no trainer is using this directory, delete it and rerun")


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')} (since "
            f"{holder.get('started', '?')})")


class WorkdirLock:
    """An advisory lock on a run directory, held for the whole run: the file `<workdir>/lock`
    names the holder's host and pid, and an `fcntl.flock` on it is held while the run lives
    (the kernel releases it when the process dies, however it dies).

    A second trainer finds the lock held (the flock is taken, or the file names a live process
    on this host or any process on another host) and raises `WorkdirError` naming the holder.
    A lock whose file names a dead pid on this host is stale: it is taken over with a warning.
    Releasing empties the file (it is never deleted: a file another trainer has opened must
    stay the lock). Multi-host runs take it from process 0 only.
    """

    def __init__(self, workdir: str | Path):
        self.path = Path(workdir) / LOCK_FILE
        self.fd: int | None = None

    @staticmethod
    def read_holder(path: Path) -> dict | None:
        """The holder named in the lock file, or None if the file is absent or empty (released).
        Raises `WorkdirError` if it is damaged: not a file, not UTF-8 text, or not the JSON
        object a trainer writes (it is left as is)."""
        if path.is_dir():
            raise _damaged_lock(path, "is a directory, not a file")
        try:
            text = path.read_bytes().decode()
        except FileNotFoundError:
            return None
        except UnicodeDecodeError:
            raise _damaged_lock(path, "holds bytes that are not UTF-8 text") from None
        if not text.strip():
            return None
        try:
            holder = json.loads(text)
        except json.JSONDecodeError:
            raise _damaged_lock(path, "is not JSON") from None
        if not isinstance(holder, dict):
            raise _damaged_lock(path, f"holds a JSON {type(holder).__name__}, not the object "
                                "{\"host\", \"pid\", \"started\"} a trainer writes")
        return holder

    @staticmethod
    def held_by(holder: dict | None) -> bool:
        """Whether the process the lock file names may still be running."""
        if holder is None:
            return False
        if holder.get("host") != socket.gethostname():
            return True  # no way to tell from here: assume alive
        pid = holder.get("pid")
        return isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid)

    def _holder_if_readable(self) -> dict | None:
        """The holder named in the lock file of a lock that is held, None if it is damaged: the
        live holder is what matters then."""
        try:
            return self.read_holder(self.path)
        except WorkdirError:
            return None

    def _refuse(self, holder: dict | None) -> WorkdirError:
        who = _describe(holder) if holder else "another process"
        return WorkdirError(
            f"--workdir={self.path.parent} is in use by {who} (lock file {self.path}); wait for "
            "it to finish, stop it, or use another --workdir (if that process is gone, delete "
            "the lock file)")

    def acquire(self) -> WorkdirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_dir():
            raise _damaged_lock(self.path, "is a directory, not a file")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._refuse(self._holder_if_readable()) from None
            raise
        holder = self.read_holder(self.path)
        if self.held_by(holder):  # a holder on another host, or where flock does not reach
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise self._refuse(holder)
        if holder is not None and holder.get("pid") != os.getpid():
            log.warning("taking over the stale lock of %s in %s (that process is gone)",
                        _describe(holder), self.path)
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_not_locked(workdir: str | Path) -> None:
    """Raise `WorkdirError` if a live trainer holds `workdir`'s lock (a check only: the lock is
    taken by `WorkdirLock.acquire`)."""
    lock = WorkdirLock(workdir)
    if not lock.path.exists():
        return
    if lock.path.is_dir():
        raise _damaged_lock(lock.path, "is a directory, not a file")
    try:
        fd = os.open(lock.path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        raise lock._refuse(lock._holder_if_readable()) from None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    holder = lock.read_holder(lock.path)
    if lock.held_by(holder):
        raise lock._refuse(holder)


# ---------------------------------------------------------------------------------------------
# Config identity


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _may_change(field: str) -> bool:
    return any(field == name or field.startswith(name + ".") for name in MAY_CHANGE_ON_RESUME)


def identity_differences(saved: dict, new: dict, *, resolved: bool) -> list[tuple]:
    """The fields, (field, saved value, new value), in which `new` (a config as JSON data) would
    not resume the run `saved` describes (its config.json over the current defaults). With
    `resolved` False, a None in `new` is a field not yet derived (e.g. model.attention.head_dim) and
    matches."""
    saved_flat, new_flat = _flatten(saved), _flatten(new)
    differences = []
    for field in sorted(saved_flat.keys() | new_flat.keys()):
        if _may_change(field):
            continue
        old, value = saved_flat.get(field), new_flat.get(field)
        if value is None and not resolved:
            continue
        if old != value:
            differences.append((field, old, value))
    return differences


def _restore_advice(workdir: str | Path) -> str:
    """How to go on from the checkpoints of `workdir` when its config.json is gone or damaged."""
    steps = checkpoint_steps(workdir)
    if not steps:
        return ("it holds no checkpoint: use a new --workdir, or put back a copy of the run's "
                "config.json")
    return (f"its checkpoints (steps {steps[0]}..{steps[-1]}) are kept: put back a copy of the "
            "run's config.json to resume, or move the file aside and start from their weights "
            "in a new --workdir with the run's --config and --config.resume_mode=finetune "
            f"--config.finetune_from={workdir}")


def _damaged_config(workdir: str | Path, problem: str) -> WorkdirError:
    return WorkdirError(f"--workdir={workdir}: {Path(workdir) / 'config.json'} {problem}; it is "
                        f"left as is, and {_restore_advice(workdir)}")


def saved_config(workdir: str | Path, defaults: dict) -> dict | None:
    """The run's config.json as JSON data over `defaults` (fields added since it was written keep
    their defaults; names it uses from earlier versions moved by `config.legacy.upgrade`), or
    None if there is none. Raises `WorkdirError` if it is unreadable."""
    path = Path(workdir) / "config.json"
    if not path.exists():
        return None
    try:
        saved = read_json(path)
    except DamagedFile as problem:
        raise _damaged_config(workdir, str(problem)) from None
    if not isinstance(saved, dict):
        raise _damaged_config(workdir, f"holds a JSON {type(saved).__name__}, not the object of "
                              "a config")
    saved = upgrade(saved)

    def merge(base: dict, over: dict) -> dict:
        merged = dict(base)
        for key, value in over.items():
            merged[key] = (merge(base[key], value) if isinstance(value, dict)
                           and isinstance(base.get(key), dict) else value)
        return merged

    return merge(defaults, saved)


def saved_run(workdir: str | Path, step: int | None = None) -> dict:
    """The config.json of the training run in `workdir` as JSON data over `base_config()`'s
    defaults (what `train.restore.restore_run` rebuilds the run from), once `workdir` is known
    to hold a checkpoint (the one at `step`, when given). Whether the checkpoint restores is
    the restore's to find out."""
    if not Path(workdir).is_dir():
        raise ConfigError(f"--workdir={workdir} is not a directory; pass a run directory "
                          "(python -m train --workdir DIR writes one)")
    saved = saved_config(workdir, base_config().to_dict())
    if saved is None:
        raise ConfigError(f"--workdir={workdir} holds no config.json; train a model there first "
                          "with python -m train")
    steps = checkpoint_steps(workdir)
    if step is not None and step not in steps:
        raise ConfigError(f"--workdir={workdir} holds no restorable checkpoint at step {step} "
                          f"(its checkpoints: {steps or 'none'})")
    if not steps:
        raise ConfigError(f"--workdir={workdir} holds no checkpoint; train a model there first "
                          "with python -m train")
    return saved


def context_length(saved: dict) -> int:
    """The longest sequence the saved run's model takes: model.max_seq_len (seq_len when
    unset)."""
    return saved["model"].get("max_seq_len") or saved["seq_len"]


def _as_json(config) -> dict:
    """A ConfigDict as config.json holds it (tuples as lists, references resolved)."""
    return json.loads(config.to_json_best_effort())


def check_resume(workdir: str | Path, config, *, resolved: bool) -> None:
    """Refuse (`WorkdirError`) to resume the checkpoints in `workdir` with `config` (a
    ConfigDict; `resolved`: its derived model fields are filled in) if it differs from the run's
    config.json in a field that defines the model, the optimizer state, the data or the batch
    order (every field not in `MAY_CHANGE_ON_RESUME`), or whose `steps` is below the newest
    checkpoint's step; refuse a fine-tune into its own source directory, and a damaged
    config.json or metrics.jsonl (left as is). A fine-tune's own checkpoints resume like any
    run's."""
    config_json, defaults = _as_json(config), _as_json(base_config())
    source = config_json.get("finetune_from")
    if config_json.get("resume_mode") == "finetune" and source and \
            Path(source).resolve() == Path(workdir).resolve():
        raise WorkdirError(f"--workdir={workdir} is also finetune_from: a fine-tune starts a new "
                           "run; pass a new --workdir")
    check_metrics(workdir)
    steps = checkpoint_steps(workdir)
    if not steps:
        return
    saved = saved_config(workdir, defaults)
    if saved is None:
        raise WorkdirError(f"--workdir={workdir}: {Path(workdir) / 'config.json'} is missing, so "
                           "its checkpoints cannot be checked against this config; "
                           f"{_restore_advice(workdir)}")
    differences = identity_differences(saved, config_json, resolved=resolved)
    if differences:
        derived = _flatten(defaults)  # fields whose default is None derive from others: last
        differences.sort(key=lambda difference: derived.get(difference[0], 0) is None)
        shown = "; ".join(f"{field}: {old!r} → {value!r}" for field, old, value
                          in differences[:6]) + ("; …" if len(differences) > 6 else "")
        raise WorkdirError(
            f"--workdir={workdir} holds a run with a different config ({shown}); its checkpoints "
            "are kept: use a new --workdir, or start from its weights in a new one with "
            f"--config.resume_mode=finetune --config.finetune_from={workdir}")
    target = config_json.get("steps")
    if is_int(target) and target < steps[-1]:
        raise WorkdirError(
            f"steps={target} is invalid: --workdir={workdir} holds a checkpoint at step "
            f"{steps[-1]}, past it, so there is nothing to train; raise steps to at least "
            f"{steps[-1]} to resume, or use a new --workdir")


# ---------------------------------------------------------------------------------------------
# Metrics on resume


def _damaged_metrics(path: Path, problem: str) -> WorkdirError:
    return WorkdirError(f"--workdir={path.parent}: {path} {problem}; it is left as is: "
                        f"move it aside (e.g. to {path.name}.damaged) and rerun: the run resumes "
                        "from its checkpoints and logs its steps from there")


def _metric_records(path: Path) -> list[tuple[str, dict | None]]:
    """(line, record) of each line of `path` (metrics.jsonl); the record None for a torn last
    line (a crash mid-write). Raises `WorkdirError` if the file is damaged: not a file, a line
    before the last that is not UTF-8 JSON, or a record that is not an object with an integer
    step."""
    if path.is_dir():
        raise _damaged_metrics(path, "is a directory, not a file")
    data = path.read_bytes()
    lines = [line for line in data.split(b"\n") if line.strip()]
    torn_allowed = not data.endswith(b"\n")  # the last line was cut short by a crash
    records = []
    for number, raw in enumerate(lines, 1):
        torn = torn_allowed and number == len(lines)
        try:
            line = raw.decode()
            record = json.loads(line)
        except UnicodeDecodeError:
            if torn:
                records.append(("", None))
                continue
            raise _damaged_metrics(path, f"line {number} holds bytes that are not UTF-8 "
                                   "text") from None
        except json.JSONDecodeError:
            if torn:
                records.append((line, None))
                continue
            raise _damaged_metrics(path, f"line {number} is not JSON") from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            shown = (f"has step={step!r}, not an integer" if isinstance(record, dict)
                     else f"holds a JSON {type(record).__name__}, not an object")
            raise _damaged_metrics(path, f"line {number} {shown}")
        records.append((line, record))
    return records


def check_metrics(workdir: str | Path) -> None:
    """Raise `WorkdirError` if `workdir/metrics.jsonl` is damaged (see `_metric_records`), so a
    resume refuses it before anything loads."""
    path = Path(workdir) / "metrics.jsonl"
    if path.exists():
        _metric_records(path)


def truncate_metrics(path: str | Path, step: int) -> int:
    """Drop the records of `path` (metrics.jsonl) after `step`, the step a run resumes from: the
    steps it replays are logged again, once. Returns the number of records dropped. A torn last
    line (a crash mid-write) is dropped too. A damaged file raises `WorkdirError` and is left as
    is."""
    path = Path(path)
    if not path.exists():
        return 0
    records = _metric_records(path)
    kept = [line for line, record in records if record is not None and record["step"] <= step]
    dropped = len(records) - len(kept)
    if dropped:
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text("".join(line + "\n" for line in kept))
        os.replace(temporary, path)
    return dropped
