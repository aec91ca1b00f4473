"""Training checkpoints (Orbax): exact resumes, resharding, kill -9 and SIGTERM, export of a
trained state, bad input."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import train
from conftest import NARROW, start_state
from hf.load import load_checkpoint
from model import families
from model.params import abstract_params
from runtime import checkpoints
from runtime import setup as runtime_setup
from trainer import target as trainer_target

# Proxy runs of the real experiments: 2 layers, 32 tokens, 8 devices x batch 2, 4 steps.
SMALL = ["steps=4", "seq=32", "model.n_layers=2", "model.vocab=512", *NARROW]


def cli(args, capsys):
    code = train.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def saved_params(step_dir: Path, like: dict) -> dict:
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one_device),
                            like)
    source = checkpoints.Source(step_dir.parent, (int(step_dir.name),))
    return jax.tree.map(np.asarray, checkpoints.read_params(source, abstract)[0])


def assert_bit_identical(a: dict, b: dict) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def run_and_resume(name: str, extra: list[str], tmp_path: Path, capsys):
    """Four steps uninterrupted, then steps 3-4 again from the step-2 checkpoint: the two run
    folders and the uninterrupted run's output."""
    args = [name, *SMALL, *extra, "checkpoint_every=2", f"out_dir={tmp_path}"]
    code, out, err = cli(args, capsys)
    assert code == 0, err
    (whole,) = tmp_path.iterdir()
    assert sorted(p.name for p in (whole / "checkpoints").iterdir()) == ["2", "4"]
    code, resumed_out, err = cli([*args, f"resume={whole / 'checkpoints' / '2'}"], capsys)
    assert code == 0, err
    assert "resumed from" in resumed_out and "step 3/4" in resumed_out
    assert "step 1/4" not in resumed_out
    (resumed,) = set(tmp_path.iterdir()) - {whole}
    return whole, resumed, out


def test_llama_resume_is_bit_identical_reshards_and_exports(tmp_path, capsys):
    # mlpwo offloaded too: the backward pass never reads it (python -m study plan says
    # "nothing to place"), so the program is the same, and the header says so.
    whole, resumed, out = run_and_resume("llama405b-offload", ["placement.mlpwo=offload"],
                                         tmp_path / "runs", capsys)
    assert out.count("placement.mlpwo=offload places nothing") == 1
    assert "PROXY" in out and "405,853,388,800 parameters" in out
    assert "NOT applied: cpu backend" in out  # GPU flags shown, and said to be unused
    # Where the full-scale plan and placement list are (tests/test_study.py checks them), and
    # what this run's own program offloads: Q, K and V, kept on the device by a CPU.
    assert ("405,853,388,800 parameters; its memory plan and GPU program: python -m study "
            "plan|compile llama405b-offload") in out
    assert "offloaded, per layer and device, in this run's compiled program:" in out
    assert out.count("device memory: this backend drops host placements") == 3
    assert ("NVFP4 values (16x16 tiles) for every GEMM of the layer matrices, multiplied in the "
            "compute dtype" in out)
    # A finished run has no steps left: no "continue with" (only a stopped run has one).
    assert f"checkpoint  {whole / 'checkpoints' / '4'} (complete)\n" in out
    assert json.loads((whole / "summary.json").read_text())["median_step_s"] > 0
    assert list(losses(resumed)) == [3, 4]
    assert losses(resumed) == {k: v for k, v in losses(whole).items() if k > 2}
    setup = runtime_setup.resolve("llama405b-offload", SMALL, jax.devices())
    specs = families.of(setup.model).param_specs(setup.model)
    like = abstract_params(specs)
    final = saved_params(whole / "checkpoints" / "4", like)
    assert_bit_identical(final, saved_params(resumed / "checkpoints" / "4", like))

    # Saved on 8 devices (fsdp 8), restored on 4 (fsdp 4) and on data 2 x fsdp 4.
    source = checkpoints.find(str(whole), "", "")
    for devices, mesh in ((4, ["mesh.fsdp=4"]), (8, ["mesh.data=2", "mesh.fsdp=4"])):
        target = dataclasses.replace(trainer_target.this_machine(), devices=jax.devices()[:devices])
        setup = runtime_setup.resolve("llama405b-offload", [*SMALL, *mesh], target.devices)
        state, step = start_state(dataclasses.replace(setup, resume=source), target)
        assert step == 4 and int(state["step"]) == 4
        assert state["params"]["embed"].sharding.mesh.devices.size == devices
        assert_bit_identical(jax.tree.map(np.asarray, state["params"]), final)

    # Export: the importer reads back the trained weights.
    code, out, err = cli(["export", str(whole), f"hf_dir={tmp_path / 'hf'}"], capsys)
    assert code == 0, err
    model, exported = load_checkpoint(tmp_path / "hf")
    assert model == setup.model
    assert_bit_identical(exported, final)


