"""A chaos soak: a 2-process job killed at random points, resumed each time, against an
uninterrupted run of the same job.

    python scripts/chaos_soak.py --workdir DIR [--interruptions 10] [--seed 0] [--steps 80]
        [--reference RUN]

Runs the job (`python -m train.launch --processes 2 --devices 2`, a small quickstart model,
`--steps` steps, a checkpoint every 4) once uninterrupted into DIR/reference (or takes RUN, a
finished run of the same job), then into DIR/chaos `--interruptions` times, each time stopped
at a random point of its training (once it has logged a step past the newest one logged so
far, a random 0–4 steps more, two before the end at the latest, and 0–0.05 s): either
one random process is SIGKILLed (the launcher must then end the job with its one line, exit
137) or the launcher is sent SIGTERM (both processes save their step, exit 143). After the last
interruption the job runs to its end. It then checks what a resume promises:

  - every launch was interrupted (not finished first) and ended with its documented status
    and line(s), and no traceback;
  - each step appears once in DIR/chaos/metrics.jsonl, and its losses equal the reference's
    bit for bit;
  - the final parameters equal the reference's bit for bit (both restored here).

Prints one line per launch and a summary line (the figure in docs/runs.md's fault suite); exit
status 0 when every check held, 1 otherwise. `tests/test_multiprocess.py` runs it (slow).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from config.cli import ArgumentParser, positive_int

REPO = Path(__file__).resolve().parents[1]
EVERY = 4


def train_args(steps: int, every: int = EVERY, keep: int = 3) -> list[str]:
    """The job's `python -m train` arguments: `steps` steps, a checkpoint every `every`, the
    newest `keep` kept (tests/test_multiprocess.py trains the same job)."""
    return ["--config", "experiments/quickstart.py", *[
        f"--config.{field}={value}" for field, value in dict(
            steps=steps, checkpoint_every=every, batch_size=8, seq_len=16, log_every=1,
            eval_every=steps, eval_batches=1, sample_tokens=0, keep_checkpoints=keep, **{
                "mesh.data": 4, "model.d_model": 32, "model.num_layers": 2,
                "model.attention.num_heads": 4, "model.attention.num_kv_heads": 2,
                "optimizer.warmup_steps": 2}).items()]]


def launch(workdir: Path, steps: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "train.launch", "--processes", "2", "--devices", "2", "--",
         *train_args(steps), "--workdir", str(workdir)], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def logged_steps(workdir: Path) -> list[int]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()
            if line.endswith("}")]


def interrupt(workdir: Path, steps: int, rng: random.Random) -> tuple[str, int, str, bool]:
    """One launch of the chaos job, stopped at a random point: (what was done, the launcher's
    status, its last line, whether the status and line are the documented ones)."""
    launcher = launch(workdir, steps)
    pids = [int(pid) for pid in re.findall(r"\d+", launcher.stderr.readline().split("pids")[1]
                                            .split(")")[0])]
    # once it has logged a step past the newest logged before (resumed, it relogs those from its
    # checkpoint), a random 0 to EVERY steps more, two before the end at the latest: counted in
    # steps, not seconds, so that the signal lands before the job finishes however fast it trains
    def newest() -> int:
        return (logged_steps(workdir)[-1:] or [0])[0]

    start = newest()
    while newest() <= start and launcher.poll() is None:
        time.sleep(0.01)
    target = min(newest() + rng.randint(0, EVERY), steps - 2)
    while newest() < target and launcher.poll() is None:
        time.sleep(0.01)
    time.sleep(rng.uniform(0, 0.05))
    if rng.random() < 0.5:
        victim = rng.randrange(2)
        action = f"SIGKILL process {victim}"
        subprocess.run(["kill", "-KILL", str(pids[victim])], check=False)
        expected_status = 128 + signal.SIGKILL
        expected = re.compile(rf"error: process {victim} of 2 was killed by SIGKILL"
                              rf"(; stopped process {1 - victim})?$")
    else:
        action = "SIGTERM to the launcher"
        launcher.send_signal(signal.SIGTERM)
        expected_status = 143
        expected = None  # each process's line: "SIGTERM: the checkpoint of step N is saved"
    _, stderr = launcher.communicate(timeout=600)
    last = (stderr.strip().splitlines() or [""])[-1]
    if launcher.returncode == 0:  # it finished before the signal landed: nothing to check
        return f"{action} (too late: the job had finished)", 0, last, False
    if expected is None:
        saved = re.findall(r"SIGTERM: the checkpoint of step (\d+) is saved", stderr)
        last = f"both processes: SIGTERM: the checkpoint of step {saved[0]} is saved" \
            if len(saved) == 2 and saved[0] == saved[1] else last
        shown = last.startswith("both processes")
    else:
        shown = bool(expected.fullmatch(last))
    ok = launcher.returncode == expected_status and shown and "Traceback" not in stderr
    return action, launcher.returncode, last, ok


def _job_differences(a: Path, b: Path) -> str:
    """The top-level config fields that differ between runs `a` and `b`, but for the checkpoint
    cadence (which changes no loss), as one phrase; empty when they train the same job."""
    configs = [json.loads((run / "config.json").read_text()) for run in (a, b)]
    return ", ".join(f"{key} differs" for key in sorted(configs[0].keys() | configs[1].keys())
                     if key not in ("checkpoint_every", "keep_checkpoints")
                     and configs[0].get(key) != configs[1].get(key))


def final_parameters(workdir: Path):
    from train.restore import restore_run

    _, step, state = restore_run(workdir)
    return step, state["params"]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/chaos_soak.py", __doc__)
    parser.add_argument("--workdir", required=True, type=Path,
                        help="DIR/reference and DIR/chaos are (re)made there")
    parser.add_argument("--interruptions", type=positive_int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="of the random points and victims")
    parser.add_argument("--steps", type=positive_int, default=80)
    parser.add_argument("--reference", type=Path,
                        help="a finished uninterrupted run of the same job (its config.json "
                             "equal but for checkpoint_every and keep_checkpoints) to compare "
                             "with, instead of training DIR/reference")
    args = parser.parse_args(argv)
    if args.reference is not None and not (args.reference / "config.json").is_file():
        parser.error(f"--reference={args.reference} holds no config.json; pass a finished run")
    if args.steps < 2 * EVERY:
        parser.error(f"--steps={args.steps} is too few: the job checkpoints every {EVERY} steps; "
                     f"pass at least {2 * EVERY}")
    if args.workdir.exists() and not args.workdir.is_dir():
        parser.error(f"--workdir={args.workdir} is a file; pass a directory")
    rng = random.Random(args.seed)
    reference, chaos = args.reference or args.workdir / "reference", args.workdir / "chaos"
    for directory in {args.workdir / "reference", chaos}:
        shutil.rmtree(directory, ignore_errors=True)
    began = time.monotonic()
    if args.reference is None:
        done = launch(reference, args.steps)
        _, stderr = done.communicate(timeout=1200)
        if done.returncode != 0:
            print(f"error: the uninterrupted run failed: {stderr[-2000:]}", file=sys.stderr)
            return 1
    failures, actions = 0, []
    for number in range(1, args.interruptions + 1):
        action, status, last, ok = interrupt(chaos, args.steps, rng)
        actions.append(action)
        failures += not ok
        print(f"{number:2d}. {action}: exit {status}, at step "
              f"{(logged_steps(chaos)[-1:] or [0])[0]}: {last[:160]}"
              f"{'' if ok else '   <-- NOT as documented'}", flush=True)
    done = launch(chaos, args.steps)
    _, stderr = done.communicate(timeout=1200)
    if done.returncode != 0:
        print(f"error: the final resume failed: {stderr[-2000:]}", file=sys.stderr)
        return 1
    if differs := _job_differences(chaos, reference):
        print(f"error: --reference={reference} is another job ({differs}); pass a run of the "
              f"same job", file=sys.stderr)
        return 2
    import jax
    import numpy as np

    steps = logged_steps(chaos)
    once = steps == list(range(1, args.steps + 1))
    losses = [[json.loads(line)["train_loss"] for line in (d / "metrics.jsonl").open()]
              for d in (chaos, reference)]
    (step_a, params_a), (step_b, params_b) = final_parameters(chaos), final_parameters(reference)
    equal = step_a == step_b == args.steps and all(jax.tree.leaves(jax.tree.map(
        lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), params_a, params_b)))
    kills = sum(action.startswith("SIGKILL") for action in actions)
    ok = failures == 0 and once and losses[0] == losses[1] and equal
    print(f"chaos soak: {args.interruptions} interruptions ({kills} SIGKILL of a process, "
          f"{args.interruptions - kills} SIGTERM to the launcher), {failures} not as documented; "
          f"each of {args.steps} steps logged once: {once}; losses bit-equal: "
          f"{losses[0] == losses[1]}; final parameters bit-equal: {equal}; "
          f"{time.monotonic() - began:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
