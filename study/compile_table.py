"""Every full-scale study row compiled for its GPUs without a GPU, one markdown table.

    python -m study compile-table [EXPERIMENT ...] [key=value ...]

Each row goes through `runtime_setup.build` on compile-only devices, as `make compile-ROW` does:
XLA's per-device memory of the compiled step beside the static plan, the study's figure where
it gives one, and whether the step fits the memory JAX takes of the GPU.
"""

import time

import configs
from runtime import backend
from runtime import setup as runtime_setup
from study.compile_only import compile_only, pool_bytes
from study.compiled import compile_row
from study.gpus import GPUS

GiB = 2**30
ROWS = [*configs.COMPARISONS["llama405b-compare"], *configs.COMPARISONS["deepseek671b-compare"],
        "deepseek671b-device-mb8"]
# The study's GPU memory per device, where it reports one (docs/study.md): DeepSeek-V3 with
# offload + LHS + pipelined transfers, and the same without LHS and pipelining.
STUDY_GIB = {"deepseek671b-offload": 165.2, "deepseek671b-offload-nolhs": 145.6}


def row(name: str, overrides: list[str], targets: dict) -> list[str]:
    started = time.perf_counter()
    setup = runtime_setup.resolve(name, overrides, full=True)
    run = setup.run
    key = (run.device, run.mesh.devices)
    if key not in targets:
        targets[key] = compile_only(GPUS[key[0]], key[1])
    built = compile_row(setup, targets[key])
    compiled = built.compiled_memory()
    static = built.full_plan
    usable = pool_bytes(GPUS[run.device])
    study = STUDY_GIB.get(name)
    return [name, f"{compiled.arguments / GiB:.1f}", f"{compiled.temporaries / GiB:.1f}",
            f"{compiled.device / GiB:.1f}", f"{static.peak_estimate / GiB:.1f}",
            f"{static.peak_estimate / compiled.device - 1:+.0%}",
            "-" if study is None else f"{study:.1f}",
            f"{compiled.host / GiB:.1f}", f"{static.host_activations / GiB:.1f}",
            "fits" if compiled.device <= usable else "DOES NOT FIT",
            f"{built.built.compile_s:.0f}", f"{time.perf_counter() - started:.0f}"]


def main(argv: list[str]) -> int:
    names = [a for a in argv if "=" not in a] or ROWS
    overrides = [a for a in argv if "=" in a]
    header = ["row", "arguments", "temporaries", "device total", "static plan", "plan vs compiled",
              "study", "host", "plan host", "verdict", "compile s", "all s"]
    print(f"GiB per device; {backend.memory_fraction()[1]}={backend.memory_fraction()[0]:g} "
          f"of each GPU's memory for XLA's pool")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    targets: dict = {}
    for name in names:
        print("| " + " | ".join(row(name, overrides, targets)) + " |", flush=True)
    return 0