def test_deepseek_resume_with_router_bias_updates_is_bit_identical(tmp_path, capsys):
    whole, resumed, out = run_and_resume(
        "deepseek671b-offload", ["mesh.expert=4", "expert_capacity=1.0"], tmp_path, capsys)
    assert "671,026,419,200 parameters" in out and "moe_layers" in out
    assert "experts split over the 4 devices of each expert group (blocks 1x the balanced " \
        "share;" in out
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert all(r["expert_load_max_over_mean"] >= 1 for r in records)
    assert all(0 <= r["expert_dropped"] < 1 for r in records)
    assert losses(resumed) == {k: v for k, v in losses(whole).items() if k > 2}
    setup = runtime_setup.resolve("deepseek671b-offload", SMALL, jax.devices())
    like = abstract_params(families.of(setup.model).param_specs(setup.model))
    final = saved_params(whole / "checkpoints" / "4", like)
    assert_bit_identical(final, saved_params(resumed / "checkpoints" / "4", like))
    start = saved_params(whole / "checkpoints" / "2", like)
    assert not np.array_equal(final["moe_layers"]["router_bias"],
                              start["moe_layers"]["router_bias"])  # the bias did move


STEPS = 60  # long enough for a signal to land mid-run
# One layer, no NVFP4 (its resume has its own test above: its emulation slows a CPU step).
ONE_LAYER = ["llama405b-offload", "seq=32", "model.n_layers=1", "model.vocab=512", "quant=none",
             *NARROW]


def _start(args: list[str], out_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *ONE_LAYER, f"steps={STEPS}", *args,
                             f"out_dir={out_dir}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} "
                                 "--xla_force_host_platform_device_count=8"})


