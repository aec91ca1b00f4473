"""The study's rows replayed from their compiled GPU programs, against the study's throughput.

    python -m study step-times [--hlo DIR] [EXPERIMENT ...]

Each row is compiled for its GPUs on compile-only devices (or its optimized HLO read from
DIR/<row>.hlo, written there by an earlier run with --hlo), its step replayed
(study/timing/replay.py) and compared with the study: TFLOP/s/device per row, the study's ratios
(a hit within 3 points), what-ifs, and the efficiency fit of study/hardware/gpus.py (each
precision class on its FIT_ON row).
"""

import dataclasses
import os
import time
from pathlib import Path

import configs
from configs import STUDY_TFLOPS, ConfigError
from runtime import checkpoints
from runtime import setup as runtime_setup
from study import command_line
from study.programs import hlo
from study.timing import predicted_step
from study.compiling.compiled_row import compile_row
from study.hardware.gpus import gpu_of

USAGE = "step-times [--hlo DIR] [EXPERIMENT ...]"

ROWS = [*configs.COMPARISONS["llama405b-compare"], "llama405b-searched",
        *configs.COMPARISONS["deepseek671b-compare"]]
# What-ifs, each one figure of study/hardware/gpus.py changed: how much of a miss a term explains.
WHAT_IFS = {"one NVLink domain": {"nvlink_domain": 128},
            "host link not shared": {"host_link_gpus": 1}}
# (what, numerator row, denominator row): the study's claims as ratios of its figures.
RATIOS = [("Llama: Q/K/V offload + LHS vs baseline", "llama405b-offload", "llama405b-baseline"),
          ("Llama: offload without LHS vs baseline", "llama405b-offload-nolhs",
           "llama405b-baseline"),
          ("Llama: pipelined vs LHS alone", "llama405b-offload-pipelined", "llama405b-offload"),
          ("DeepSeek: offload + LHS + pipelining vs remat", "deepseek671b-offload",
           "deepseek671b-remat"),
          ("DeepSeek: the same vs offload without LHS/pipelining", "deepseek671b-offload",
           "deepseek671b-offload-nolhs")]
# The one study row each precision class's GEMM efficiency would be fitted on (GB200 only: the
# study measured nothing else): the Llama rows multiply in FP4, DeepSeek's in bf16.
FIT_ON = {"fp4": "llama405b-baseline", "bf16": "deepseek671b-offload"}


def arguments(argv: list[str]) -> tuple[Path | None, list[str], dict[str, str]]:
    """(the --hlo folder, the rows, the saved HLO of each row that has one), every word checked
    and every saved file read before anything is compiled."""
    flags, names, _ = command_line.tool_words(USAGE, argv, {"--hlo": "DIR"})
    hlo_dir = Path(flags["--hlo"]) if "--hlo" in flags else None
    if hlo_dir:
        checkpoints.check_folder(f"--hlo {hlo_dir}", str(hlo_dir))
    names = names or ROWS
    saved = {name: read_saved(hlo_dir / f"{name}.hlo") for name in names
             if hlo_dir and (hlo_dir / f"{name}.hlo").exists()}
    return hlo_dir, names, saved


def read_saved(path: Path) -> str:
    """A saved HLO module, whole: XLA prints the entry computation last, so a file cut short
    anywhere (a write interrupted before writes were atomic) has none."""
    try:
        text = path.read_text()
        module = hlo.parse_module(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable HLO module ({e}); delete it to compile the "
                          "row again") from None
    if not module.scheduled or not any(c.entry for c in module.computations.values()):
        raise ConfigError(f"{path}: not a whole scheduled HLO module (cut short?); delete it to "
                          "compile the row again")
    return text


def compiled_hlo(name: str, hlo_dir: Path | None) -> str:
    """The row compiled; its HLO saved in `hlo_dir` if given, whole or not at all: written to a
    temporary file beside it, then renamed (an interrupted write leaves only the temporary)."""
    text = compile_row(runtime_setup.resolve(name, [], full=True), gpu_of(name)).hlo
    if hlo_dir:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        temporary = hlo_dir / f".{name}.hlo.{os.getpid()}.tmp"  # (one per process)
        temporary.write_text(text)
        os.replace(temporary, hlo_dir / f"{name}.hlo")
    return text


def predict(name: str, text: str, efficiency=None, **changes) -> predicted_step.StepPrediction:
    experiment = configs.get(name)
    gpu = dataclasses.replace(gpu_of(name), **changes)
    return predicted_step.of_experiment(experiment, text, gpu, experiment.run.mesh.devices,
                                        efficiency=efficiency)


def fit(cls: str, name: str, text: str) -> str:
    """Bisect the class's efficiency in (0, 1] until the row replays at the study's figure."""
    gpu = gpu_of(name)
    target = STUDY_TFLOPS[name]
    at = lambda share: predict(name, text, {**gpu.efficiency, cls: share}).tflops  # noqa: E731
    peak = at(1.0)
    if peak < target:
        return (f"{cls} on {name}: cannot be fitted: at 100% of peak the replay gives "
                f"{peak:,.0f} TFLOP/s/device, below the study's {target:,.0f}")
    low, high = 0.01, 1.0
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (low, middle) if at(middle) > target else (middle, high)
    return f"{cls} on {name}: {high:.3f} of peak reproduces {target:,.0f} TFLOP/s/device"


def main(argv: list[str]) -> int:
    hlo_dir, names, texts = arguments(argv)
    found = {}
    print("| row | replayed step s | TFLOP/s/device | study | vs study | exposed collectives s "
          "| exposed host s | critical | GEMM PFLOP | compile + replay s |")
    print("|" + "---|" * 10)
    for name in names:
        started = time.perf_counter()
        if name not in texts:
            texts[name] = compiled_hlo(name, hlo_dir)
        p = found[name] = predict(name, texts[name])
        r, study = p.result, p.study_tflops
        host = r.exposed["to host"] + r.exposed["from host"]
        print(f"| {name} | {r.step_s:.2f} | {p.tflops:,.0f} | "
              f"{'-' if study is None else f'{study:,.0f}'} | "
              f"{'-' if study is None else f'{p.tflops / study - 1:+.0%}'} | "
              f"{r.exposed['collectives']:.2f} | {host:.2f} | {r.critical()} | "
              f"{' '.join(f'{k} {v / 1e15:.1f}' for k, v in sorted(r.flops.items()))} | "
              f"{time.perf_counter() - started:.0f} |", flush=True)
    print(f"\nGEMM rates: {predicted_step.efficiency_words(found[names[0]])}")
    print("\n| the study's claim | study | replayed | within 3 points |\n|---|---|---|---|")
    for what, top, bottom in RATIOS:
        if top in found and bottom in found:
            study = STUDY_TFLOPS[top] / STUDY_TFLOPS[bottom]
            ours = found[top].tflops / found[bottom].tflops
            words = (lambda x: f"{x:.3f}x") if study > 1.2 else (lambda x: f"{x - 1:+.1%}")
            print(f"| {what} | {words(study)} | {words(ours)} | "
                  f"{'yes' if abs(ours - study) <= 0.03 else 'MISS'} |")
    print("\nwhat-ifs (TFLOP/s/device with one figure changed):")
    for label, changes in WHAT_IFS.items():
        figures = [f"{n} {predict(n, texts[n], **changes).tflops:,.0f}" for n in names]
        print(f"  {label}: " + ", ".join(figures))
    print("\nefficiency fits (study/hardware/gpus.py takes a figure only where a fit succeeds):")
    for cls, name in FIT_ON.items():
        if name in texts:
            print(f"  {fit(cls, name, texts[name])}")
    return 0

