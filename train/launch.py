"""`python -m train.launch --processes N [--devices D] [--port P] -- TRAIN ARGS...`

Runs one training job as N JAX processes on this machine, as a pod or a cluster runs one per
host: each is `python -m train TRAIN ARGS...` with the coordinator on localhost
(`JAX_COORDINATOR_ADDRESS`, a free port unless `--port`), its process id and count
(`BLOCKBENCH_PROCESS_ID`, `BLOCKBENCH_NUM_PROCESSES`, read by `sharding.mesh.
maybe_initialize_distributed`) and, with `--devices`, D simulated CPU devices
(`JAX_NUM_CPU_DEVICES`); on the CPU the processes' collectives go over gloo. The trainer's code
is the one a pod runs: only where the processes come from differs (docs/pods.md).

The launcher first prints the processes' pids on stderr; each line a process writes is prefixed
with `[pI] ` on the launcher's stdout or stderr. SIGTERM and SIGINT are forwarded to every
process (each saves a checkpoint and exits; the processes run in their own session, so a
terminal's Ctrl-C reaches them once, through here). When a process fails (an exit status other
than 0, 130 or 143, or a signal), the launcher kills the others at once, since they cannot finish
a collective without it, and stops showing their output (their errors would only follow from
it); it prints one line naming the process and how it ended, and exits with its status (128 +
the signal for a process killed by one). Exit status: the processes' (0 when all finished), 2
for bad launcher arguments.

A job started without this launcher (an srun step, a TPU pod) is watched from within: each
`python -m train` runs the training as its child (`supervise`), and turns the coordination
service's end of the survivors of a dead process (an abort with a C++ trace) into one line
naming that process, exit status 4 (docs/pods.md).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from config.cli import ArgumentParser, positive_int
from sharding.environment import multiprocess_launch

POLL_S = 0.05


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def process_environment(environ: dict[str, str], index: int, count: int, port: int,
                        devices: int | None) -> dict[str, str]:
    """The environment of process `index` of `count` with the coordinator at localhost:`port`."""
    env = dict(environ, JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
               BLOCKBENCH_NUM_PROCESSES=str(count), BLOCKBENCH_PROCESS_ID=str(index),
               PYTHONUNBUFFERED="1")
    if devices is not None:
        env["JAX_NUM_CPU_DEVICES"] = str(devices)
    return env


_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")


def _copy_prefixed(stream, out, prefix: bytes, lock: threading.Lock,
                   muted: threading.Event) -> None:
    """Copy `stream` to `out` line by line (a progress bar's \\r-ended updates are lines),
    each with `prefix`, until `muted` is set."""
    pending = b""
    for chunk in iter(lambda: stream.read1(65536), b""):
        pending += chunk
        lines = _LINE.findall(pending)
        complete = [line for line in lines if line.endswith((b"\n", b"\r"))]
        pending = pending[sum(map(len, complete)):]
        with lock:
            if not muted.is_set():
                out.writelines(prefix + line for line in complete)
                out.flush()
    with lock:
        if pending and not muted.is_set():
            out.write(prefix + pending + b"\n")
            out.flush()


def describe_exit(status: int) -> str:
    """How a process ended, from its `Popen.returncode`."""
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def shell_status(status: int) -> int:
    """A `Popen.returncode` as a shell reports it (128 + the signal for a killed process)."""
    return 128 - status if status < 0 else status


def launch(train_args: list[str], processes: int, devices: int | None = None,
           port: int | None = None) -> int:
    """Run `python -m train TRAIN_ARGS` as `processes` processes; the exit status (module
    docstring)."""
    port = port or free_port()
    children = [subprocess.Popen(
        [sys.executable, "-m", "train", *train_args],
        env=process_environment(dict(os.environ), index, processes, port, devices),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        for index in range(processes)]
    print(f"launched {processes} processes (pids {', '.join(str(c.pid) for c in children)}), "
          f"coordinator localhost:{port}", file=sys.stderr, flush=True)
    lock = threading.Lock()
    muted = [threading.Event() for _ in children]
    copiers = [threading.Thread(target=_copy_prefixed, args=(
        getattr(child, name), getattr(sys, name).buffer, f"[p{index}] ".encode(), lock,
        muted[index]), daemon=True)
        for index, child in enumerate(children) for name in ("stdout", "stderr")]
    for copier in copiers:
        copier.start()

    def forward(signum, frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM,
                                                                        signal.SIGINT)}
    try:
        failed = _wait(children)
        if failed is not None:  # the others' errors now only follow from it: not shown
            for index, child in enumerate(children):
                if index != failed[0]:
                    muted[index].set()
                    if child.poll() is None:
                        child.kill()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
        for copier in copiers:
            copier.join(timeout=5)
    if failed is not None:
        index, status = failed
        stopped = [i for i, child in enumerate(children)  # killed here, or left on losing it
                   if i != index and child.returncode in (-signal.SIGKILL, 4)]
        others = (f"; stopped process{'es' if len(stopped) > 1 else ''} "
                  f"{', '.join(map(str, stopped))}" if stopped else "")
        print(f"error: process {index} of {processes} {describe_exit(status)}{others}",
              file=sys.stderr, flush=True)
        return shell_status(status)
    return shell_status(children[0].returncode)


def _wait(children: list[subprocess.Popen]) -> tuple[int, int] | None:
    """Wait until every child ended, or one failed: (index, status) of the first that failed;
    None when all exited 0 or with the status of an interrupt they were sent (130, 143)."""
    while True:
        statuses = [child.poll() for child in children]
        failures = [(i, s) for i, s in enumerate(statuses) if s not in (None, 0, 130, 143)]
        if failures:  # a process that lost another (4) only follows from that one's failure
            return min(failures, key=lambda failure: failure[1] == 4)
        if all(status is not None for status in statuses):
            return None
        time.sleep(POLL_S)


def tcp_port(text: str) -> int:
    """An argparse `type` for a TCP port, 1..65535."""
    port = positive_int(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"{port} is invalid: a TCP port is 1..65535")
    return port


def port_in_use(port: int) -> str | None:
    """Why the coordinator cannot listen on localhost:`port` (the system's words), or None."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError as error:
            return error.strerror or str(error)
    return None


def main(argv: list[str]) -> int:
    parser = ArgumentParser("python -m train.launch", __doc__)
    parser.add_argument("--processes", type=positive_int, required=True, metavar="N",
                        help="the number of JAX processes to run")
    parser.add_argument("--devices", type=positive_int, metavar="D",
                        help="simulated CPU devices per process (JAX_NUM_CPU_DEVICES)")
    parser.add_argument("--port", type=tcp_port, metavar="P",
                        help="the coordinator's port on localhost (default: a free one)")
    parser.add_argument("train_args", nargs="*", metavar="TRAIN ARGS",
                        help="after --: the arguments of python -m train")
    args = parser.parse_args(argv[1:])
    if not args.train_args:
        parser.error("the training arguments are missing, e.g. -- --config "
                     "experiments/quickstart.py --workdir runs/quickstart")
    if args.port is not None and (problem := port_in_use(args.port)):
        parser.error(f"--port={args.port} is invalid: the coordinator cannot listen on it "
                     f"({problem}; another job's coordinator?); pass another --port, or leave "
                     "it out to use a free one")
    return launch(args.train_args, args.processes, args.devices, args.port)


if __name__ == "__main__":
    sys.exit(main(sys.argv))


# ---------------------------------------------------------------------------------------------
# One process of a job started without this launcher (srun, a TPU pod, mpirun)

SUPERVISED = "BLOCKBENCH_SUPERVISED"
# A line of the C++ runtime's log (absl): severity, date, time, thread, file:line].
_NATIVE_LOG = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]]+\] ")
_UNHEALTHY = re.compile(r"stopped sending heartbeats\):\s*((?:(?:/job:\S+?/task:)?\d+[,\s]*)+)")
_LEADER_GONE = re.compile(r"Failed to send RPC to coordination service|Socket closed|"
                          r"Connection refused|failed to connect", re.I)


