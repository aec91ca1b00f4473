"""Two processes of 4 CPU devices each (JAX's distributed runtime, gloo collectives) against
one process of 8 devices: the same training, the same sharded import, only process 0 writing.

The two processes run tests/multihost_worker.py (train.main, then the sharded imports) while
this test computes the one-process reference in its own worker (8 devices, conftest.py).
"""

import dataclasses
import json
import re
from pathlib import Path

import jax
import numpy as np

from runtime import checkpoints
import multihost_worker as worker
from cluster import finish, launch
from conftest import start_state
import train
from hf.load import open_checkpoint
from runtime import setup as runtime_setup
from trainer import target as trainer_target


# "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
GLOO_WORDS = "Gloo Rank is connected to peer ranks Expected number of"


def run_files(runs: Path) -> list[str]:
    """The files under a runs folder, time stamps taken out of the names (so a second writer
    of the same file shows as a repeat); of a profile, its traces (.xplane.pb) only: the
    profiler's other files are its own business; checkpoints are Orbax's (a folder of shards
    per process)."""
    return sorted(re.sub(r"-\d{8}-\d{6}(-\d+)?|\d{4}(_\d\d){5}", "", str(p.relative_to(runs)))
                  for p in runs.rglob("*") if p.is_file() and "checkpoints" not in p.parts
                  and ("profile" not in p.parts or p.name.endswith(".xplane.pb")))


def one_process_checkpoint(folder: Path) -> dict:
    """A step-0 checkpoint of the worker's DeepSeek run saved by this one process (8 devices);
    its parameters."""
    argv = worker.RUNS["deepseek"]
    setup = runtime_setup.resolve(argv[0], argv[1:], jax.devices())
    target = trainer_target.this_machine()
    state, _ = start_state(setup, target)
    saver = checkpoints.Saver(folder, keep=1, every=1)
    saver.save(0, state, checkpoints.run_meta(0, setup, setup.run.batch(jax.device_count())))
    saver.close()
    return worker.flat(state["params"])


def losses(runs: Path, name: str) -> list[float]:
    (metrics,) = runs.glob(f"{name}-proxy-*/metrics.jsonl")
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_two_processes_train_and_import_as_one_process_of_eight(tmp_path, monkeypatch, capsys):
    results, runs, reference = (tmp_path / name for name in ("results", "runs", "reference"))
    results.mkdir()
    saved_here = one_process_checkpoint(tmp_path / "one-process")
    processes = launch(["tests/multihost_worker.py", str(results), str(runs),
                        str(tmp_path / "one-process")], 2, tmp_path, DISTRIBUTED_TIMEOUT_S="120")
    # One process runs a comparison's rows in processes of their own (runtime/comparison.py),
    # which do not know the worker's comparison: here its one row is run as itself.
    for argv in worker.RUNS.values():
        row = worker.COMPARISON[1][0] if argv[0] == worker.COMPARISON[0] else argv[0]
        assert train.main([row, *argv[1:], f"out_dir={reference}"]) == 0
    printed = capsys.readouterr().out
    # The one-process runs are this suite's end-to-end DeepSeek run and profiled run too.
    assert "671,026,419,200 parameters" in printed and "moe_layers" in printed
    assert "experts split over the 4 devices of each expert group (blocks 1x the balanced " \
        "share;" in printed
    records = [json.loads(line) for line in next(reference.glob(
        "deepseek671b-offload-*/metrics.jsonl")).read_text().splitlines()]
    assert all(r["expert_load_max_over_mean"] >= 1 and 0 <= r["expert_dropped"] < 1
               for r in records)
    assert list(reference.glob("deepseek671b-offload-*/profile/**/*.xplane.pb"))
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
    (table,) = runs.glob("multihost-llama-*/compare.csv")
    assert sorted(p.name for p in table.parent.iterdir()) == ["compare.csv", "compare.md"]
    assert run_files(runs) == sorted([*run_files(reference), *[
        re.sub(r"-\d{8}-\d{6}(-\d+)?", "", str(p.relative_to(runs)))
        for p in table.parent.iterdir()]])
    (trace,) = [p.relative_to(runs).parts for p in runs.rglob("*.xplane.pb")]
    assert trace[0].startswith("deepseek671b-offload-proxy-") and trace[1] == "profile"
    # (gloo's threads write their lines unsynchronized, so they can interleave: word by word)
    assert set(re.findall(r"[A-Za-z]+", out1)) <= set(GLOO_WORDS.split()), out1
    steps = [float(x) for x in re.findall(r"step \d/2  loss (\S+)", out0)]
    np.testing.assert_allclose(steps, [float(x) for x in re.findall(
        r"step \d/2  loss (\S+)", printed)], atol=1e-4)  # as printed: 4 decimals
    assert len(steps) == 4
    assert not re.search(r"^error|Traceback", err0 + err1, re.M), err0 + err1
    assert [r.split(",")[:4] for r in table.read_text().splitlines()] == [
        ["row", "preset", "LHS", "pipelined offload"],
        ["llama405b-offload", "qkv_offload", "true", "false"]]

    # The sharded import: gathered, the whole import bit for bit, each process having read
    # only what its devices hold; its logits those of the whole import placed alike on one
    # process's 8 devices, to the reduction-order noise of float32 (~1e-6 of their scale here;
    # a misplaced slice moves them by their scale).
    for fixture, expert in worker.IMPORTS.items():
        mesh = worker.make_mesh(expert)
        cfg, checkpoint = open_checkpoint(worker.FIXTURES / fixture)
        whole = checkpoint.read()
        gathered = np.load(results / f"{fixture}-params.npz")
        assert sorted(gathered) == sorted(worker.flat(whole))
        for key, value in worker.flat(whole).items():
            np.testing.assert_array_equal(gathered[key], value, err_msg=f"{fixture} {key}")
        for f in found:
            assert f["bytes_read"][fixture] == f["held"][fixture] < checkpoint.reader.bytes_read
        params = jax.device_put(whole, worker.shardings(cfg, mesh))
        logits = worker.logits_fn(cfg, mesh)(params, worker.tokens(fixture))
        np.testing.assert_allclose(np.load(results / f"{fixture}-logits.npy"), logits, rtol=0,
                                   atol=1e-5 * np.abs(logits).max(), err_msg=fixture)

    # Checkpoints cross process counts: saved by one process, restored onto two; saved by two
    # (each its own shards), restored onto one; bit for bit.
    for name, want in (("one", saved_here), ("two", None)):
        got = dict(np.load(results / f"restored-from-{name}.npz"))
        if want is None:
            (run_dir,) = runs.glob("deepseek671b-offload-*")
            assert {p.name for p in (run_dir / "checkpoints" / "2" / "params").glob(
                "ocdbt.process_*")} == {"ocdbt.process_0", "ocdbt.process_1"}
            setup = runtime_setup.resolve(worker.RUNS["deepseek"][0], worker.RUNS["deepseek"][1:],
                                  jax.devices())
            setup = dataclasses.replace(setup, resume=checkpoints.find(str(run_dir), "", ""))
            target = trainer_target.this_machine()
            state, step = start_state(setup, target)
            assert step == 2
            want = worker.flat(state["params"])
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")
