"""The command line: bad input is one line and exit status 2 before anything is compiled or
written, whatever the word or flag; the list, the exit statuses, the comparisons' mechanics."""

import dataclasses
import subprocess
import sys
import types
import typing
from pathlib import Path

import numpy as np
import pytest

import configs
import train
from configs.checks import RANGES
from model.config import DeepSeekConfig, LlamaConfig
from runtime import comparison
from conftest import SMALL, run_cli
from study import cli as study_cli
from study.__main__ import main as study_main


def _corrupt_checkpoint(tmp_path: Path) -> str:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    config = Path("tests/fixtures/llama_gqa/config.json").read_text()
    (directory / "config.json").write_text(config)
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    return str(directory)


BAD_INPUT = {
    "unknown experiment": ["llama9b"],
    "unknown key": ["llama405b-offload", "stepz=3"],
    "unknown nested key": ["llama405b-offload", "optimizer.beta=3"],
    "wrong type": ["llama405b-offload", "steps=ten"],
    "not key=value": ["llama405b-offload", "steps"],
    "heads not divisible": ["llama405b-offload", "model.n_kv_heads=3"],
    "sequence past RoPE table": ["llama405b-offload", "seq=200000"],
    "batch not divisible": ["llama405b-offload", "global_batch=12"],
    "mesh does not cover devices": ["llama405b-offload", "mesh.fsdp=3"],
    "a width the mesh does not divide": ["llama405b-offload", "quant=none", "model.d_model=260"],
    "unknown tag": ["llama405b-offload", "placement.qkv_proj=offload"],
    "bad placement": ["llama405b-offload", "placement.query_proj=disk"],
    "unknown preset": ["llama405b-offload", "preset=everything"],
    "placement without a preset": ["llama405b-offload", "preset=none",
                                   "placement.query_proj=offload"],
    "full scale on a CPU": ["llama405b-offload", "scale=full"],
    "bad dtype": ["llama405b-offload", "compute_dtype=int8"],
    "missing token file": ["llama405b-offload", "data.path=/nonexistent/tokens.bin"],
    "missing checkpoint": ["llama405b-offload", "init_from=/nonexistent/ckpt"],
    "no data axis": ["llama405b-offload", "mesh.data=0"],
    "negative batch": ["llama405b-offload", "global_batch=-8"],
    "not a finite number": ["llama405b-offload", "optimizer.lr=nan"],
    "bad optimizer range": ["llama405b-offload", "optimizer.b1=1.5"],
    "bad rope scaling": ["llama405b-offload", "model.rope_scaling.low_freq_factor=0"],
    "cudnn on a CPU": ["llama405b-offload", "attention=cudnn"],
    "no dense layer": ["deepseek671b-offload", "model.n_dense_layers=0"],
    "v wider than q/k": ["deepseek671b-offload", "model.v_head_dim=64"],
    "bad yarn": ["deepseek671b-offload", "model.rope_scaling.beta_slow=0"],
    "placement for a missing scan": ["llama405b-offload", "placement.moe_layers.mla_q=offload"],
    "wrong family's checkpoint": ["deepseek671b-offload", "init_from=tests/fixtures/llama_gqa"],
    "width NVFP4 cannot block": ["llama405b-offload", "model.d_ff=1000"],
    "unknown NVFP4 tiles": ["llama405b-offload", "quant_tiles=8x8"],
    "unknown quantization": ["llama405b-offload", "quant=int4"],
    "experts not divisible": ["deepseek671b-offload", "mesh.expert=8", "mesh.fsdp=1",
                              "model.n_experts=12", "model.n_groups=4"],
    "expert axis on a dense model": ["llama405b-offload", "mesh.expert=2", "mesh.fsdp=4"],
    "expert axis not dividing the devices": ["deepseek671b-offload", "mesh.expert=3"],
    "expert axis below one": ["deepseek671b-offload", "mesh.expert=0"],
    "negative expert capacity": ["deepseek671b-offload", "expert_capacity=-1"],
    "negative seed": ["llama405b-offload", "seed=-1"],
    "seed past numpy's range": ["llama405b-offload", f"seed={2**64}"],
    "negative checkpoint interval": ["llama405b-offload", "checkpoint_every=-1"],
    "negative router bias rate": ["deepseek671b-offload", "router_bias_rate=-0.01"],
    "negative balance loss weight": ["deepseek671b-offload", "balance_loss_weight=-1"],
    "negative yarn mscale": ["deepseek671b-offload", "model.rope_scaling.mscale=-1"],
    "fsdp neither -1 nor positive": ["llama405b-offload", "mesh.fsdp=-2"],
    "no checkpoint kept": ["llama405b-offload", "keep=0"],
    "negative warmup": ["llama405b-offload", "optimizer.warmup_steps=-1"],
    # Words and flags the command line does not use:
    "a stray word": ["llama405b-offload", "offload"],
    "an unknown flag": ["llama405b-offload", "--plann"],
    "a mode of the study tools": ["llama405b-offload", "--plan"],
    "two modes": ["llama405b-offload", "--plan", "--compile"],
    "an unknown first flag": ["--verbose"],
    "--list with more": ["--list", "llama405b-offload"],
    "export with an unknown key": ["export", "runs/x", "hf_dir=y", "format=gguf"],
    # The fit scale's words:
    "scale=fit on a CPU without a budget": ["llama405b-offload", "scale=fit"],
    "a budget at proxy scale": ["llama405b-offload", "fit_memory=10"],
    "a negative budget": ["llama405b-offload", "scale=fit", "fit_memory=-1"],
    "init_from at fit scale": ["llama405b-offload", "scale=fit", "fit_memory=10",
                               "init_from=tests/fixtures/llama_gqa"],
    "fit without an experiment": ["fit"],
    # preset=auto's:
    "no steps to time": ["llama405b-offload", "preset=auto", "auto_steps=0"],
    "a budget without auto or fit": ["llama405b-offload", "preset=remat", "fit_memory=1"],
    "fit of an unknown experiment": ["fit", "llama9b"],
}


