"""The fit scale on GPUs this machine lacks: what a run of a study row finds on them.

    python -m study fit [ROW ...] [device=KIND] [gpus=N] [key=value ...] [preset=auto]

For each row (a comparison stands for its rows; none: the study's nine) and each machine (1 x
H100, 1 x H200, 8 x H100, 8 x H200, 4 x GB200: one NVL72 tray; `device=` and `gpus=` pick
some), the fit the trainer's search finds there (runtime/fit.py) with programs compiled for
compile-only GPUs: the layer count and what else it reduced, the chosen program's device and
host bytes against the budget a run there has, one more layer's, and the replay of that
program on that GPU (study/timing/replay.py). Compiled without autotuning
(study/hardware/compile_only.py): a real GPU's programs differ by the kernels it picks. With
preset=auto, after each fit, the candidates a run's preset=auto compiles there (runtime/auto.py)
and which fit: a real GPU then times those that do.
"""

import dataclasses

import configs
from configs import ConfigError
from offload import activations
from runtime import auto, backend
from runtime import fit as fits
from runtime.own_program import GiB
from runtime.setup import Setup, resolve, with_state
from study import command_line
from study.timing import predicted_step
from study.hardware.compile_only import compile_only, host_limit, kernel_checks, pool_bytes
from study.compiling.compiled_row import compile_row
from study.hardware.gpus import GPUS, Gpu

USAGE = "fit [ROW ...] [device=KIND] [gpus=N] [key=value ...]"
ROWS = (*configs.COMPARISONS["llama405b-compare"], *configs.COMPARISONS["deepseek671b-compare"],
        "deepseek671b-device-mb8")
MACHINES = (("h100", 1), ("h200", 1), ("h100", 8), ("h200", 8), ("gb200", 4))
COLUMNS = ("row", "machine", "layers", "also reduced", "device GiB (budget)",
           "host GiB (budget)", "one more layer", "replayed step", "search")


def machine_budget(gpu: Gpu, gpus: int, fit_memory: float) -> fits.Budget:
    """A run's budget on `gpus` of `gpu`, one process per host (study/hardware/gpus.py: GPUs and
    memory per host), its pinned host limit as a run there sets it
    (study/hardware/compile_only.py)."""
    return fits.budget(fit_memory, pool_bytes(gpu), host_limit(gpu, gpus),
                       min(gpu.per_host, gpus))


def fitted(name: str, args: list[str], gpu: Gpu, gpus: int):
    """(the fit, its program compiled: a CompiledRow) a run of `name` finds on `gpus`
    compile-only `gpu`s; FitError where nothing fits."""
    target = compile_only(gpu, gpus)
    setup = resolve(name, [*args, "scale=fit"], target.devices)

    def measure(words: dict):
        model, run = configs.apply_overrides(setup.model, setup.run, words)
        candidate = dataclasses.replace(setup, model=model, run=run)  # (the scans are kept)
        row = compile_row(candidate, gpu, target)
        return row.compiled_memory(), row

    data, fsdp, expert = setup.run.mesh.shape(gpus)
    return fits.search(setup.model, setup.run, machine_budget(gpu, gpus, setup.run.fit_memory),
                       measure, {w.partition("=")[0] for w in args}, fsdp * expert, True,
                       setup.experiment.model.n_layers)


def fit_row(name: str, args: list[str], gpu: Gpu, gpus: int) -> tuple[list[str], Setup | None]:
    """One line of the table, `name` fitted to `gpus` compile-only `gpu`s, and the fit's setup
    (None: nothing fits)."""
    machine = f"{gpus} x {gpu.name}"
    try:
        fit, row = fitted(name, args, gpu, gpus)
    except fits.FitError as e:
        return [name, machine, "does not fit", str(e), "", "", "", "", ""], None
    over = fit.over
    return [name, machine, f"{fit.layers} of {row.setup.experiment.model.n_layers}",
            "; ".join(fit.reductions()) or "-",
            f"{fit.memory.device / GiB:.1f} ({fit.budget.device / GiB:.1f})",
            f"{fit.memory.host / GiB:.1f} ({fit.budget.host / GiB:.1f})",
            "none to add" if over is None else
            f"does not fit: {over.device / GiB:.1f} GiB, host {over.host / GiB:.1f}",
            replayed(row.setup, row.hlo, gpu, gpus),
            fit.found().removeprefix("found in ")], dataclasses.replace(row.setup, fit=fit)


