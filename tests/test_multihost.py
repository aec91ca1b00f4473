"""Two processes of 4 CPU devices each (JAX's distributed runtime, gloo collectives) against
one process of 8 devices: the same training, the same sharded import, only process 0 writing.

The two processes run tests/multihost_worker.py (train.main, then the sharded imports) while
this test computes the one-process reference in its own worker (8 devices, conftest.py).
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

import configs
import multihost_worker as worker
import train
from model.hf import open_checkpoint

LAUNCHERS = re.compile(r"^(SLURM_|OMPI_|PMIX_|JAX_COORDINATOR|JAX_NUM_PROCESSES|JAX_PROCESS_ID)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: list[str], n: int, folder: Path, **env) -> list[subprocess.Popen]:
    """n processes of `script`, an explicit launch on a free port, 4 CPU devices each; their
    output goes to files (pipes could fill while the test computes)."""
    base = {k: v for k, v in os.environ.items() if not LAUNCHERS.match(k)}
    base.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_NUM_PROCESSES=str(n),
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", **env)
    return [subprocess.Popen([sys.executable, *script], env={**base, "JAX_PROCESS_ID": str(i)},
                             stdout=open(folder / f"out-{i}", "w"),
                             stderr=open(folder / f"err-{i}", "w")) for i in range(n)]


def finish(processes, folder: Path, timeout: float) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each process; all killed past `timeout` seconds."""
    try:
        codes = [p.wait(timeout=timeout) for p in processes]
    finally:
        for p in processes:
            p.kill()
    return [(code, (folder / f"out-{i}").read_text(), (folder / f"err-{i}").read_text())
            for i, code in enumerate(codes)]


def run_files(runs: Path) -> list[str]:
    """The files under a runs folder, time stamps taken out of the names (so a second writer
    of the same file shows as a repeat)."""
    return sorted(re.sub(r"-\d{8}-\d{6}(-\d+)?|\d{4}(_\d\d){5}", "", str(p.relative_to(runs)))
                  for p in runs.rglob("*") if p.is_file())


def losses(runs: Path, name: str) -> list[float]:
    (metrics,) = runs.glob(f"{name}-proxy-*/metrics.jsonl")
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_two_processes_train_and_import_as_one_process_of_eight(tmp_path, monkeypatch, capsys):
    results, runs, reference = (tmp_path / name for name in ("results", "runs", "reference"))
    results.mkdir()
    processes = launch(["tests/multihost_worker.py", str(results), str(runs)], 2, tmp_path,
                       DISTRIBUTED_TIMEOUT_S="120")
    monkeypatch.setitem(configs.COMPARISONS, *worker.COMPARISON)
    for argv in worker.RUNS.values():
        assert train.main([*argv, f"out_dir={reference}"]) == 0
    printed = capsys.readouterr().out
    (code0, out0, err0), (code1, out1, err1) = finish(processes, tmp_path, timeout=300)
    assert code0 == code1 == 0, err0 + err1
    found = [json.loads((results / f"process-{i}.json").read_text()) for i in range(2)]
    assert [f["codes"] for f in found] == [{"llama": 0, "deepseek": 0}] * 2

    # Losses to float32 rounding: gloo's all-reduces add the devices' shares in another order
    # than one process does (a last-bit difference here; a wrong shard or exchange is ~1e-2).
    for name in ("llama405b-offload", "deepseek671b-offload"):
        two, one = losses(runs, name), losses(reference, name)
        assert len(two) == len(one) == 2
        np.testing.assert_allclose(two, one, rtol=4 * np.finfo(np.float32).eps, err_msg=name)

    # Only process 0 writes (run folders, comparison table, profile) and prints; process 1
    # prints nothing but gloo's own connection lines, and no process reports an error.
    assert run_files(runs) == run_files(reference)
    assert {p.name for p in runs.glob("*/profile")} == {"profile"}
    assert [line for line in out1.splitlines() if not line.startswith("[Gloo]")] == []
    steps = re.findall(r"step \d/2  loss \S+", out0)
    assert steps == re.findall(r"step \d/2  loss \S+", printed) and len(steps) == 4
    assert "error" not in err0 + err1 and "Traceback" not in err0 + err1, err0 + err1
    (table,) = runs.glob("multihost-llama-*/compare.csv")
    (expected_table,) = reference.glob("multihost-llama-*/compare.csv")
    assert [r.split(",")[:4] for r in table.read_text().splitlines()] == [
        r.split(",")[:4] for r in expected_table.read_text().splitlines()]

    # The sharded import: gathered, the whole import bit for bit, each process having read
    # only what its devices hold; its logits those of the whole import placed alike on one
    # process's 8 devices, to the reduction-order noise of float32 (~1e-6 of their scale here;
    # a misplaced slice moves them by their scale).
    mesh = worker.make_mesh()
    for fixture, expert_parallel in worker.IMPORTS.items():
        cfg, checkpoint = open_checkpoint(worker.FIXTURES / fixture)
        whole = checkpoint.read()
        gathered = np.load(results / f"{fixture}-params.npz")
        assert sorted(gathered) == sorted(worker.flat(whole))
        for key, value in worker.flat(whole).items():
            np.testing.assert_array_equal(gathered[key], value, err_msg=f"{fixture} {key}")
        for f in found:
            assert f["bytes_read"][fixture] == f["held"][fixture] < checkpoint.reader.bytes_read
        params = jax.device_put(whole, worker.shardings(cfg, expert_parallel, mesh))
        logits = worker.logits_fn(cfg, mesh)(params, worker.tokens(fixture))
        np.testing.assert_allclose(np.load(results / f"{fixture}-logits.npy"), logits, rtol=0,
                                   atol=1e-5 * np.abs(logits).max(), err_msg=fixture)