@pytest.mark.parametrize("args", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_is_one_line_and_status_2(args, tmp_path, capsys):
    code, out, err = run_cli(args, tmp_path, capsys)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())  # stopped before any run folder was made


# The study tools' command line (python -m study MODE EXPERIMENT ...): the same rule.
STUDY_BAD_INPUT = {
    "no mode": [],
    "unknown mode": ["train", "llama405b-offload"],
    "no experiment": ["plan"],
    "a flag for an experiment": ["plan", "--list"],
    "unknown experiment": ["compile", "llama9b"],
    "not key=value": ["plan", "llama405b-offload", "steps"],
    "a flag after the experiment": ["plan", "llama405b-offload", "--compile"],
    "unknown tag": ["plan", "llama405b-offload", "placement.qkv_proj=offload"],
    "expert axis below one, planned": ["plan", "deepseek671b-offload", "mesh.expert=0"],
    "negative expert axis, compiled": ["compile", "deepseek671b-offload", "mesh.expert=-8"],
    "unknown search option": ["search", "llama405b-offload", "search.nope=1"],
}


@pytest.mark.parametrize("args", STUDY_BAD_INPUT.values(), ids=STUDY_BAD_INPUT.keys())
def test_bad_study_input_is_one_line_and_status_2(args, tmp_path, capsys):
    code = study_main([*args, f"out_dir={tmp_path}"] if args[1:] else args)
    out, err = capsys.readouterr()
    assert code == 2
    if args:
        assert err.startswith("error: ") and err.count("\n") == 1, err
    else:  # the usage, as train.py prints it with no arguments
        assert err == "" and out.startswith("The study tools")
    assert not list(tmp_path.iterdir())  # stopped before any run folder was made


# The fit on GPUs this machine lacks (python -m study fit): bad input is one line naming it,
# before anything compiles (what most of them say needs the compile-only GPUs).
FIT_BAD_INPUT = {
    "a GPU count the layer width does not divide": (
        ["device=h100", "gpus=3"], "error: the mesh (data=1 x fsdp=3 x expert=1) does not fit "
        "the model: embed: its embed axis of 16384 does not divide over fsdp x expert = 3"),
    "GPUs that do not fill their hosts": (
        ["device=gb200", "gpus=6"], "error: gpus=6: gb200 GPUs come 4 to a host"),
    "digits int does not read": (["device=h100", "gpus=\u00b2"], "error: gpus='\u00b2': expected"),
    "another scale for the fit": (["device=h100", "gpus=1", "scale=huge"],
                                  "error: scale=huge: python -m study fit compiles the fit scale"),
    "dense layers that leave the MoE scan too few": (
        ["device=h100", "gpus=1", "model.n_dense_layers=60"],
        "error: model.n_dense_layers=60 leaves fewer than 2 of the 61 layers to the MoE scan"),
}