def needs_supervisor(environ: dict[str, str]) -> bool:
    """Whether `python -m train` runs as one process of a job that no `train.launch` watches (an
    srun step, a TPU pod, mpirun), and is not already the supervised child."""
    return (multiprocess_launch(environ) and "BLOCKBENCH_PROCESS_ID" not in environ
            and environ.get(SUPERVISED) != "1")


def own_rank(environ: dict[str, str]) -> tuple[str, str]:
    """(this process's index, the process count) as the environment names them, "?" if not."""
    for index, count in (("SLURM_PROCID", "SLURM_NTASKS"),
                         ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if index in environ:
            return environ[index], environ.get(count, "?")
    if "TPU_WORKER_ID" in environ:
        return environ["TPU_WORKER_ID"], str(len(environ.get("TPU_WORKER_HOSTNAMES",
                                                               "").split(",")))
    return "?", "?"


def dead_processes(native_log: str) -> str | None:
    """Which process died, from the coordination service's last words: the tasks it found
    unhealthy, or process 0 (it runs the service) when the service is unreachable."""
    if match := _UNHEALTHY.search(native_log):
        ids = re.findall(r"task:(\d+)" if "task:" in match[1] else r"\d+", match[1])
        return f"process{'es' if len(ids) > 1 else ''} {', '.join(ids)}"
    if _LEADER_GONE.search(native_log):
        return "process 0 (which runs the job's coordination service)"
    return None


def _die_with_parent() -> None:
    """In the child, before it runs: SIGKILL it when its parent (the supervisor) dies, so a
    SIGKILL of the process that srun started kills the training too (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def supervise(argv: list[str]) -> int:
    """Run `python -m train ARGV` as a child and watch it, for a process of a job no launcher
    watches. When another process of the job dies, JAX's coordination service ends this one
    (within `BLOCKBENCH_HEARTBEAT_SECONDS`) with an abort and a C++ stack trace; here that is
    one line naming the dead process, and exit status 4. The child's output passes through,
    less the C++ runtime's log once it reports an error (the job is ending); SIGTERM and SIGINT
    are forwarded."""
    env = dict(os.environ, **{SUPERVISED: "1", "PYTHONUNBUFFERED": "1"})
    child = subprocess.Popen([sys.executable, "-m", "train", *argv[1:]], env=env,
                             stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
    native: list[bytes] = []

    def copy() -> None:
        muted = False
        for line in iter(child.stderr.readline, b""):
            if _NATIVE_LOG.match(line):
                muted = muted or line[:1] in (b"E", b"F")
                native.append(line)
                continue
            if muted or line.startswith((b"Additional GRPC", b":UNKNOWN:", b"*** ")):
                native.append(line)
                continue
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()

    copier = threading.Thread(target=copy, daemon=True)
    copier.start()

    def forward(signum, frame):
        if child.poll() is None:
            child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM,
                                                                        signal.SIGINT)}
    try:
        status = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if child.poll() is None:
            child.kill()
            child.wait()
    copier.join(timeout=5)
    if status in (0, 1, 2, 3, 130, 143):
        return status
    index, count = own_rank(os.environ)
    dead = dead_processes(b"".join(native).decode(errors="replace"))
    if dead is None and status != 4 and native == []:
        print(f"error: process {index} of {count} {describe_exit(status)}", file=sys.stderr,
              flush=True)
        return shell_status(status)
    print(f"error: process {index} of {count} lost {dead or 'another process'} of this job; "
          "rerun the job (the same command on every host) to resume from its newest checkpoint",
          file=sys.stderr, flush=True)
    return 4
