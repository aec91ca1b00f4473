"""Launch detection (fake environments, against JAX's own cluster detection), the one-line
failures of a cluster that cannot form, and the SLURM batch scripts."""

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from jax._src import clusters  # JAX's own detection: the reference for ours

from runtime import distributed
from analysis import plan
import train
from configs import ConfigError
from runtime.distributed import Launch
from cluster import PortTaken, launch
from runtime import setup as runtime_setup

SLURM_STEP = {"SLURM_JOB_ID": "123456", "SLURM_STEP_NODELIST": "gpu-[007-010,012],cpu1",
              "SLURM_NTASKS": "32", "SLURM_STEP_NUM_NODES": "32", "SLURM_PROCID": "5",
              "SLURM_LOCALID": "0"}
OPEN_MPI = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
            "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_RANK": "9",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}


def jax_detects(env: dict, monkeypatch) -> tuple:
    """(coordinator, processes, process id, local devices) as JAX's auto-detection finds them."""
    for name in list(os.environ):
        if re.match(r"(SLURM_|OMPI_|JAX_)", name):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    found = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, None, None)
    monkeypatch.undo()
    return found


@pytest.mark.parametrize("env", [
    SLURM_STEP,
    {**SLURM_STEP, "SLURM_STEP_NODELIST": "node001"},
    {**SLURM_STEP, "SLURM_STEP_NODELIST": "node001,host2"},
    {**SLURM_STEP, "SLURM_STEP_NODELIST": "node[001-0015],host2"},
    {**SLURM_STEP, "SLURM_STEP_NODELIST": "node[001,007-015],host2"},
    {**SLURM_STEP, "JAX_COORDINATOR_PORT": "4321"},
    OPEN_MPI,
    {**OPEN_MPI, "OMPI_MCA_orte_hnp_uri": "1314521088.0;tcp6://[fe80::b9b:ac5d,2620:10d::2]:43370"},
], ids=["slurm", "one host", "two hosts", "range", "list and range", "port", "openmpi", "ipv6"])
def test_launchers_map_to_jax_own_detection(env, monkeypatch):
    launch = distributed.detect(env)
    address, processes, process, local = jax_detects(env, monkeypatch)
    assert (launch.coordinator, launch.num_processes, launch.process_id) == (
        address, processes, process)
    # JAX gives each process its local rank's GPU; one process per host keeps all of them
    # (here: the SLURM steps, 32 tasks on 32 hosts; Open MPI's are 8 a host).
    shared = "OMPI_COMM_WORLD_SIZE" in env
    assert launch.local_device_ids == (tuple(local) if shared else None)


def test_each_launcher_and_its_overrides():
    explicit = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
                "JAX_PROCESS_ID": "3"}
    assert distributed.detect(explicit) == Launch("explicit", "10.0.0.1:1234", 4, 3)
    assert distributed.detect({**explicit, "JAX_LOCAL_DEVICE_IDS": "2,3"}).local_device_ids == (
        2, 3)
    per_gpu = {**SLURM_STEP, "SLURM_NTASKS": "128", "SLURM_PROCID": "6", "SLURM_LOCALID": "2"}
    assert distributed.detect(per_gpu) == Launch("slurm", "gpu-007:62016", 128, 6, (2,))
    assert distributed.detect({**SLURM_STEP, "JAX_COORDINATOR_ADDRESS": "ib0:77"}).coordinator \
        == "ib0:77"
    # mpirun inside a SLURM job: its ranks carry the job's SLURM_* too; Open MPI launched them.
    assert distributed.detect({**SLURM_STEP, **OPEN_MPI}).launcher == "openmpi"
    open_mpi_5 = {k: v for k, v in OPEN_MPI.items() if k != "OMPI_MCA_orte_hnp_uri"}
    assert distributed.detect({**open_mpi_5, "JAX_COORDINATOR_ADDRESS": "h0:9"}).coordinator \
        == "h0:9"
    single = [{}, {**SLURM_STEP, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"},
              {**explicit, "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"},
              # a batch script's own command (no job step): the plan before its srun
              {k: v for k, v in SLURM_STEP.items() if not k.startswith("SLURM_STEP")}]
    assert [distributed.detect(env) for env in single] == [None] * 4


def test_a_launch_becomes_initialize_arguments_with_bounded_waits(monkeypatch):
    """No real initialize: what distributed.initialize hands JAX (and the CPU's collectives)."""
    calls, updates = [], []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(jax.config, "update", lambda *a: updates.append(a))
    env = {**SLURM_STEP, "SLURM_NTASKS": "128", "SLURM_PROCID": "6", "SLURM_LOCALID": "2",
           distributed.TIMEOUT_VARIABLE: "7"}
    assert distributed.initialize(env) == distributed.detect(env)
    assert calls == [(("gpu-007:62016", 128, 6, [2]), {
        "cluster_detection_method": "deactivate", "initialization_timeout": 37,
        "shutdown_timeout_seconds": 7})]
    assert updates == [("jax_cpu_collectives_implementation", "gloo")]  # no GPU here
    assert distributed.initialize({}) is None and len(calls) == 1


MISTAKES = {
    "explicit, no address": ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
                             "JAX_NUM_PROCESSES and JAX_PROCESS_ID set without "
                             "JAX_COORDINATOR_ADDRESS"),
    "address alone": ({"JAX_COORDINATOR_ADDRESS": "h:1"}, "set without JAX_NUM_PROCESSES and"),
    "id past the count": ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
                           "JAX_PROCESS_ID": "2"}, "process 2 of 2"),
    "not a number": ({**SLURM_STEP, "SLURM_PROCID": "x"}, "SLURM_PROCID='x'"),
    "no port": ({"JAX_COORDINATOR_ADDRESS": "h", "JAX_NUM_PROCESSES": "2",
                 "JAX_PROCESS_ID": "0"}, "expected host:port"),
    "Open MPI 5, no address": ({k: v for k, v in OPEN_MPI.items()
                                if k != "OMPI_MCA_orte_hnp_uri"}, "set JAX_COORDINATOR_ADDRESS"),
    "bad device ids": ({**SLURM_STEP, "JAX_LOCAL_DEVICE_IDS": "0;1"}, "JAX_LOCAL_DEVICE_IDS"),
}