@pytest.mark.gpu_compile
@pytest.mark.parametrize("args, says", FIT_BAD_INPUT.values(), ids=FIT_BAD_INPUT.keys())
def test_bad_fit_input_is_one_line_naming_it(args, says, tmp_path, capsys):
    name = "deepseek671b-offload" if "model.n_dense_layers=60" in args else "llama405b-offload"
    code = study_main(["fit", name, *args, f"out_dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith(says) and err.count("\n") == 1, err
    assert "|" not in out  # no table begun
    assert not list(tmp_path.iterdir())


def test_a_plan_of_preset_auto_says_why_not(tmp_path, capsys):
    """preset=auto is chosen by timing programs on a run's devices: a plan is told to name a
    preset, not that `auto` is unknown while it lists `auto`."""
    code = study_main(["plan", "llama405b-offload", "preset=auto", f"out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: preset=auto is chosen by timing compiled "
                                        "candidates") and "auto" not in err.rpartition(":")[2]


@pytest.mark.parametrize("mode", ["plan", pytest.param("fit", marks=pytest.mark.gpu_compile)])
def test_a_host_limit_int_does_not_read_is_one_line(mode, monkeypatch, tmp_path, capsys):
    """XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB set in the shell to what is not a whole number of GiB:
    the study tools say so in one line, as train.py does."""
    from runtime import backend
    monkeypatch.setenv(backend.HOST_LIMIT_VARIABLE, "64GB")
    monkeypatch.setattr(backend, "HOST_LIMIT_GIVEN", True)
    machine = ["device=h100", "gpus=1"] if mode == "fit" else []
    code = study_main([mode, "llama405b-offload", *machine, f"out_dir={tmp_path}"])
    assert (code, capsys.readouterr().err) == (2, (
        f"error: {backend.HOST_LIMIT_VARIABLE}='64GB': expected a whole number of GiB\n"))


@pytest.mark.parametrize("flag, mode", [("--plan", "plan"), ("--compile", "compile"),
                                        ("--search", "search")])
def test_the_study_modes_of_train_py_say_where_they_went(flag, mode, tmp_path, capsys):
    code, out, err = run_cli(["llama405b-offload", flag, "steps=2"], tmp_path, capsys)
    assert code == 2 and out == "" and err == (
        f"error: {flag} is a study tool now: python -m study {mode} llama405b-offload "
        "[key=value ...]\n")


def _numeric_fields(cls, prefix: str = ""):
    """The dotted paths of the int and float fields (None allowed, bool not) of config
    dataclass `cls` and of the config groups it nests, read off their type hints."""
    for name, kind in typing.get_type_hints(cls).items():
        options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
        for option in options:
            if dataclasses.is_dataclass(option):
                yield from _numeric_fields(option, f"{prefix}{name}.")
            elif option in (int, float):
                yield prefix + name


def test_every_numeric_field_has_a_range():
    """A numeric run field added without a declared range (configs.checks.RANGES), or a range
    for a field that is gone, fails here; the model's fields are the model's to check (below)."""
    fields = set(_numeric_fields(configs.RunConfig))
    assert "optimizer.b1" in fields  # nested groups
    assert fields == set(RANGES)


MODEL_FIELDS = sorted({*_numeric_fields(LlamaConfig, "model."),
                       *_numeric_fields(DeepSeekConfig, "model.")})
# Each model field's values out of its range: 0 and below, but for YaRN's mscales, which take 0
# (Hugging Face's default, as none does).
TAKES_ZERO = {"model.rope_scaling.mscale", "model.rope_scaling.mscale_all_dim"}


@pytest.mark.parametrize("key", MODEL_FIELDS)
def test_each_model_field_out_of_its_range_is_one_line(key):
    """The model's own problems() checks every number it has, its groups' too: each just
    outside its range is one line, `model.<field>=<value> must be ...`, and nothing else."""
    assert "model.rope_scaling.mscale" in MODEL_FIELDS and "model.q_lora_rank" in MODEL_FIELDS
    for value in (-1,) if key in TAKES_ZERO else (0, -1):
        found = _with(key, value)
        assert len(found) == 1 and found[0].startswith(f"{key}=") and " must be " in found[0], (
            value, found)


def test_a_model_field_message():
    assert _with("model.n_heads", 0) == ["model.n_heads=0 must be > 0"]
    assert _with("model.rope_scaling.mscale", -1) == [
        "model.rope_scaling.mscale=-1.0 must be >= 0 (0 or none: Hugging Face's default)"]


# Values each declared range refuses, and the values at its edges, which it takes (by its words).
OUTSIDE = {"> 0": (0, -1), ">= 0": (-1,), ">= 1": (0,), "in [0, 1)": (-0.1, 1),
           "in [0, 1]": (-0.1, 1.5), "in [0, 2**63)": (-1, 2**63), "-1 or >= 1": (0, -2)}
EDGE = {"> 0": (1e-9,), ">= 0": (0,), ">= 1": (1,), "in [0, 1)": (0, 0.999),
        "in [0, 1]": (0, 1), "in [0, 2**63)": (0, 2**63 - 1), "-1 or >= 1": (-1, 1)}


def _with(key: str, value) -> list[str]:
    """configs.problems of a sound proxy run with `key` set to `value` (DeepSeek's, or Llama's
    for a field only Llama has) on 8 devices, or on those a mesh spelled out takes."""
    for name in ("deepseek671b-offload", "llama405b-offload"):
        model, run = configs.get(name).at_scale("proxy")
        has = model if key.startswith("model.") else run
        for part in key.split(".")[key.startswith("model."):]:
            has = getattr(has, part, None)
        if has is not None:
            model, run = configs.apply_overrides(model, run, {key: str(value)})
            return configs.problems(model, run, run.mesh.devices if run.mesh.fsdp > 0 else 8)
    raise AssertionError(f"no experiment has {key}")


@pytest.mark.parametrize("key", RANGES)
def test_each_field_out_of_its_range_is_reported(key):
    """Every run field, just outside its declared range, is refused first in the one form
    `key=value must be RANGE`."""
    rule = RANGES[key]
    for value in OUTSIDE[str(rule).partition(" (")[0]]:
        found = _with(key, value)
        said = [line for line in found if line.startswith(f"{key}=")
                and line.endswith(f" must be {rule}")]
        assert said and found[0] == said[0], found


def test_the_range_message_form():
    assert _with("router_bias_rate", -0.01) == ["router_bias_rate=-0.01 must be >= 0"]
    assert _with("balance_loss_weight", -1) == ["balance_loss_weight=-1.0 must be >= 0"]


# What the values meant before the table, written out apart from it: taken, and refused.
TAKEN = [("global_batch", 0), ("checkpoint_every", 0), ("mesh.fsdp", -1), ("expert_capacity", 0),
         ("seed", 0), ("seed", 2**63 - 1), ("optimizer.min_lr_ratio", 0),
         ("optimizer.min_lr_ratio", 1), ("optimizer.b1", 0), ("optimizer.b2", 0.999),
         ("optimizer.warmup_steps", 0), ("optimizer.weight_decay", 0), ("router_bias_rate", 0),
         ("balance_loss_weight", 0), ("model.rope_scaling.mscale", 0),
         ("model.q_lora_rank", None), ("eval_every", 0)]
REFUSED = [("mesh.expert", 0), ("mesh.data", 0), ("mesh.fsdp", 0), ("seed", 2**63),
           ("optimizer.b1", 1), ("optimizer.b2", 1), ("optimizer.min_lr_ratio", 1.01),
           ("optimizer.lr", 0), ("optimizer.clip_norm", 0), ("keep", 0), ("steps", 0),
           ("per_device_batch", 0), ("loss_chunks", 0), ("eval_batches", 0)]


@pytest.mark.parametrize(("key", "value"), TAKEN + REFUSED)
def test_the_ranges_keep_their_meaning(key, value):
    assert (_with(key, value) == []) == ((key, value) in TAKEN)


@pytest.mark.parametrize("key", RANGES)
def test_each_run_field_at_the_edge_of_its_range_is_taken(key):
    """The values with a meaning (global_batch=0, checkpoint_every=0, mesh.fsdp=-1,
    expert_capacity=0, the last numpy seed, b1=0, min_lr_ratio=1, ...) are accepted."""
    for value in EDGE[str(RANGES[key]).partition(" (")[0]]:
        assert _with(key, value) == [], value


def test_output_folder_is_checked_before_compiling(tmp_path, capsys, monkeypatch):
    """compile and search (its picture) write into out_dir: one that is a file, or lies
    under one, is one line and exit status 2 before anything is traced or compiled, and the
    file is left as it was."""
    a_file = tmp_path / "runs"
    a_file.write_text("results")

    def never(*args, **kwargs):
        raise AssertionError("compiled or searched before out_dir was checked")

    for name in ("compile_row", "compile_only"):
        monkeypatch.setattr(study_cli, name, never)
    monkeypatch.setattr(study_cli.placements, "run_search", never)
    for mode in ("compile", "search"):
        for out_dir in (a_file, a_file / "sub"):
            code = study_main([mode, "llama405b-offload", f"out_dir={out_dir}"])
            err = capsys.readouterr().err
            assert code == 2 and err == (f"error: out_dir={out_dir}: {a_file} is a file, not a "
                                         "folder\n")
    assert [p.name for p in tmp_path.iterdir()] == ["runs"] and a_file.read_text() == "results"


def _plan(device: str, capsys) -> list[str]:
    assert study_main(["plan", "llama405b-offload", f"device={device}"]) == 0
    return capsys.readouterr().out.splitlines()


def test_plan_says_whether_it_fits_as_compile_does(capsys):
    """The plan's verdict in the study compile's words: FITS on GB200s (well inside JAX's pool),
    DOES NOT FIT on H100s (well past it)."""
    fits = [line for line in _plan("gb200", capsys) if "FIT" in line]
    assert len(fits) == 1 and fits[0].startswith("FITS: ") and "planned (estimate) of" in fits[0]
    fits = [line for line in _plan("h100", capsys) if "FIT" in line]
    assert len(fits) == 1 and fits[0].startswith("DOES NOT FIT: ")


def test_plan_says_what_nvfp4_runs_as_on_the_gpu(capsys):
    """Only Blackwell (compute capability 10) multiplies in FP4; an H200 quantizes and
    dequantizes the weights and multiplies in the compute dtype."""
    (line,) = [line for line in _plan("h200", capsys) if line.startswith("weights as NVFP4")]
    assert "FP4 tensor cores (the" not in line
    assert ("NVFP4 values (16x16 tiles) for every GEMM of the layer matrices, multiplied in the "
            "compute dtype: the same numbers, no FP4 speed-up (the h200 (compute capability "
            "9.0) has no FP4 tensor cores)") in line
    (line,) = [line for line in _plan("gb200", capsys) if line.startswith("weights as NVFP4")]
    assert ("NVFP4: every GEMM of the layer matrices on FP4 tensor cores (the gb200's)"
            in line)


def test_bad_files_are_one_line_and_status_2(tmp_path, capsys):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")  # 1.5 uint16 tokens
    too_big = tmp_path / "big.bin"
    np.array([1, 2, 60000], np.uint16).tofile(too_big)
    short = tmp_path / "short.bin"
    np.arange(10, dtype=np.uint16).tofile(short)
    late = tmp_path / "late.bin"
    np.concatenate([np.zeros(3_000_000, np.uint16), [600]]).astype(np.uint16).tofile(late)
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "config.json").write_text("[1, 2]")
    for args in (["data.path=" + str(odd)], ["data.path=" + str(too_big)],
                 ["data.path=" + str(short)], ["data.path=" + str(late)],
                 ["init_from=" + _corrupt_checkpoint(tmp_path)], ["init_from=" + str(listed)]):
        code, _, err = run_cli(["llama405b-offload", *SMALL, *args], tmp_path / "out", capsys)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert not (tmp_path / "out").exists()  # nothing written


def test_exit_status_from_a_real_process(tmp_path):
    result = subprocess.run([sys.executable, "train.py", "llama405b-offload", "model.n_kv_heads=3",
                             f"out_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: model.n_heads=16 is not divisible by model.n_kv_heads=3"]


def test_list_names_every_experiment(capsys):
    assert train.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == [*configs.EXPERIMENTS, *configs.COMPARISONS]


def test_a_comparisons_table_sets_each_row_against_the_first_beside_the_studys_ratio(
        tmp_path, capsys):
    """The table from the rows' config.json and summary.json (as their processes wrote them):
    each row's throughput over the first row's, beside the study's (docs/study.md: 2,746 and
    2,669 TFLOP/s for the offload row and the baseline); on a CPU one line says which rows
    run one program there (host placements dropped, XLA flags not applied)."""
    def row(name: str, preset: str, flags: dict, tflops: float, placement: str) -> dict:
        return {"experiment": name, "scale": "fit", "devices": "8 x cpu", "platform": "cpu",
                "model": {"n_layers": 5}, "placement": {"layers": {"query_proj": placement}},
                "run": {"preset": preset, "xla_flags": flags, "out_dir": "runs"},
                "summary": {"median_step_s": 1 / tflops, "tflops_per_device": tflops,
                            "peak_device_bytes": None, "compiled_host_bytes": 2**30,
                            "recomputed_flops_per_device": 0.5e12}}

    rows = [row("llama405b-baseline", "remat", {configs.LHS: "true"}, 2.0, "remat"),
            row("llama405b-offload", "qkv_offload", {configs.LHS: "true"}, 2.5, "offload"),
            row("llama405b-offload-nolhs", "qkv_offload", {configs.LHS: "false"}, 1.0,
                "offload")]
    comparison.table("llama405b-compare", rows, tmp_path)
    out = capsys.readouterr().out
    lines = (tmp_path / "compare.csv").read_text().splitlines()
    assert lines[0].split(",")[4:8] == ["step ms", "TFLOP/s/device", "vs first",
                                        "study: vs first"]
    assert [line.split(",") for line in lines[1:]] == [
        ["llama405b-baseline", "remat", "true", "false", "500.0", "2.000", "1.000", "1.000",
         "n/a", "1.00", "0.5"],
        ["llama405b-offload", "qkv_offload", "true", "false", "400.0", "2.500", "1.250",
         "1.029", "n/a", "1.00", "0.5"],
        ["llama405b-offload-nolhs", "qkv_offload", "false", "false", "1000.0", "1.000",
         "0.500", "0.963", "n/a", "1.00", "0.5"]]
    assert "llama405b-compare (fit scale, 8 x cpu):" in out
    assert "llama405b-offload = llama405b-offload-nolhs run one program here" in out
    assert (tmp_path / "compare.md").read_text() in out


def test_a_comparison_plans_compiles_and_searches_each_of_its_rows(monkeypatch):
    shown = []
    for mode in ("plan", "compile", "search"):
        monkeypatch.setattr(study_cli, mode, lambda name, args: shown.append((name, args)))
        assert study_main([mode, "llama405b-compare", "steps=2"]) == 0
    assert shown == [(name, ["steps=2"])
                     for name in configs.COMPARISONS["llama405b-compare"]] * 3


def test_plan_command_rejects_bad_input(capsys):
    assert study_main(["plan", "llama405b-offload", "placement.nothing=offload"]) == 2
    assert capsys.readouterr().err.startswith("error: placement.nothing")
    assert study_main(["plan", "llama405b-offload", "model.d_ff=1000"]) == 2
    assert capsys.readouterr().err.startswith("error: quant=nvfp4: NVFP4 needs axis")


def test_bad_search_option_is_one_line_and_status_2(capsys):
    assert study_main(["search", "llama405b-offload", "search.top=many"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "search.top" in err[0]
    assert study_main(["search", "llama405b-offload", "search.nope=1"]) == 2


def test_overrides_are_typed_by_their_field():
    """Numbers, booleans, nested groups, maps, and an optional group turned off."""
    experiment = configs.get("llama405b-offload")
    model, run = configs.apply_overrides(experiment.model, experiment.run, {
        "steps": "7", "profile": "true", "optimizer.lr": "0.5", "mesh.fsdp": "4",
        "xla_flags.xla_gpu_enable_latency_hiding_scheduler": "false",
        "placement.layers.mlpwo": "offload", "model.rope_scaling": "none"})
    assert (run.steps, run.profile, run.optimizer.lr, run.mesh.fsdp) == (7, True, 0.5, 4)
    assert run.xla_flags["xla_gpu_enable_latency_hiding_scheduler"] == "false"
    assert run.tag_changes == {"layers.mlpwo": "offload"} and model.rope_scaling is None


def test_an_empty_out_dir_is_one_line(tmp_path, capsys, monkeypatch):
    """out_dir= (what an unset shell variable gives) would write the run's folder into the
    current folder: one line and status 2, before anything is built."""
    def never(*args, **kwargs):
        raise AssertionError("trained with an empty out_dir")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "train", never)
    assert train.main(["llama405b-offload", "out_dir="]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out_dir='': ") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())
