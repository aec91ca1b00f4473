"""Joining a cluster: JAX's own detection of a SLURM job step (one process per GPU, as the
batch scripts launch), the explicit launch and its mistakes as one line, bounded waits, a
taken port, and the SLURM batch scripts."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

import train
from cluster import PortTaken, launch
from configs import ConfigError
from runtime import distributed
from runtime.distributed import Launch

# A task of a 32-host job step, 4 tasks a host (scripts/slurm/gb200-nvl72.sbatch).
SLURM_STEP = {"SLURM_JOB_ID": "123456", "SLURM_STEP_NODELIST": "gpu-[007-010,012],cpu1",
              "SLURM_NTASKS": "128", "SLURM_STEP_NUM_NODES": "32", "SLURM_PROCID": "5",
              "SLURM_LOCALID": "1"}
EXPLICIT = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
            "JAX_PROCESS_ID": "3"}


@pytest.fixture
def environment(monkeypatch):
    """Set a launch's variables, nothing of the real environment's launchers left."""
    for name in list(os.environ):
        if re.match(r"(SLURM_|OMPI_|PMIX_|JAX_COORDINATOR|JAX_NUM_|JAX_PROCESS_|JAX_LOCAL)", name):
            monkeypatch.delenv(name)

    def set_to(env: dict) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
    return set_to


def test_a_slurm_job_step_is_one_process_per_gpu(environment):
    """The coordinator is the step's first host on the job's port (JAX's rule: the last 4096
    of the ports, by job id); task 5 is the second task of its host: its second GPU."""
    environment(SLURM_STEP)
    assert distributed.detect() == Launch(f"gpu-007:{123456 % 4096 + 61440}", 128, 5, (1,))


@pytest.mark.parametrize("env", [
    {}, {**SLURM_STEP, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"},
    {**EXPLICIT, "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"},
    # A batch script's own command, the plan before its srun: no job step.
    {k: v for k, v in SLURM_STEP.items() if not k.startswith("SLURM_STEP")},
], ids=["nothing", "one task", "explicit, one process", "batch script"])
def test_single_processes_join_nothing(env, environment):
    environment(env)
    assert distributed.detect() is None


def test_the_explicit_launch_and_jax_own_overrides(environment):
    environment(EXPLICIT)
    assert distributed.detect() == Launch("10.0.0.1:1234", 4, 3)
    environment({"JAX_LOCAL_DEVICE_IDS": "2,3"})
    assert distributed.detect().local_device_ids == (2, 3)
    environment({**{k: "" for k in EXPLICIT}, **SLURM_STEP, "JAX_COORDINATOR_ADDRESS": "ib0:77"})
    assert distributed.detect().coordinator == "ib0:77"


MISTAKES = {
    "explicit, no address": ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
                             "JAX_NUM_PROCESSES and JAX_PROCESS_ID set without "
                             "JAX_COORDINATOR_ADDRESS"),
    "address alone": ({"JAX_COORDINATOR_ADDRESS": "h:1"}, "set without JAX_NUM_PROCESSES and"),
    "id past the count": ({**EXPLICIT, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
                          "process 2 of 2"),
    "not a number": ({**EXPLICIT, "JAX_PROCESS_ID": "x"}, "JAX_PROCESS_ID='x'"),
    "no port": ({**EXPLICIT, "JAX_COORDINATOR_ADDRESS": "h"}, "expected host:port"),
    "bad device ids": ({**EXPLICIT, "JAX_LOCAL_DEVICE_IDS": "0;1"}, "JAX_LOCAL_DEVICE_IDS"),
    "a malformed SLURM variable": ({**SLURM_STEP, "SLURM_PROCID": "x"},
                                   "the launch's environment does not parse"),
}


@pytest.mark.parametrize("env, words", MISTAKES.values(), ids=MISTAKES.keys())
def test_inconsistent_variables_are_one_clear_error(env, words, environment):
    environment(env)
    with pytest.raises(ConfigError, match=re.escape(words)):
        distributed.detect()


def test_a_launch_becomes_initialize_arguments_with_bounded_waits(monkeypatch, environment):
    """No real initialize: what distributed.initialize hands JAX (and the CPU's collectives)."""
    calls, updates = [], []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(jax.config, "update", lambda *a: updates.append(a))
    environment({**SLURM_STEP, distributed.TIMEOUT_VARIABLE: "7"})
    assert distributed.initialize() == distributed.detect()
    assert calls == [((f"gpu-007:{123456 % 4096 + 61440}", 128, 5, [1]), {
        "cluster_detection_method": "deactivate", "initialization_timeout": 37,
        "shutdown_timeout_seconds": 7})]
    assert updates == [("jax_cpu_collectives_implementation", "gloo")]  # no GPU here
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    assert distributed.initialize() is None and len(calls) == 1


def test_train_stops_on_them_with_one_line_and_status_2(environment, capsys, tmp_path):
    environment(MISTAKES["id past the count"][0])
    assert train.main(["llama405b-offload", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: process 2 of 2") and err.count("\n") == 1, err
    environment({"JAX_PROCESS_ID": "1", distributed.TIMEOUT_VARIABLE: "0"})
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
    assert re.fullmatch(r"error: process 0 of 2 \(coordinator 127\.0\.0\.1:\d+\): the processes "
                        r"did not all join within 3 s .*\n", errors[0])
    assert "the coordinator's port is taken on this host" in errors[1]
    assert not (tmp_path / "runs").exists()


SCRIPTS = Path("scripts/slurm")


def sbatch_options(script: Path) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", script.read_text(), re.M))


@pytest.mark.gpu_compile  # without the CUDA plugin the script installs it (launch.sh)
@pytest.mark.parametrize("script, gpus", [("gb200-nvl72.sbatch", 128), ("h100-8gpu.sbatch", 8)])
def test_slurm_scripts_reach_the_detection(script, gpus, tmp_path, environment):
    """Each batch script parses, asks for its GPUs, sets XLA's pool and leaves the pinned-host
    limit to the run (runtime/backend.py sets it from the host's memory), and starts train.py
    under srun with the words as given; each task's environment (the script's own plus what
    srun sets) is a launch JAX detects."""
    for path in SCRIPTS.iterdir():
        assert subprocess.run(["bash", "-n", path]).returncode == 0, path
    options = sbatch_options(SCRIPTS / script)
    nodes, tasks = int(options["nodes"]), int(options["ntasks-per-node"])
    assert nodes * int(options["gpus-per-node"]) == gpus
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(f'#!/bin/bash\nenv > {tmp_path}/env\necho "$@" > {tmp_path}/args\n')
    (fake / "srun").chmod(0o755)
    batch_step = {"SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": os.getcwd(),
                  "SLURM_JOB_NODELIST": f"gpu-[001-{nodes:03d}]", "SLURM_NNODES": str(nodes),
                  "SLURM_NTASKS": str(nodes * tasks), "SLURM_PROCID": "0",
                  "SLURM_LOCALID": "0", "PYTHON": sys.executable,
                  "PATH": f"{fake}:{os.environ['PATH']}"}
    env = {k: v for k, v in os.environ.items() if not re.match("(SLURM_|OMPI_|JAX_|XLA_)", k)}
    args = ["llama8b-offload", "per_device_batch=8"]
    result = subprocess.run([SCRIPTS / script, *args], env={**env, **batch_step},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    task = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines()
                if "=" in line)
    assert task["XLA_CLIENT_MEM_FRACTION"] == "0.95"
    assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" not in task
    assert (tmp_path / "args").read_text().split() == [
        "--kill-on-bad-exit=1", sys.executable, "train.py", *args]
    last = nodes * tasks - 1  # srun adds the step's variables to each task's
    environment({**task, "SLURM_STEP_NODELIST": batch_step["SLURM_JOB_NODELIST"],
                 "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_PROCID": str(last),
                 "SLURM_LOCALID": str(last % tasks)})
    expected = None if nodes * tasks == 1 else Launch(
        f"gpu-001:{4242 % 4096 + 61440}", nodes * tasks, last, (last % tasks,))
    assert distributed.detect() == expected
