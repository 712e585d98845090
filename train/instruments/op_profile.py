"""Per-op time of a compiled step: where a train step's time goes, by XLA instruction.

`profile(step, steps)` runs `step` under `jax.profiler` and sums, per HLO instruction, the time
of the runtime's events that carry an `hlo_op` (on CPU: one event per thunk of the executable).
Times are exclusive (an op's events nested inside another's, as a while loop's body inside the
loop, count for the inner op only) and summed over threads, so on a multithreaded backend they
add up to thread time, not wall time. `describe(hlo_text)` reads the compiled module's text
(`compiled.as_text()`) for each instruction's opcode, JAX primitive (the last part of its
`op_name`) and innermost source line outside JAX; `table` joins the two into rows, most costly
first, and `by_primitive` sums them per primitive.

Cost: one profiler trace of the profiled steps, holding an event per executed op (a layer
scan's body ops once per layer), read back whole.
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
from jax.profiler import ProfileData

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")
_OPCODE = re.compile(r"(?:^|[\s)}])([a-z][a-z0-9\-]*)\(")
_TABLE = re.compile(r"^(\d+) (.*)$")
_FIELDS = re.compile(r"(\w+)=(-?\d+)")


def profile(step: Callable[[], None], steps: int) -> dict[str, float]:
    """Seconds per call of `step` spent in each HLO instruction (exclusive, summed over
    threads), keyed by instruction name; `step` must block until its work is done."""
    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory)
        try:
            for _ in range(steps):
                step()
        finally:
            jax.profiler.stop_trace()
        [path] = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
        data = ProfileData.from_file(path)
    totals: dict[str, float] = collections.defaultdict(float)
    for plane in data.planes:
        for line in plane.lines:
            events = [(event.start_ns, event.end_ns, name) for event in line.events
                      if (name := dict(event.stats).get("hlo_op")) is not None]
            for name, ns in exclusive_times(events).items():
                totals[name] += ns
    return {name: ns * 1e-9 / steps for name, ns in totals.items()}


def exclusive_times(events: list[tuple[float, float, str]]) -> dict[str, float]:
    """Per name, the summed duration of one thread's (start, end, name) events less that of the
    events directly nested in them (a loop's body ops inside the loop's event)."""
    totals: dict[str, float] = collections.defaultdict(float)
    enclosing: list[tuple[float, str]] = []  # (end, name) of the events still open
    for start, end, name in sorted(events, key=lambda event: (event[0], -event[1])):
        while enclosing and enclosing[-1][0] <= start:
            enclosing.pop()
        totals[name] += end - start
        if enclosing:
            totals[enclosing[-1][1]] -= end - start
        enclosing.append((end, name))
    return dict(totals)


def describe(hlo_text: str) -> dict[str, tuple[str, str, str]]:
    """Instruction name → (opcode, JAX primitive, "file:line" of the innermost stack frame
    outside JAX and the standard library, or "")."""
    section, tables = None, {"FileNames": {}, "FunctionNames": {}, "FileLocations": {},
                             "StackFrames": {}}
    ops = {}
    for line in hlo_text.splitlines():
        if line in tables:
            section = line
            continue
        if section and (row := _TABLE.match(line)):
            tables[section][int(row[1])] = row[2]
            continue
        section = None
        if not (instruction := _INSTRUCTION.match(line)):
            continue
        name, rest = instruction[1], instruction[2]
        opcode = (found[1] if (found := _OPCODE.search(rest)) else "?")
        primitive = (re.search(r'op_name="([^"]*)"', rest) or [None, ""])[1].rsplit("/", 1)[-1]
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        ops[name] = (opcode, primitive, _source(tables, int(frame[1])) if frame else "")
    return ops


def _source(tables: dict[str, dict[int, str]], frame_id: int) -> str:
    seen = set()
    while frame_id in tables["StackFrames"] and frame_id not in seen:
        seen.add(frame_id)
        frame = dict((k, int(v)) for k, v in _FIELDS.findall(tables["StackFrames"][frame_id]))
        location = dict((k, int(v)) for k, v in
                        _FIELDS.findall(tables["FileLocations"].get(frame["file_location_id"],
                                                                    "")))
        path = tables["FileNames"].get(location.get("file_name_id"), "").strip('"')
        if path and "/jax/" not in path and "/python3" not in path and "/flax/" not in path:
            return f"{Path(path).name}:{location.get('line')}"
        frame_id = frame.get("parent_frame_id", frame_id)
    return ""


def table(times: dict[str, float], ops: dict[str, tuple[str, str, str]]) -> list[dict]:
    """One row per instruction, most costly first: name, seconds per step, opcode, primitive,
    source. Instructions missing from `ops` (another module's) keep their name only."""
    rows = []
    for name, seconds in sorted(times.items(), key=lambda item: -item[1]):
        opcode, primitive, source = ops.get(name, ("?", "", ""))
        rows.append({"op": name, "seconds": seconds, "opcode": opcode, "primitive": primitive,
                     "source": source})
    return rows


def by_primitive(rows: list[dict]) -> dict[str, float]:
    """Seconds per step per JAX primitive (the instruction's opcode where it has none), most
    costly first."""
    sums: dict[str, float] = collections.defaultdict(float)
    for row in rows:
        sums[row["primitive"] or row["opcode"]] += row["seconds"]
    return dict(sorted(sums.items(), key=lambda item: -item[1]))
