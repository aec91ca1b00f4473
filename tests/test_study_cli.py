"""The study tools' command lines (`python -m study MODE ...`), as strict as the trainer's: a
mistake is one line on stderr and exit status 2, before anything is traced, compiled, replayed or
measured, and nothing is written; the saved HLO step-times reads is whole or refused."""

import os
import types
from pathlib import Path

import pytest

from configs import ASYNC_LIMIT, LHS
from model import deepseek
from runtime import checkpoints
from study import cli
from study.bench import checkpoint_costs, cpu_step, gpu_check, proxy_step
from study.compiling import compile_table, fit_table, step_times
from study.__main__ import main as study_main

FIXTURE_HLO = Path(__file__).resolve().parent / "fixtures" / "addressing" / "jax-0.10.2.hlo"
# What each mode and tool calls to trace, compile, replay or measure.
ENTRY_POINTS = {cli.memory_plan: ["full_scale"], cli: ["compile_row", "compile_only"],
                cli.placements: ["run_search"], step_times: ["compile_row", "predict"],
                compile_table: ["compile_row"],
                proxy_step: ["matmul_ceiling", "step_time", "in_a_fresh_process"],
                cpu_step: ["prepared", "matmul_ceiling"],
                gpu_check: ["check_gradients", "measure_rows", "check_nvfp4"],
                fit_table: ["fit_row"], checkpoint_costs: ["save_and_restore", "mean_step_s"]}


class Reached(Exception):
    """Raised where a test lets a tool get to: its checks passed."""