def candidate_lines(setup: Setup, gpu: Gpu, gpus: int) -> list[str]:
    """preset=auto's candidates at `setup`'s fit, each compiled for the compile-only GPUs, and
    whether it is within the budget (a run there times those that are)."""
    target = compile_only(gpu, gpus)

    def measure(candidate: auto.Candidate):
        row = compile_row(dataclasses.replace(setup, run=with_state(setup.run, candidate),
                                              placement=candidate.placement), gpu, target)
        return row.compiled_memory(), row.program
    budget = machine_budget(gpu, gpus, setup.run.fit_memory)
    lines = [f"preset=auto at {setup.fit.layers} layers on {gpus} x {gpu.name} (budget "
             f"{budget.device / GiB:.1f} GiB per device, {budget.host / GiB:.1f} host):",
             "| candidate | device GiB | host GiB | within the budget |", "|---|---|---|---|"]
    try:
        with kernel_checks(target):  # the candidates' traces too see the GPU's cuDNN
            rows, _ = auto.compiled(setup, budget, measure, lambda line: print(line, flush=True))
    except fits.FitError as e:
        return [*lines[:1], str(e)]
    return lines + [f"| {r.candidate.name} | {r.memory.device / GiB:.1f} | "
                    f"{r.memory.host / GiB:.1f} | {'yes' if r.fits else 'no'} |" for r in rows]


def replayed(setup: Setup, compiled_hlo: str, gpu: Gpu, gpus: int) -> str:
    """The replay of a fit's program on its GPU: step time, TFLOP/s per GPU by MaxText's
    formula for the model that ran, each precision class's rate and where it comes from."""
    experiment = dataclasses.replace(setup.experiment, model=setup.model, run=setup.run)
    p = predicted_step.of_experiment(experiment, compiled_hlo, gpu, gpus)
    return (f"{p.result.step_s:.2f} s, {p.tflops:,.0f} TFLOP/s "
            f"({predicted_step.efficiency_words(p)})")


def machines(device: str, gpus: str) -> list[tuple[Gpu, int]]:
    """The machines `device=` and `gpus=` pick (both: that one; neither: MACHINES)."""
    if device and device not in GPUS:
        raise ConfigError(f"device={device!r}: choose one of {', '.join(GPUS)}")
    if gpus and not (configs.whole(gpus) and int(gpus) >= 1):
        raise ConfigError(f"gpus={gpus!r}: expected a whole number of GPUs, at least 1")
    if device and gpus:
        return [(GPUS[device], int(gpus))]
    return [(GPUS[d], n) for d, n in MACHINES
            if (not device or d == device) and (not gpus or n == int(gpus))]


def main(argv: list[str]) -> int:
    _, names, words = command_line.tool_words(USAGE, argv, {}, keys=True)
    study = {w.partition("=")[0]: w.partition("=")[2] for w in words
             if w.startswith(("device=", "gpus="))}
    if other := [w for w in words if w.startswith("scale=") and w != "scale=fit"]:
        raise ConfigError(f"{other[0]}: python -m study fit compiles the fit scale only "
                          "(scale=fit, or no scale= word)")
    args = [w for w in words if not w.startswith(("device=", "gpus=", "scale="))]
    chosen = machines(study.get("device", ""), study.get("gpus", ""))
    if not chosen:
        raise ConfigError(f"no machine of {', '.join(f'{n} x {d}' for d, n in MACHINES)} is "
                          f"{study.get('gpus')} x {study.get('device', 'any')}: give both")
    for name in names or ROWS:  # every row's words checked before anything compiles
        for gpu, gpus in chosen:
            resolve(name, [*args, "scale=fit"], compile_only(gpu, gpus).devices)
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS), flush=True)
    candidates = f"preset={activations.AUTO}" in args
    for name in names or ROWS:
        for gpu, gpus in chosen:
            line, setup = fit_row(name, args, gpu, gpus)
            print("| " + " | ".join(line) + " |", flush=True)
            if candidates and setup is not None:
                print("\n".join(candidate_lines(setup, gpu, gpus)), flush=True)
    print(f"(budgets: XLA's pool less {fits.MARGIN:.0%}; pinned host memory as a run sets it, "
          f"{backend.HOST_LIMIT_VARIABLE} = 3/4 of the host's memory, less {fits.MARGIN:.0%}; "
          f"at least {fits.PER_SCAN} layers per scan: runtime/fit.py)")
    return 0
