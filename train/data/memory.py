"""The memory-bound demonstration: a training run's peak RSS as its dataset grows, streamed from
prepared shards against the in-memory pipeline (the command line: scripts/data_memory.py).

For each scale k it writes the embedded corpus k times over as a .jsonl file (k × 4.1 MB of
text), prepares it into byte-token shards (`train.data.preparation.prepare`; kept between runs),
then trains the quickstart model for --steps steps in a fresh process twice: from the shards
(``data.name=prepared``) and from the .jsonl file read into memory (``data.name=text``). It
prints one JSON line per run (scale, dataset tokens and bytes on disk, the process's peak
resident set from ``wait4``, its exit status) and writes them all to OUT/data_memory.json.
Streaming keeps the peak flat whatever the scale; the in-memory run's grows with it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from train.data.preparation import prepare
from train.data.sources import SourceReport, read_documents

QUICKSTART = "experiments/quickstart.py"


def write_corpus(path: Path, scale: int) -> None:
    """The embedded corpus's chapters, ``scale`` times over, one JSON record per line."""
    if path.exists():
        return
    chapters = [json.dumps({"text": d.text}) for d in read_documents("kjv", SourceReport())]
    temporary = path.with_suffix(".tmp")
    with temporary.open("w") as f:
        for _ in range(scale):
            f.write("\n".join(chapters) + "\n")
    os.replace(temporary, path)


def train_peak_rss(overrides: list[str], workdir: Path, steps: int) -> tuple[int, int]:
    """(exit status, peak RSS in bytes) of `python -m train` on the quickstart config."""
    shutil.rmtree(workdir, ignore_errors=True)
    command = [sys.executable, "-m", "train", "--config", QUICKSTART, "--workdir", str(workdir),
               f"--config.steps={steps}", f"--config.eval_every={steps}",
               f"--config.checkpoint_every={steps}", "--config.sample_tokens=0",
               "--config.eval_batches=2", f"--config.optimizer.warmup_steps={steps // 2}",
               *overrides]
    log = workdir.with_name(f"{workdir.name}.log")
    with log.open("wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = exit_status = os.waitstatus_to_exitcode(status)
    if exit_status:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        print(f"training failed ({exit_status}): {' | '.join(tail)}", file=sys.stderr)
    return exit_status, usage.ru_maxrss * 1024  # Linux reports kilobytes


def run(out: str | Path, scales: list[int], steps: int, workers: int) -> int:
    """The demonstration (module docstring) into the directory `out`: one JSON line per run on
    stdout, all of them in OUT/data_memory.json. Returns 0, or 1 if a training run failed. The
    command line: scripts/data_memory.py."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for scale in scales:
        corpus, shards = out / f"kjv-x{scale}.jsonl", out / f"kjv-x{scale}"
        write_corpus(corpus, scale)
        metadata = prepare(str(corpus), "byte", shards, workers=workers,
                           docs_per_shard=4096, progress=False)
        tokens = sum(info["tokens"] for info in metadata["splits"].values())
        disk = sum(f.stat().st_size for f in shards.iterdir())
        for mode, overrides in (
                ("prepared", ["--config.data.name=prepared", f"--config.data.path={shards}"]),
                ("in_memory", ["--config.data.name=text", f"--config.data.path={corpus}"])):
            status, peak = train_peak_rss(overrides, out / "run", steps)
            result = {"scale": scale, "mode": mode, "dataset_tokens": tokens,
                      "shard_bytes": disk, "corpus_bytes": corpus.stat().st_size,
                      "peak_rss_bytes": peak, "exit_status": status}
            print(json.dumps(result), flush=True)
            results.append(result)
    (out / "data_memory.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["exit_status"] == 0 for r in results) else 1
