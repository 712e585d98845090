"""The collectives of a compiled SPMD program, read from its HLO text (`Compiled.as_text()`).

`collectives(hlo_text, slice_of)` counts, per kind (all-reduce, all-gather, reduce-scatter,
collective-permute, all-to-all), the collectives one device executes in one call of the
program, with their bytes:
- TPU collectives are asynchronous: `all-gather-start` ... `all-gather-done` is one all-gather
  (the `-start` form counts, the `-done` does not).
- The TPU compiler fuses an all-reduce whose result is only sliced to this device's shard into
  an "all-reduce-scatter" fusion (a `kCustom` fusion calling a computation named
  `all-reduce-scatter...`, emitter `...AllReduceScatterFusion`): that is a reduce-scatter, and
  counts as one, `fused` (its all-reduce is not counted as an all-reduce).
- A collective inside a loop body runs once per iteration: each computation's execution count
  is its callers' times the trip count of a `while` whose body it is (the integer constant its
  condition compares the counter with; 1 when there is none).
- `bytes`: the full-size buffer the collective reduces, gathers or sends (all-gather: its
  result; reduce-scatter: its input, the result × group size; all-reduce, collective-permute,
  all-to-all: their operand), summed over executions. `traffic_bytes`: what one device sends
  over the links under a ring algorithm on groups of n: all-reduce 2(n−1)/n × bytes, all-gather,
  reduce-scatter and all-to-all (n−1)/n × bytes, collective-permute 1 × bytes.
- With `slice_of` (each partition id's slice), a collective whose group spans several slices
  goes over DCN, the others over ICI: `ici_traffic_bytes`, `dcn_traffic_bytes`.
- Across TPU slices, the compiled program is one slice's (its partition ids number one slice's
  chips), and the collectives between slices are host transfers to the multislice runtime: a
  `send` whose `_xla_megascale_transfer_type` names the collective (ALL_REDUCE, ...). Each
  such send counts as one collective of that kind over DCN, among the slices.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import re
from collections.abc import Sequence

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) (all-reduce|all-gather|reduce-scatter|collective-permute"
    r"|all-to-all)(-start)?\(")
_MEGASCALE = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) send\(.*"
                        r"_xla_megascale_transfer_type=\"(\w+)\"")
_MEGASCALE_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather",
                    "REDUCE_SCATTER": "reduce-scatter", "ALL_TO_ALL": "all-to-all"}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)="
                     r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _array_bytes(shape_text: str) -> list[int]:
    """Bytes of each array in an HLO shape (a tuple gives several)."""
    return [math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dtype]
            for dtype, dims in _ARRAY.findall(shape_text) if dtype in DTYPE_BYTES]


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """Computation name → its instruction lines; the entry is also under "ENTRY"."""
    bodies, current = {}, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            current = header[1]
            bodies[current] = []
            if line.startswith("ENTRY"):
                bodies["ENTRY"] = bodies[current]
        elif current is not None and line.startswith("}"):
            current = None
        elif current is not None:
            bodies[current].append(line)
    return bodies


def _trip_count(condition: list[str]) -> int:
    """The integer constant a while loop's condition compares its counter with (1 if none)."""
    constants = [int(m) for line in condition
                 for m in re.findall(r"s32\[\][^=]*? constant\((\d+)\)", line)]
    return max(constants) if constants else 1


def execution_counts(bodies: dict[str, list[str]]) -> dict[str, int]:
    """How many times each computation runs in one call of the entry computation."""
    calls = collections.defaultdict(list)  # callee → [(caller, factor)]
    for name, lines in bodies.items():
        if name == "ENTRY":
            continue
        for line in lines:
            callees = dict((kind, callee) for kind, callee in _CALLEE.findall(line))
            factor = 1
            if "body" in callees and "condition" in callees:
                factor = _trip_count(bodies.get(callees["condition"], []))
            for kind, callee in callees.items():
                calls[callee].append((name, factor if kind in ("body", "condition") else 1))
            for branches in _BRANCHES.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", branches):
                    calls[callee].append((name, 1))
    entry = next(name for name, lines in bodies.items()
                 if name != "ENTRY" and lines is bodies["ENTRY"])

    @functools.cache
    def count(name: str) -> int:
        if name == entry:
            return 1
        return sum(count(caller) * factor for caller, factor in calls.get(name, []))

    return {name: count(name) for name in bodies if name != "ENTRY"}


