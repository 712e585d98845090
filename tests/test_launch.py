"""Launching: the dry run, multi-process detection, per-process batch rows, multi-slice (DCN)
meshes, and the TPU-pod and SLURM launch scripts (run against fake gcloud/srun commands)."""

import json
import os
import shlex
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from config import ConfigError, resolve
from config.mesh_shape import MESH_AXES, ici_dcn_shapes
from sharding.environment import multiprocess_launch
from sharding.mesh import AUTO_AXES, hybrid_device_grid
from sharding.rules import logical_to_spec, named_sharding
from tests.helpers import one_device_env, tiny_config
from train.data.in_memory import Dataset
from train.step import rows_held

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "experiments" / "quickstart.py")


def run_script(*args: str) -> subprocess.CompletedProcess:
    """A script of this checkout in a fresh interpreter, without conftest's 8 simulated devices."""
    env = one_device_env("JAX_PLATFORMS")
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([*args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def sizes(**axes) -> dict[str, int]:
    return {axis: axes.get(axis, 1) for axis in MESH_AXES}


# --- the dry run ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_dry_run_json_for_a_simulated_fsdp4_tensor2_mesh():
    done = run_script(sys.executable, "scripts/dry_run.py", "--config", QUICKSTART,
                      "--devices", "8", "--mesh", "data=1,fsdp=4,tensor=2", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    mesh = sizes(fsdp=4, tensor=2)
    assert report["devices"] == 8 and report["mesh"] == mesh and report["slices"] == 1
    parameters = {p["path"]: p for p in report["parameters"]}
    # Named parameters (quickstart: 4 layers, d=192, 6 heads of 32, vocabulary 256).
    query = parameters["blocks/attention/query/kernel"]
    assert query["logical"] == ["layers", "embed", "heads", "head_dim"]
    assert query["spec"] == [None, "fsdp", "tensor", None]
    assert query["shape"] == [4, 192, 6, 32] and query["device_shape"] == [4, 48, 3, 32]
    assert query["device_bytes"] == 4 * 192 * 6 * 32 * 4 // 8  # fully sharded over 8 devices
    assert parameters["embed/embedding"]["spec"] == ["tensor", "fsdp"]
    assert parameters["final_norm/scale"]["spec"] == [None]  # replicated
    assert parameters["final_norm/scale"]["device_bytes"] == 192 * 4
    for parameter in parameters.values():  # every spec is the rule table's
        expected = logical_to_spec(parameter["logical"], parameter["shape"], mesh)
        assert parameter["spec"] == [list(e) if isinstance(e, tuple) else e for e in expected]
    assert report["parameter_bytes"] == sum(p["device_bytes"] for p in parameters.values())
    assert report["parameter_bytes_total"] == 4 * sum(np.prod(p["shape"])
                                                      for p in parameters.values())
    for key in ("parameter_bytes", "optimizer_bytes", "temp_bytes"):
        assert report[key] > 0, key
    # The compiled step's per-device arguments are exactly the state and batch shards counted
    # without devices (+ 4 bytes: the int32 step counter).
    assert report["argument_bytes"] == (report["parameter_bytes"] + report["optimizer_bytes"]
                                        + report["model_state_bytes"] + report["batch_bytes"] + 4)
    assert report["peak_bytes"] == (report["argument_bytes"] + report["output_bytes"]
                                    - report["alias_bytes"] + report["temp_bytes"])


@pytest.mark.slow
def test_dry_run_table_and_one_line_errors():
    done = run_script(sys.executable, "scripts/dry_run.py", "--config", QUICKSTART, "--devices",
                      "64", "--mesh", "data=4,fsdp=16", "--config.mesh.dcn.data=4",
                      "--config.batch_size=64", "--no_compile")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("mesh: data=4 fsdp=16 tensor=1")
    assert lines[0].endswith("(64 devices, 4 slices)")
    assert lines[1].split() == ["within", "a", "slice", "(ICI):", "data=1", "fsdp=16", "tensor=1",
                                "sequence=1", "stage=1", "expert=1"]
    assert lines[2].split()[3:5] == ["data=4", "fsdp=1"]  # across slices (DCN)
    query = next(line for line in lines if line.startswith("blocks/attention/query/kernel"))
    assert "P(None, fsdp, None, None)" in query and "(4, 12, 6, 32)" in query
    assert "train-step temporaries" not in done.stdout  # --no_compile

    done = run_script(sys.executable, "scripts/dry_run.py", "--config", QUICKSTART,
                      "--devices", "8", "--mesh", "data=2,fsdp=2")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: mesh=data=2×fsdp=2 is invalid: its product 4 ≠ the 8 devices; make the axes "
        "multiply to 8 or set one to -1"]


# --- multi-process detection and per-process rows ------------------------------------------------

SRUN_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[007-008]", "SLURM_NTASKS": "2",
             "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}


def test_multiprocess_launch_detects_srun_steps_not_batch_shells(monkeypatch):
    batch_shell = {k: v for k, v in SRUN_STEP.items() if k != "SLURM_STEP_NODELIST"}
    assert multiprocess_launch(SRUN_STEP)
    assert not multiprocess_launch(batch_shell | {"SLURM_NTASKS": "4"})  # sbatch, no srun
    assert not multiprocess_launch(SRUN_STEP | {"SLURM_NTASKS": "1"})  # one task: one process
    assert not multiprocess_launch({})
    assert multiprocess_launch({"BLOCKBENCH_MULTIPROCESS": "1"})  # scripts/launch_tpu_pod.sh
    assert multiprocess_launch({"OMPI_COMM_WORLD_SIZE": "2"})
    assert multiprocess_launch({"TPU_WORKER_HOSTNAMES": "w0,w1"})
    assert not multiprocess_launch({"TPU_WORKER_HOSTNAMES": "w0"})
    # In the srun step, jax.distributed.initialize() finds everything it needs in SLURM's vars.
    from jax._src.clusters import SlurmCluster

    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    for name, value in SRUN_STEP.items():
        monkeypatch.setenv(name, value)
    assert SlurmCluster.is_env_present()
    port = 4242 % 2**12 + 65535 - 2**12 + 1
    assert SlurmCluster.get_coordinator_address(None, None) == f"gpu007:{port}"
    assert (SlurmCluster.get_process_count(), SlurmCluster.get_process_id()) == (2, 1)
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    assert not SlurmCluster.is_env_present()  # why a batch shell must not initialize


def check_process_rows(sharding, devices_by_process, batch=8, seq_len=16) -> list[list[int]]:
    """Each simulated process loads its rows alone; check they are what its devices hold, in the
    order `jax.make_array_from_process_local_data` reads them (each distinct shard's rows at the
    position of its first row among the process's rows). Returns the rows per process."""
    dataset = Dataset(tokens=(np.arange(4000) % 251).astype(np.uint8), name="synthetic")
    full = dataset.batch(3, batch, seq_len, seed=0)
    index_map = sharding.devices_indices_map(full.shape)
    all_rows = []
    for owned in devices_by_process:
        rows = rows_held(sharding, full.shape, owned)
        local = dataset.batch(3, batch, seq_len, seed=0, rows=rows)
        for device in owned:
            held = index_map[device][0]
            start, stop, _ = held.indices(batch)
            at = int(np.searchsorted(rows, start))
            np.testing.assert_array_equal(local[at:at + stop - start], full[held])
        all_rows.append(rows.tolist())
    assert sorted(set().union(*all_rows)) == list(range(batch))  # every row loaded somewhere
    return all_rows


@pytest.mark.parametrize("axes, processes, expected", [
    (dict(data=8), 2, [range(0, 4), range(4, 8)]),
    (dict(data=8), 4, [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
    (dict(data=2, fsdp=2, tensor=2), 2, [range(0, 4), range(4, 8)]),
    (dict(tensor=8), 2, [range(0, 8), range(0, 8)]),  # tensor parallelism across both: all rows
    (dict(data=2, tensor=4), 4, [range(0, 4), range(0, 4), range(4, 8), range(4, 8)]),
], ids=str)
def test_each_simulated_process_loads_exactly_its_devices_rows(axes, processes, expected):
    """Process p owns devices [p·8/P, (p+1)·8/P) (device order of a multi-process launch)."""
    mesh = jax.make_mesh(tuple(sizes(**axes)[a] for a in MESH_AXES), MESH_AXES,
                         axis_types=AUTO_AXES)
    sharding = named_sharding(mesh, ("act_batch", None), (8, 17))
    devices = np.array(jax.devices()).reshape(processes, -1)
    assert check_process_rows(sharding, devices) == [list(r) for r in expected]
    assert rows_held(sharding, (8, 17), jax.devices()).tolist() == list(range(8))  # one process


def test_rows_of_a_mesh_interleaving_processes_along_the_batch():
    devices = np.array(jax.devices())
    order = devices[[0, 4, 1, 5, 2, 6, 3, 7]].reshape(8, 1, 1, 1, 1, 1)
    sharding = named_sharding(jax.sharding.Mesh(order, MESH_AXES), ("act_batch", None), (8, 17))
    rows = check_process_rows(sharding, devices.reshape(2, 4))
    assert rows == [[0, 2, 4, 6], [1, 3, 5, 7]]


# --- multi-slice (ICI × DCN) meshes --------------------------------------------------------------

def test_dcn_factoring_and_its_errors():
    total = sizes(data=4, fsdp=8, tensor=2)
    ici, dcn = ici_dcn_shapes({"dcn": {"data": 2, "fsdp": 2}}, total, slices=4)
    assert ici == sizes(data=2, fsdp=4, tensor=2) and dcn == sizes(data=2, fsdp=2)
    assert all(ici[a] * dcn[a] == total[a] for a in MESH_AXES)
    assert ici_dcn_shapes({}, total, slices=1) == (total, sizes())  # no dcn section: one slice
    errors = [
        ({"data": 3}, 3, "mesh.dcn.data=3 is invalid: it does not divide mesh.data=4 (mesh.data "
                         "is the axis's total size, ICI × DCN); make mesh.data a multiple of 3"),
        ({"data": 2}, 4, "mesh.dcn=data=2 is invalid: its product 2 ≠ the 4 slices the devices "
                         "span; make the mesh.dcn sizes multiply to 4 (usually mesh.dcn.data=4)"),
        ({}, 2, "mesh.dcn=1 is invalid: its product 1 ≠ the 2 slices the devices span; make the "
                "mesh.dcn sizes multiply to 2 (usually mesh.dcn.data=2)"),
        ({"data": 0}, 1, "mesh.dcn.data=0 is invalid: use a positive number of slices"),
        ({"pipeline": 2}, 2, "mesh.dcn.pipeline is not a mesh axis"),
    ]
    for dcn_cfg, slices, message in errors:
        with pytest.raises(ConfigError) as raised:
            ici_dcn_shapes({"dcn": dcn_cfg}, total, slices)
        assert str(raised.value).startswith(message), str(raised.value)
    # On one slice (CPU devices have no slice_index) a DCN factor is refused when resolving.
    config = tiny_config()
    config.mesh.update(data=8, dcn={"data": 2})
    with pytest.raises(ConfigError, match=r"mesh.dcn=data=2 is invalid: .* ≠ the 1 slice "):
        resolve(config, 8)


def test_hybrid_grid_keeps_each_slice_in_one_dcn_block():
    fake = [types.SimpleNamespace(id=i, slice_index=i // 4, platform="cpu", device_kind="fake",
                                  process_index=i // 2) for i in range(8)]  # 2 slices of 4
    grid = hybrid_device_grid(sizes(fsdp=4), sizes(data=2), fake)
    slice_of = np.vectorize(lambda d: d.slice_index)(grid)
    assert grid.shape == (2, 4, 1, 1, 1, 1)
    assert (slice_of[0] == 0).all() and (slice_of[1] == 1).all()  # data crosses slices
    grid = hybrid_device_grid(sizes(data=2, fsdp=2), sizes(fsdp=2), fake)
    slice_of = np.vectorize(lambda d: d.slice_index)(grid)
    assert grid.shape == (2, 4, 1, 1, 1, 1)
    assert (slice_of[:, :2] == 0).all() and (slice_of[:, 2:] == 1).all()  # fsdp blocks by slice
    assert sorted(d.id for d in grid.flat) == list(range(8))


# --- the launch scripts --------------------------------------------------------------------------

def fake_command(directory: Path, name: str, exit_status: int = 0) -> Path:
    """An executable `name` that appends its argv (and JAX_LOCAL_DEVICE_IDS,
    BLOCKBENCH_MULTIPROCESS) as one JSON line to directory/calls.jsonl."""
    path = directory / name
    path.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"record = dict(argv=sys.argv[1:], cwd=os.getcwd(), **{{k: os.environ.get(k) for k in "
        f"('JAX_LOCAL_DEVICE_IDS', 'BLOCKBENCH_MULTIPROCESS')}})\n"
        f"open({str(directory / 'calls.jsonl')!r}, 'a').write(json.dumps(dict(command="
        f"{name!r}, **record)) + '\\n')\nsys.exit({exit_status})\n")
    path.chmod(0o755)
    return path


def calls(directory: Path) -> list[dict]:
    path = directory / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_shell_scripts_parse():
    for script in ("launch_tpu_pod.sh", "slurm_train.sbatch"):
        done = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_tpu_pod_launcher_dry_print_runs_train_on_all_workers(tmp_path):
    launcher = str(ROOT / "scripts" / "launch_tpu_pod.sh")
    common = ["--tpu", "my-v4-32", "--zone", "us-central2-b", "--config",
              "experiments/quickstart.py", "--workdir", "/mnt/shared/runs/q", "--dry_print"]
    done = subprocess.run(["bash", launcher, *common, "--project", "lab", "--",
                           "--config.mesh.fsdp=16", "--config.sample_prompt=And God's"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    archive, scp, ssh = done.stdout.splitlines()
    assert "git ls-files -z --cached --others --exclude-standard" in archive
    assert scp.startswith("gcloud compute tpus tpu-vm scp /tmp/blockbench-code-")
    assert scp.endswith("--zone us-central2-b --project lab --worker=all")
    assert ssh.startswith("gcloud compute tpus tpu-vm ssh my-v4-32 --zone us-central2-b "
                          "--project lab --worker=all --command ")
    remote = shlex.split(ssh)[-1]
    assert 'python3 -m pip install -q -e . "jax[tpu]" && BLOCKBENCH_MULTIPROCESS=1 python3 -m ' \
           "train --config experiments/quickstart.py --workdir /mnt/shared/runs/q " \
           "--config.mesh.fsdp=16 --config.sample_prompt=And" in remote

    # Clone mode, two slices, no install: run the printed commands against fake gcloud, git and
    # python3; the remote command, run by a shell, must start exactly this training command.
    fakes = tmp_path / "bin"
    fakes.mkdir()
    for name in ("gcloud", "git", "python3"):
        fake_command(fakes, name)
    code_dir = tmp_path / "code"
    (code_dir / ".git").mkdir(parents=True)  # an existing clone: fetch, then checkout
    done = subprocess.run(["bash", launcher, *common, "--tpu", "slice-0,slice-1", "--repo",
                           "https://example.org/blockbench.git", "--ref", "v1", "--dir",
                           str(code_dir), "--no_install", "--", "--config.sample_prompt=And God's"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    env = dict(os.environ, PATH=f"{fakes}:{os.environ['PATH']}")
    for line in done.stdout.splitlines():
        subprocess.run(["bash", "-c", line], env=env, check=True)
    ssh_calls = calls(fakes)
    assert [c["argv"][:5] for c in ssh_calls] == [
        ["compute", "tpus", "tpu-vm", "ssh", "slice-0"], ["compute", "tpus", "tpu-vm", "ssh",
                                                          "slice-1"]]
    (fakes / "calls.jsonl").unlink()
    subprocess.run(["bash", "-c", ssh_calls[0]["argv"][-1]], env=env, check=True)
    git_fetch, git_checkout, train = calls(fakes)
    assert git_fetch["argv"] == ["-C", str(code_dir), "fetch", "origin", "v1"]
    assert git_checkout["argv"] == ["-C", str(code_dir), "checkout", "--force", "FETCH_HEAD"]
    assert train["argv"] == ["-m", "train", "--config", "experiments/quickstart.py", "--workdir",
                             "/mnt/shared/runs/q", "--config.sample_prompt=And God's"]
    assert train["cwd"] == str(code_dir) and train["BLOCKBENCH_MULTIPROCESS"] == "1"

    done = subprocess.run(["bash", launcher, "--zone", "z", "--config", "x.py", "--workdir", "w"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr == "error: --tpu is required, e.g. --tpu my-v4-32\n"


def test_slurm_script_runs_one_task_per_node_and_requeues_when_preempted(tmp_path):
    fake_command(tmp_path, "srun", exit_status=143)  # the trainer saved and exited on SIGTERM
    fake_command(tmp_path, "scontrol")
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", SLURM_GPUS_ON_NODE="4",
               SLURM_JOB_ID="77")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_train.sbatch"),
                           "experiments/quickstart.py", "/shared/runs/q", "--config.steps=2"],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 143, done.stderr
    srun, scontrol = calls(tmp_path)
    assert srun["argv"] == ["--kill-on-bad-exit=1", "python", "-m", "train", "--config",
                            "experiments/quickstart.py", "--workdir", "/shared/runs/q",
                            "--config.steps=2"]
    assert srun["JAX_LOCAL_DEVICE_IDS"] == "0,1,2,3"  # each process sees its node's 4 GPUs
    assert scontrol["argv"] == ["requeue", "77"]
    header = (ROOT / "scripts" / "slurm_train.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1\n" in header


def test_the_dead_process_is_named_from_the_coordination_services_words():
    """What JAX's coordination service logs as it ends the survivors (jaxlib 0.10), read by the
    supervisor of a process no launcher watches (`train.launch.supervise`)."""
    from sharding.environment import heartbeat_seconds
    from train.launch import dead_processes

    unhealthy = ("E1207 20:24:07.553205   15433 coordination_service.cc:1549] [24] Use error "
                 "polling to propagate the following error to all tasks: UNAVAILABLE: The "
                 "following tasks are unhealthy (stopped sending heartbeats):\n1\nThe tasks have "
                 "crashed. Check the task logs\n")
    assert dead_processes(unhealthy) == "process 1"
    assert dead_processes(unhealthy.replace(":\n1\n", ":\n/job:jax_worker/replica:0/task:2, "
                                            "/job:jax_worker/replica:0/task:3\n")) \
        == "processes 2, 3"
    assert dead_processes("F1207 20:25:04.057179 16971 client.h:80] Terminating process ... "
                          "UNAVAILABLE: Failed to send RPC to coordination service. Either the "
                          "leader task died") == "process 0 (which runs the job's coordination " \
                                                 "service)"
    assert dead_processes("E1207 something else") is None
    assert heartbeat_seconds({}) == 30 and heartbeat_seconds(
        {"BLOCKBENCH_HEARTBEAT_SECONDS": "12"}) == 12
    env = dict(os.environ, SLURM_JOB_ID="7", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
               SLURM_PROCID="0", SLURM_LOCALID="0", BLOCKBENCH_HEARTBEAT_SECONDS="0")
    done = subprocess.run([sys.executable, "-m", "train", "--config", "experiments/quickstart.py",
                           "--workdir", "unused"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stderr) == (2, "error: BLOCKBENCH_HEARTBEAT_SECONDS=0 is "
                                              "invalid: a whole number of seconds ≥ 2 (default "
                                              "30); set it or unset it\n")


def test_a_port_out_of_range_or_in_use_is_one_line_before_anything_starts():
    done = subprocess.run([sys.executable, "-m", "train.launch", "--processes", "2", "--port",
                           "70000", "--", "--config", "experiments/quickstart.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (
        2, "error: argument --port: 70000 is invalid: a TCP port is 1..65535\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "train.launch", "--processes", "2",
                               "--port", str(port), "--", "--config",
                               "experiments/quickstart.py"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
    assert (done.returncode, done.stderr) == (
        2, f"error: --port={port} is invalid: the coordinator cannot listen on it (Address "
        "already in use; another job's coordinator?); pass another --port, or leave it out to "
        "use a free one\n")


# Gives the process whose BLOCKBENCH_PROCESS_ID is 1 the extra arguments in $EXTRA_P1: one
# process of a job with other arguments, as a host with another command line would have.
SHIM = """import os, sys
if os.environ.get("BLOCKBENCH_PROCESS_ID") == "1" and len(sys.argv) > 1:
    sys.argv.extend(os.environ["EXTRA_P1"].split())
"""
SMALL_JOB = ["--config", "experiments/quickstart.py", *[
    f"--config.{field}={value}" for field, value in dict(
        steps=6, batch_size=8, seq_len=16, eval_every=6, eval_batches=1, sample_tokens=0, **{
            "mesh.data": 4, "model.d_model": 32, "model.num_layers": 2,
            "model.attention.num_heads": 4, "model.attention.num_kv_heads": 2,
            "optimizer.warmup_steps": 2}).items()]]


@pytest.mark.slow
@pytest.mark.parametrize("extra, line", [
    ("--config.steps=0", "[p1] error: steps=0 is invalid: must be a positive integer"),
    ("--config.model.d_model=64", "[p1] error: process 1 of 2 resolved a different config from "
     "process 0's (model.d_model: 32 (process 0) → 64; model.attention.head_dim: 8 (process 0) "
     "→ 16; model.attention.width: 32 (process 0) → 64; model.ffn.d_ff: 128 (process 0) → 256);"
     " every process must run the same arguments and config file"),
])
def test_one_process_with_other_arguments_stops_the_job_at_once_naming_it(tmp_path, extra,
                                                                          line):
    """issue 61: a bad argument in one process ended the job only after process 0's 30 s wait,
    with a misleading line from process 0; different configs were not seen until gloo aborted
    at the first collective. Now that process's line, then the launcher's, within 5 s."""
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "sitecustomize.py").write_text(SHIM)
    env = dict(one_device_env(), EXTRA_P1=extra, PYTHONPATH=os.pathsep.join(
        [str(tmp_path / "shim"), os.environ.get("PYTHONPATH", str(ROOT))]))
    launcher = subprocess.Popen([sys.executable, "-m", "train.launch", "--processes", "2",
                                 "--devices", "2", "--", *SMALL_JOB, "--workdir",
                                 str(tmp_path / "run")], cwd=ROOT, env=env,
                                stderr=subprocess.PIPE, text=True)
    lines, seen = [], None
    for received in launcher.stderr:
        lines.append(received.rstrip("\n"))
        if seen is None and received.startswith("[p1] error:"):
            seen = time.monotonic()
    launcher.wait(timeout=60)
    assert seen is not None and time.monotonic() - seen < 5, lines
    assert launcher.returncode == 2 and lines[1:] == [
        line, "error: process 1 of 2 exited with status 2; stopped process 0"], lines
    assert not (tmp_path / "run" / "checkpoints").exists()