@pytest.fixture
def unbuilt(monkeypatch, tmp_path):
    """Every entry point raises, so a check that comes after one fails the test; the test runs
    in tmp_path, so whatever a tool writes where it was started lands there."""
    def compiled(*args, **kwargs):
        raise AssertionError("compiled before checking")

    for module, names in ENTRY_POINTS.items():
        for name in names:
            monkeypatch.setattr(module, name, compiled)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def files(folder: Path) -> dict:
    return {p: p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


def refused(args: list[str], folder: Path, capsys) -> str:
    """The one error line `python -m study ARGS` gives, asserted to be one line and status 2
    with nothing under `folder` changed."""
    before = files(folder)
    code = study_main(args)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    assert files(folder) == before
    return err.removeprefix("error: ").strip()


OUT = "out_dir=OUT"  # out_dir=tmp_path, where the mode or tool takes key=value words
MISTAKES = {
    "step-times: --hlo without its folder": (["step-times", "--hlo"], "--hlo needs DIR"),
    "step-times: a flag is not a row": (["step-times", "--rows"], "unknown flag '--rows'"),
    "step-times: a key=value word": (["step-times", "llama405b-offload", "device=h200"],
                                     "step-times takes no key=value words, got 'device=h200'"),
    "step-times: a second row misspelt": (["step-times", "llama405b-offload", "llama405b-ofload"],
                                          "unknown experiment 'llama405b-ofload'"),
    "compile-table: a second row misspelt": (
        ["compile-table", "llama405b-offload", "llama405b-ofload", OUT],
        "unknown experiment 'llama405b-ofload'"),
    "compile-table: an override the second row cannot take": (
        ["compile-table", "deepseek671b-offload", "llama405b-offload",
         "placement.moe_layers.moe_mlpwi_0=offload", OUT],
        "placement.moe_layers.moe_mlpwi_0: the model has no layer scan 'moe_layers'"),
    "compile-table: a flag": (["compile-table", "--all"], "unknown flag '--all'"),
    "bench: steps not a number": (["bench", "llama405b-offload", "steps=five", OUT],
                                  "steps='five': expected int"),
    "bench: steps out of range": (["bench", "llama405b-offload", "steps=0", OUT],
                                  "steps=0 must be >= 1"),
    "bench: unknown experiment": (["bench", "llama405b-ofload", OUT],
                                  "unknown experiment 'llama405b-ofload'"),
    "bench: an unknown key": (["bench", "llama405b-offload", "stepz=3", OUT],
                              "unknown key 'stepz'"),
    "cpu-step: no steps": (["cpu-step", "steps=0"],
                           "'steps=0': cpu-step takes steps=N and rounds=N (whole numbers >= 1)"),
    "cpu-step: a key it does not take": (
        ["cpu-step", "seq=64"],
        "'seq=64': cpu-step takes steps=N and rounds=N (whole numbers >= 1)"),
    "cpu-step: a profile it has not": (
        ["cpu-step", "profile=2"],
        "'profile=2': cpu-step takes steps=N and rounds=N (whole numbers >= 1) and profile=0|1"),
    "checkpoint-bench: a key it does not take": (
        ["checkpoint-bench", "llama405b-offload", "seq=64"],
        "checkpoint-bench: unknown key 'seq'; it takes steps"),
    "checkpoint-bench: one step": (["checkpoint-bench", "llama405b-offload", "steps=1"],
                                   "steps=1: checkpoint-bench needs 2 or more"),
    "checkpoint-bench: a second row misspelt": (
        ["checkpoint-bench", "llama405b-offload", "llama405b-ofload"],
        "unknown experiment 'llama405b-ofload'"),
    "gpu-check: an unknown flag": (["gpu-check", "--smok"], "unknown flag '--smok'"),
    "gpu-check: the flag it lost": (["gpu-check", "--row", "llama405b-offload"],
                                    "unknown flag '--row'"),
    "gpu-check: an experiment": (["gpu-check", "llama405b-offload"],
                                 "unexpected word 'llama405b-offload'"),
    "gpu-check: a key but out_dir": (["gpu-check", "steps=3"],
                                     "gpu-check takes out_dir= only, got 'steps=3'"),
    "fit: an unknown GPU": (["fit", "llama405b-offload", "device=tpu"],
                            "device='tpu': choose one of gb200, b200, h200, h100"),
    "fit: no GPUs": (["fit", "llama405b-offload", "gpus=0"],
                     "gpus='0': expected a whole number of GPUs, at least 1"),
    "fit: a count of no machine in its list": (["fit", "gpus=3"], "no machine of 1 x h100"),
    "fit: a row misspelt": (["fit", "llama405b-offload", "llama405b-ofload"],
                            "unknown experiment 'llama405b-ofload'"),
    "fit: a flag": (["fit", "--all"], "unknown flag '--all'"),
    "search: a plot value outside its choice": (
        ["search", "llama405b-offload", "search.plot=no", OUT],
        "search.plot='no': choose one of auto, off"),
    "search: workers neither auto nor a count": (
        ["search", "llama405b-offload", "search.workers=all", OUT],
        "search.workers='all': expected auto or a whole number"),
    "compile: a boolean XLA flag's value": (
        ["compile", "llama405b-offload", f"xla_flags.{LHS}=on", OUT],
        f"xla_flags.{LHS}='on': expected true or false"),
    "compile: an integer XLA flag's value": (
        ["compile", "llama405b-offload", f"xla_flags.{ASYNC_LIMIT}=eight", OUT],
        f"xla_flags.{ASYNC_LIMIT}='eight': expected a whole number"),
    "compile: an empty out_dir": (["compile", "llama405b-offload", "out_dir="],
                                  "out_dir='': name the folder"),
    "plan: the key before preset=": (
        ["plan", "llama405b-offload", "policy=qkv_offload", OUT],
        "unknown key 'policy': it is preset= now (preset=qkv_offload)"),
    "plan: another family's preset": (
        ["plan", "llama405b-offload", "preset=dsv3_offload", OUT],
        "preset=dsv3_offload places layer scans this model does not have (dense_layers, "
        "moe_layers); its presets: remat, minimal, qkv_offload, minimal_offloaded, none"),
    "plan: a tag another scan has": (
        ["plan", "deepseek671b-offload", "placement.dense_layers.moe_mlpwi_0=offload", OUT],
        "placement.dense_layers.moe_mlpwi_0: the model has no tag 'moe_mlpwi_0' there; tags of "
        f"dense_layers: {', '.join(deepseek.SCANS['dense_layers'])}"),
}


@pytest.mark.parametrize("args, said", MISTAKES.values(), ids=MISTAKES.keys())
def test_a_mistake_is_one_line_before_any_compile(args, said, unbuilt, capsys):
    args = [a.replace("OUT", str(unbuilt)) for a in args]
    assert said in refused(args, unbuilt, capsys)


@pytest.mark.parametrize("text", ["", FIXTURE_HLO.read_text()[:9000],
                                  FIXTURE_HLO.read_text().partition("ENTRY")[0], "not HLO\n"],
                         ids=["empty", "cut in a line", "cut before its entry", "not HLO"])
def test_a_damaged_saved_hlo_is_one_line_naming_the_file(text, unbuilt, capsys):
    saved = unbuilt / "hlo" / "llama405b-offload.hlo"
    saved.parent.mkdir()
    saved.write_text(text)
    said = refused(["step-times", "--hlo", str(saved.parent), "llama405b-offload"], unbuilt,
                   capsys)
    assert said.startswith(f"{saved}: ")


def test_a_hlo_folder_that_is_a_file_is_one_line(unbuilt, capsys):
    (unbuilt / "hlo").write_text("a file")
    said = refused(["step-times", "--hlo", str(unbuilt / "hlo" / "x")], unbuilt, capsys)
    assert said == f"--hlo {unbuilt}/hlo/x: {unbuilt}/hlo is a file, not a folder"


def test_a_whole_saved_hlo_is_replayed_not_compiled(unbuilt, monkeypatch):
    saved = unbuilt / "llama405b-offload.hlo"
    saved.write_text(FIXTURE_HLO.read_text())

    def replayed(name, text, *args, **kwargs):
        assert (name, text) == ("llama405b-offload", saved.read_text())
        raise Reached

    monkeypatch.setattr(step_times, "predict", replayed)
    with pytest.raises(Reached):
        study_main(["step-times", "--hlo", str(unbuilt), "llama405b-offload"])


def test_saved_hlo_is_written_whole_or_not_at_all(unbuilt, monkeypatch):
    """A write interrupted before the rename leaves no file under the row's name (the next run
    compiles the row again); one that completes leaves the whole text."""
    text = FIXTURE_HLO.read_text()
    monkeypatch.setattr(step_times, "compile_row",
                        lambda setup, gpu: types.SimpleNamespace(hlo=text))
    saved = unbuilt / "hlo" / "llama405b-offload.hlo"
    rename = os.replace

    def interrupted(source, target):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        step_times.compiled_hlo("llama405b-offload", saved.parent)
    assert not saved.exists()
    monkeypatch.setattr(os, "replace", rename)
    assert step_times.compiled_hlo("llama405b-offload", saved.parent) == text
    assert step_times.read_saved(saved) == text


@pytest.mark.parametrize("mode", ["compile", "search"])
def test_the_out_dir_check_looks_for_no_checkpoint(mode, unbuilt, monkeypatch):
    """compile and search neither resume nor checkpoint: resume= and a checkpoint_dir that holds
    a run's checkpoints are no reason to refuse them (a run would refuse both here)."""
    def looked(*args, **kwargs):
        raise AssertionError("looked for a checkpoint")

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(checkpoints, "find", looked)
    monkeypatch.setattr(cli, "compile_row", reached)
    monkeypatch.setattr(cli.placements, "run_search", reached)
    (unbuilt / "checkpoints" / "1").mkdir(parents=True)
    with pytest.raises(Reached):
        study_main([mode, "llama405b-offload", "resume=latest",
                    f"checkpoint_dir={unbuilt}/checkpoints", f"out_dir={unbuilt}"])


@pytest.mark.gpu_compile
def test_another_xla_flags_value_is_one_line_when_xla_parses_it(tmp_path, capsys):
    """A flag whose type configs does not know is typed by XLA, when it parses the compile's
    options (before it compiles): one line too, after the step is traced."""
    args = ["compile", "llama8b-offload", "model.n_layers=1",
            "xla_flags.xla_gpu_enable_highest_priority_async_stream=on", f"out_dir={tmp_path}"]
    assert refused(args, tmp_path, capsys) == (
        "xla_flags: INVALID_ARGUMENT: While setting option "
        "xla_gpu_enable_highest_priority_async_stream, 'on' is not a valid bool value.")