def _groups(line: str, kind: str) -> list[list[int]]:
    """The device groups of a collective (partition ids), or [] when they cannot be read."""
    if kind == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
        return [list(map(int, pair.split(","))) for pair in
                re.findall(r"\{(\d+,\d+)", pairs[1] + "}")] if pairs else []
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if explicit:
        return [list(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", explicit[1])]
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        import numpy as np

        group_shape = [int(d) for d in iota[1].split(",")]
        ids = np.arange(math.prod(int(d) for d in iota[2].split(","))).reshape(
            [int(d) for d in iota[2].split(",")])
        if iota[3]:
            ids = ids.transpose([int(d) for d in iota[3].split(",")])
        return ids.reshape(group_shape[0], -1).tolist()
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:
        import numpy as np

        axes = re.findall(r"'([^']+)'=(\d+)", mesh[1])
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        varying = [names.index(a) for a in re.findall(r"'([^']+)'", mesh[2])]
        fixed = [i for i in range(len(names)) if i not in varying]
        ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(fixed + varying)
        return ids.reshape(math.prod(sizes[i] for i in fixed), -1).tolist()
    return []


def _add_dcn_transfer(report: dict, match: re.Match, runs: int,
                      slice_of: Sequence[int] | None) -> None:
    """One cross-slice collective (a multislice runtime `send`) into `report`."""
    kind = _MEGASCALE_KINDS.get(match[2], "collective-permute")
    size = _array_bytes(match[1])[0]  # (data, context, token): the data sent
    slices = len(set(slice_of)) if slice_of else 2
    share = {"all-reduce": 2 * (slices - 1) / slices,
             "collective-permute": 1.0}.get(kind, (slices - 1) / slices)
    entry = report[kind]
    entry["count"] += runs
    entry["bytes"] += runs * size
    traffic = round(runs * size * share)
    entry["traffic_bytes"] += traffic
    entry["dcn_traffic_bytes"] += traffic
    entry["largest"].append((size, re.sub(r"\{[^}]*\}|/\*[^*]*\*/", "", match[1])))


def collectives(hlo_text: str, slice_of: Sequence[int] | None = None) -> dict[str, dict]:
    """Per kind: {"count", "bytes", "traffic_bytes", "ici_traffic_bytes", "dcn_traffic_bytes",
    "fused"} for one device and one call of the program (see the module docstring), and
    "largest": [(bytes, shape)] of its five largest single collectives."""
    bodies = _computations(hlo_text)
    counts = execution_counts(bodies)
    report = {kind: {"count": 0, "bytes": 0, "traffic_bytes": 0, "ici_traffic_bytes": 0,
                     "dcn_traffic_bytes": 0, "fused": 0, "largest": []} for kind in KINDS}
    for name, lines in bodies.items():
        if name == "ENTRY" or not counts.get(name):
            continue
        fused_scatter = name.startswith("all-reduce-scatter")
        for line in lines:
            match = _INSTRUCTION.match(line)
            if not match:
                dcn = _MEGASCALE.match(line)
                if dcn:
                    _add_dcn_transfer(report, dcn, counts[name], slice_of)
                continue
            kind, is_start = match[3], bool(match[4])
            arrays = _array_bytes(match[2])
            if is_start and kind in ("all-gather", "collective-permute"):
                # (operand, result[, contexts]): the gathered result, the permuted operand
                size = max(arrays) if kind == "all-gather" else arrays[0]
            else:
                size = sum(arrays)
            groups = _groups(line, kind)
            group_size = (2 if kind == "collective-permute" else
                          len(groups[0]) if groups else 1)
            if kind == "reduce-scatter":
                size *= group_size
            if fused_scatter and kind == "all-reduce":
                kind = "reduce-scatter"
            share = {"all-reduce": 2 * (group_size - 1) / group_size,
                     "collective-permute": 1.0}.get(kind, (group_size - 1) / group_size)
            runs = counts[name]
            entry = report[kind]
            entry["count"] += runs
            entry["fused"] += runs if fused_scatter else 0
            entry["bytes"] += runs * size
            traffic = round(runs * size * share)
            entry["traffic_bytes"] += traffic
            crosses = slice_of is not None and any(
                len({slice_of[i] for i in group}) > 1 for group in groups)
            entry["dcn_traffic_bytes" if crosses else "ici_traffic_bytes"] += traffic
            entry["largest"].append((size, re.sub(r"\{[^}]*\}|/\*[^*]*\*/", "", match[2])))
    for entry in report.values():
        entry["largest"] = [list(item) for item in
                            itertools.islice(sorted(entry["largest"], reverse=True), 5)]
    return report


_PARAMETER = re.compile(r"=\s*([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?\s+parameter\(")


def entry_parameter_bytes(hlo_text: str) -> tuple[int, int]:
    """(logical, padded) bytes of the entry computation's parameters on one device: the arrays'
    element bytes, and with each array's minor dimensions padded to its layout's first tile
    (`T(8,128)` pads the two most-minor dimensions to multiples of 8 and 128), as the TPU
    allocates them."""
    bodies = _computations(hlo_text)
    logical = padded = 0
    for line in bodies.get("ENTRY", []):
        match = _PARAMETER.search(line)
        if not match or match[1] not in DTYPE_BYTES:
            continue
        dims = [int(d) for d in match[2].split(",") if d]
        itemsize = DTYPE_BYTES[match[1]]
        logical += math.prod(dims) * itemsize
        layout = match[3] or ""
        minor_to_major = re.match(r"\{([\d,]*)", layout)
        tile = re.search(r"T\(([\d,]+)\)", layout)
        physical = dims
        if minor_to_major and minor_to_major[1]:
            physical = [dims[i] for i in reversed([int(i) for i in minor_to_major[1].split(",")])]
        if tile:
            sizes = [int(t) for t in tile[1].split(",")]
            physical = list(physical) or [1]
            for offset, size in enumerate(reversed(sizes), start=1):
                if offset <= len(physical):
                    physical[-offset] = -(-physical[-offset] // size) * size
                elif size > 1:
                    physical = [size] + physical
        padded += math.prod(physical) * itemsize
    return logical, padded