def _wait_for(condition, process: subprocess.Popen, what: str, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert process.poll() is None, f"the run ended before {what}: {process.communicate()}"
        assert time.monotonic() < deadline, f"no {what} within {limit_s} s"
        time.sleep(0.002)


def test_kill_9_mid_save_then_sigterm_then_resume_latest(tmp_path, capsys):
    runs = tmp_path / "runs"
    # kill -9 while an asynchronous save is being written.
    first = _start(["checkpoint_every=1", "keep=20"], runs)
    unfinished = lambda: [p for p in runs.glob("*/checkpoints/*") if "tmp" in p.name]  # noqa
    complete = lambda: [p for p in runs.glob("*/checkpoints/*") if p.name.isdigit()]  # noqa
    _wait_for(lambda: complete() and unfinished(), first, "a save in progress")
    first.kill()
    first.wait()
    assert unfinished(), "the save finished before the kill: nothing was cut short"
    last_complete = max(int(p.name) for p in complete())
    assert last_complete < STEPS

    # SIGTERM: the resumed run stops at a step boundary with a final checkpoint, status 143.
    (killed,) = runs.iterdir()
    second = _start(["checkpoint_every=0", "resume=latest"], runs)
    metrics = lambda: [p / "metrics.jsonl" for p in runs.iterdir() if p != killed]  # noqa
    _wait_for(lambda: any(m.exists() and m.stat().st_size for m in metrics()), second,
              "a step of the resumed run")
    second.send_signal(signal.SIGTERM)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 128 + signal.SIGTERM, err
    assert f"step {last_complete + 1:>2}/{STEPS}" in out  # after the last complete save
    assert "stopped by SIGTERM" in out and "(complete)" in out
    (stopped,) = set(runs.iterdir()) - {killed}
    stopped_at = max(int(p.name) for p in (stopped / "checkpoints").iterdir())
    assert last_complete < stopped_at < STEPS

    # The command it printed continues it: the run's own overrides, resume= its folder.
    (command,) = re.findall(r"continue with: python train.py (.*)", out)
    assert command.split() == [*ONE_LAYER, f"steps={STEPS}", "checkpoint_every=0",
                               f"out_dir={runs}", f"resume={stopped}"]
    code, out, err = cli(command.split(), capsys)
    assert code == 0, err
    assert f"step {stopped_at + 1:>2}/{STEPS}" in out and f"step {STEPS}/{STEPS}" in out


def test_bad_checkpoint_input_is_one_line_and_status_2(tmp_path, capsys):
    small = [*ONE_LAYER, "steps=3"]
    code, _, err = cli([*small, "checkpoint_every=1", f"out_dir={tmp_path / 'good'}"], capsys)
    assert code == 0, err
    (run_dir,) = (tmp_path / "good").iterdir()
    empty, partial, a_file = tmp_path / "empty", tmp_path / "partial", tmp_path / "file"
    empty.mkdir()
    shutil.copytree(run_dir / "checkpoints" / "1", partial / "4.orbax-checkpoint-tmp-1")
    a_file.write_text("not a folder")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(run_dir / "checkpoints", corrupt)
    for data in (corrupt / "2" / "params").rglob("d/*"):
        data.write_bytes(data.read_bytes()[:10])
    truncated = tmp_path / "truncated"  # its arrays' data cut short, its indexes whole
    shutil.copytree(run_dir / "checkpoints", truncated)
    for data in (truncated / "2" / "params").glob("ocdbt.process_*/d/*"):
        data.write_bytes(data.read_bytes()[:20])
    foreign = tmp_path / "foreign"
    shutil.copytree(run_dir / "checkpoints" / "1", foreign / "1")
    (foreign / "1" / "meta" / "metadata").write_text('{"step": 1}')
    keep = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    cases = [
        [*small, "resume=/nonexistent/run"], [*small, f"resume={empty}"],
        [*small, f"resume={partial}"], [*small, f"resume={corrupt / '2'}"],
        [*small, f"resume={run_dir}", "seed=1"], [*small, f"resume={run_dir}", "model.d_ff=384"],
        [*small, f"resume={run_dir}"],  # already at its last step
        [*small, f"out_dir={a_file}"], [*small, f"out_dir={a_file / 'below'}"],
        [*small, f"checkpoint_dir={run_dir / 'checkpoints'}"],
        [*small, f"resume={foreign}"],
        ["llama405b-compare", f"resume={run_dir}"],
        ["llama405b-compare", f"checkpoint_dir={tmp_path / 'new'}"],
        ["export", str(run_dir), f"hf_dir={run_dir}"], ["export", str(run_dir)],
        ["export", str(run_dir), f"hf_dir={tmp_path / 'hf'}", "dtype=int8"],
        ["export", str(corrupt / "2"), f"hf_dir={tmp_path / 'hf'}"],
        ["export", str(truncated / "2"), f"hf_dir={tmp_path / 'hf'}"],
        ["export", "latest", f"hf_dir={tmp_path / 'hf'}"],
    ]
    for args in cases:
        elsewhere = args[0] == "export" or any(a.startswith("out_dir=") for a in args)
        code, _, err = cli(args if elsewhere else [*args, f"out_dir={tmp_path / 'out'}"], capsys)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (args, err)
        assert "TensorStore details" not in err  # the damaged file's own reason, not a repr
    assert not (tmp_path / "out").exists() and not (tmp_path / "hf").exists()
    assert keep == {p: p.read_bytes() for p in keep}  # nothing written over


def test_a_failed_read_says_its_reason_once_and_logs_nothing(monkeypatch, caplog, tmp_path):
    """Orbax's reader, standing in: one read fails (TensorStore's reason the cause of Orbax's
    wrapper), and asyncio logs each other pending read's failure at its shutdown, as Orbax's
    does: the line gives the reason, and none of that logging gets out."""
    import logging

    class Reader:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def restore(self, *args, **kwargs):
            for _ in range(3):
                logging.getLogger("asyncio").error("unhandled exception during asyncio.run() "
                                                   "shutdown")
            raise Exception("Encountered error while reading array index. See full TensorStore "
                            "details: <bound method ...>") from ValueError(
                                "OUT_OF_RANGE: value of size 20\nmore")

    monkeypatch.setattr(checkpoints.ocp, "Checkpointer", lambda handler: Reader())
    level = logging.getLogger("asyncio").level
    with caplog.at_level(logging.DEBUG), pytest.raises(checkpoints.CheckpointNotFound) as raised:
        checkpoints._read(tmp_path, meta=checkpoints.ocp.args.JsonRestore())
    assert str(raised.value) == (f"checkpoint {tmp_path} does not read back: OUT_OF_RANGE: "
                                 "value of size 20")
    assert not [r for r in caplog.records if r.name == "asyncio"]
    assert logging.getLogger("asyncio").level == level  # as it was, after the read
