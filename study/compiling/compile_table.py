"""Every full-scale study row compiled for its GPUs without a GPU, one markdown table.

    python -m study compile-table [EXPERIMENT ...] [key=value ...]

Each row is built on compile-only devices (study/compiling/compiled_row.py, as `make
compile-ROW` does): XLA's memory per device beside the static plan and the study's figure; does
it fit JAX's pool?
"""

import time

import configs
from runtime import backend
from runtime.own_program import GiB
from study import command_line
from study.hardware.compile_only import pool_bytes
from study.compiling.compiled_row import compile_row

ROWS = [*configs.COMPARISONS["llama405b-compare"], *configs.COMPARISONS["deepseek671b-compare"],
        "deepseek671b-device-mb8"]
# The study's GPU memory per device, where it reports one (docs/study.md): DeepSeek-V3 with
# offload + LHS + pipelined transfers, and the same without LHS and pipelining.
STUDY_GIB = {"deepseek671b-offload": 165.2, "deepseek671b-offload-nolhs": 145.6}


def row(setup, gpu) -> list[str]:
    started = time.perf_counter()
    built = compile_row(setup, gpu)
    compiled, static = built.compiled_memory(), built.full_plan
    name = setup.experiment.name
    study = STUDY_GIB.get(name)
    return [name, f"{compiled.arguments / GiB:.1f}", f"{compiled.temporaries / GiB:.1f}",
            f"{compiled.device / GiB:.1f}", f"{static.peak_estimate / GiB:.1f}",
            f"{static.peak_estimate / compiled.device - 1:+.0%}",
            "-" if study is None else f"{study:.1f}",
            f"{compiled.host / GiB:.1f}", f"{static.host_activations / GiB:.1f}",
            "fits" if compiled.device <= pool_bytes(built.gpu) else "DOES NOT FIT",
            f"{built.program.compile_s:.0f}", f"{time.perf_counter() - started:.0f}"]


def main(argv: list[str]) -> int:
    _, names, overrides = command_line.tool_words(
        "compile-table [EXPERIMENT ...] [key=value ...]", argv, {}, keys=True)
    # Every row resolved (checked whole) before the first compiles.
    setups = [command_line.study_setup(name, overrides) for name in names or ROWS]
    header = ["row", "arguments", "temporaries", "device total", "static plan", "plan vs compiled",
              "study", "host", "plan host", "verdict", "compile s", "all s"]
    fraction, variable = backend.memory_fraction()
    print(f"GiB per device; {variable}={fraction:g} of each GPU's memory for XLA's pool")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for setup, gpu in setups:
        print("| " + " | ".join(row(setup, gpu)) + " |", flush=True)
    return 0