@pytest.mark.parametrize("env, words", MISTAKES.values(), ids=MISTAKES.keys())
def test_inconsistent_variables_are_one_clear_error(env, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        distributed.detect(env)


def test_train_stops_on_them_with_one_line_and_status_2(monkeypatch, capsys, tmp_path):
    for name, value in MISTAKES["id past the count"][0].items():
        monkeypatch.setenv(name, value)
    assert train.main(["llama405b-offload", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: process 2 of 2") and err.count("\n") == 1, err
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    monkeypatch.setenv(distributed.TIMEOUT_VARIABLE, "0")
    assert train.main(["llama405b-offload", f"out_dir={tmp_path}"]) == 2
    assert "DISTRIBUTED_TIMEOUT_S=0: expected at least 1 second" in capsys.readouterr().err


def test_a_missing_process_or_a_taken_port_ends_in_one_line(tmp_path):
    """Process 0 of 2 alone waits DISTRIBUTED_TIMEOUT_S, not JAX's 5 minutes, then says so
    (JAX would abort with a C++ stack trace); a coordinator port in use is named at once."""
    alone, taken = tmp_path / "alone", tmp_path / "taken"
    alone.mkdir()
    taken.mkdir()
    script = ["train.py", "llama405b-offload", f"out_dir={tmp_path / 'runs'}"]
    with PortTaken() as port:
        started = time.monotonic()
        processes = [*launch(script, 1, alone, JAX_NUM_PROCESSES="2", DISTRIBUTED_TIMEOUT_S="3"),
                     *launch(script, 1, taken, JAX_NUM_PROCESSES="2",
                             JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}")]
        results = [p.wait(timeout=60) for p in processes]
        seconds = time.monotonic() - started
    errors = [(folder / "err-0").read_text() for folder in (alone, taken)]
    assert results == [2, 2] and seconds < 30, (results, seconds, errors)
    assert [e.count("\n") for e in errors] == [1, 1], errors
    assert re.fullmatch(r"error: process 0 of 2 \(explicit launch, coordinator 127\.0\.0\.1:\d+"
                        r"\): the processes did not all join within 3 s .*\n", errors[0])
    assert "the coordinator's port is taken on this host" in errors[1]
    assert not (tmp_path / "runs").exists()


SCRIPTS = Path("scripts/slurm")


def sbatch_options(script: Path) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", script.read_text(), re.M))


@pytest.mark.parametrize("script, gpus", [("gb200-nvl72.sbatch", 128), ("h100-8gpu.sbatch", 8)])
def test_slurm_scripts_reach_the_detection(script, gpus, tmp_path):
    """Each batch script parses, asks for its GPUs, derives XLA's pinned-host pool from the
    plan, and starts train.py under srun; each task's environment (the script's own plus
    what srun sets) is the launch distributed.py detects."""
    for path in SCRIPTS.iterdir():
        assert subprocess.run(["bash", "-n", path]).returncode == 0, path
    options = sbatch_options(SCRIPTS / script)
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    assert nodes * per_node * int(options["gpus-per-node"]) == gpus
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(f'#!/bin/bash\nenv > {tmp_path}/env\necho "$@" > {tmp_path}/args\n')
    (fake / "srun").chmod(0o755)
    batch_step = {"SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": os.getcwd(),
                  "SLURM_JOB_NODELIST": f"gpu-[001-{nodes:03d}]", "SLURM_NNODES": str(nodes),
                  "SLURM_NTASKS": str(nodes * per_node), "SLURM_PROCID": "0",
                  "SLURM_LOCALID": "0", "PYTHON": sys.executable,
                  "PATH": f"{fake}:{os.environ['PATH']}"}
    env = {k: v for k, v in os.environ.items() if not re.match("(SLURM_|OMPI_|JAX_|XLA_)", k)}
    args = ["llama8b-offload", "per_device_batch=8"]  # 24 GiB offloaded per GPU
    result = subprocess.run([SCRIPTS / script, *args], env={**env, **batch_step},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    setup = runtime_setup.resolve(args[0], args[1:], full=True)
    per_gpu = round(plan.full_scale(setup.experiment, setup.tables).host_activations / 2**30, 1)
    pool = max(64, math.ceil(per_gpu * (gpus // (nodes * per_node)) * 1.1))
    task = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines()
                if "=" in line)
    assert (task["XLA_CLIENT_MEM_FRACTION"], task["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"]) == (
        "0.95", str(pool))
    assert (tmp_path / "args").read_text().split() == [
        "--kill-on-bad-exit=1", sys.executable, "train.py", *args]
    step = {"SLURM_STEP_NODELIST": batch_step["SLURM_JOB_NODELIST"],
            "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_PROCID": str(nodes * per_node - 1)}
    expected = None if nodes * per_node == 1 else Launch(
        "slurm", f"gpu-001:{4242 % 4096 + 61440}", nodes * per_node, nodes * per_node - 1)
    assert distributed.detect({**task, **step}) == expected
