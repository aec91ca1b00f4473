"""The study's per-experiment modes (`python -m study plan|compile|search EXPERIMENT`): full scale
by the trainer's settings (runtime/setup.py) on any machine, writing only where a run would; and
the command line of the study's other tools (`tool_words`)."""

import dataclasses
import time
from collections.abc import Mapping

import jax

import configs
from configs import ConfigError
from runtime import checkpoints, header, report
from runtime.setup import Setup, resolve
from study import plan as plans, predicted, search_report
from study.compile_only import DEVICELESS, compile_only
from study.compiled import compile_row
from study.gpus import Gpu, gpu_of


def study_setup(name: str, args: list[str]) -> tuple[Setup, Gpu]:
    """The experiment's full-scale settings (the trainer's `resolve`) and the GPU it is studied
    on: its own, or `device=NAME` (a word of the study tools, not of a run)."""
    devices = [a.partition("=")[2] for a in args if a.startswith("device=")]
    gpu = gpu_of(name, devices[-1] if devices else "")
    return resolve(name, [a for a in args if not a.startswith("device=")], full=True), gpu


def tool_words(usage: str, argv: list[str], flags: Mapping[str, str | None], names: bool = True,
               keys: bool = False) -> tuple[dict, list[str], list[str]]:
    """(the flags given -> their value, True for one that takes none; the experiments, a
    comparison as its rows; the key=value words) of a tool's command line, every word checked
    before the tool traces or compiles anything. `usage`: its words after `python -m study`;
    `flags`: those it takes -> what each takes after it (None: nothing)."""
    given, found, words, rest = {}, [], [], iter(argv)
    for word in rest:
        if word.startswith("-"):  # a flag, never an experiment
            if word not in flags:
                raise ConfigError(f"unknown flag {word!r}; usage: python -m study {usage}")
            if flags[word] is None:
                given[word] = True
            elif (value := next(rest, "")) and not value.startswith("-"):
                given[word] = value
            else:
                raise ConfigError(f"{word} needs {flags[word]} after it; usage: python -m study "
                                  f"{usage}")
        else:
            (words if "=" in word else found).append(word)
    if found and not names:
        raise ConfigError(f"unexpected word {found[0]!r}; usage: python -m study {usage}")
    if words and not keys:
        raise ConfigError(f"{usage.split()[0]} takes no key=value words, got {words[0]!r}; "
                          f"usage: python -m study {usage}")
    configs.parse_overrides(words)  # each word key=value
    for name in found:
        if name not in configs.COMPARISONS:
            configs.get(name)
    return given, [row for n in found for row in configs.COMPARISONS.get(n, (n,))], words


def check_out_dir(setup: Setup) -> None:
    """out_dir checked as a run checks it (checkpoints.check_outputs), before anything is traced or
    compiled; not checkpoint_dir or resume: these modes neither checkpoint nor resume."""
    run = dataclasses.replace(setup.run, checkpoint_dir="", resume="")
    checkpoints.check_outputs(setup.model, run, "", 0)


def plan(name: str, args: list[str]) -> None:
    """The experiment's full-scale memory plan and placement list (overrides applied)."""
    setup, gpu = study_setup(name, args)
    started = time.perf_counter()
    memory_plan = plans.full_scale(setup.experiment, gpu, setup.placement)
    print("\n".join(plans.plan_lines(name, setup.run, gpu, memory_plan)))
    print(f"(planned in {time.perf_counter() - started:.1f} s from abstract values: nothing "
          "allocated; offloads read from the step exported for a GPU)")


def compile(name: str, args: list[str]) -> None:
    """The experiment's full-scale step compiled for its GPUs (`device`) on compile-only devices,
    as a run would (the trainer's `build`): XLA's memory beside the plan, and the step replayed."""
    setup, gpu = study_setup(name, args)
    check_out_dir(setup)
    row = compile_row(setup, gpu)
    run, target = setup.run, row.program.target
    print(f"compiled: {name} at full scale for {target.description}, compile-only, "
          f"topology {gpu.topology(len(target.devices))}, mesh {dict(row.mesh.shape)}, "
          f"{header.model_line(setup.model)}; in {row.program.compile_s:.1f} s")
    deviceless = " ".join(f"{k}={v}" for k, v in DEVICELESS.items())
    print(f"xla flags: {header.flags_line(run, target)} (compile-only devices also set "
          f"{deviceless}: study/compile_only.py); kernels: "
          f"{row.program.options.describe(hasattr(row.program.model, 'n_experts'))}")
    print("\n".join(plans.plan_lines(name, run, gpu, row.full_plan)))
    compiled = row.compiled_memory()
    print("\n".join(plans.compiled_lines(compiled, row.full_plan, gpu, row.arrived)))
    prediction = predicted.of_experiment(setup.experiment, row.hlo, gpu, len(target.devices),
                                         keep_slices=True,
                                         device_ids=[d.id for d in row.mesh.devices.flat])
    print("\n".join(predicted.lines(prediction)))
    print(predicted.exchange_line(prediction.exchanges))
    if jax.process_index() == 0:
        folder = report.new_run_dir(run.out_dir, f"{name}-compile")
        predicted.write(prediction, compiled, row.full_plan, folder, name)
        print(f"wrote {folder}/compiled.json and {folder}/timeline.json (a Perfetto trace: "
              "ui.perfetto.dev)")


def search(name: str, args: list[str]) -> None:
    """The experiment's placements ranked by predicted memory and step time on its `device`;
    `search.verify=N` compiles the best N and the model's rows, ranked by their replay."""
    args, options = search_report.split_options(args)
    setup, gpu = study_setup(name, args)
    if options["plot"] != "off":
        check_out_dir(setup)
    result = search_report.run_search(setup.experiment, gpu, options, time.perf_counter)
    print("\n".join(search_report.report_lines(result, int(options["top"]))))
    if options["plot"] != "off" and jax.process_index() == 0:  # one picture per launch
        print(search_report.write_plot(result, setup.run.out_dir))
    if not (verify := int(options["verify"])):
        return
    target = compile_only(gpu, setup.run.mesh.devices)
    args = [a for a in args if not a.startswith("device=")]  # the rows' GPU is `gpu`
    rows = {tuple(search_report.run_overrides(p, setup.model)) for p in result.rows}
    todo = [(p, name, [*args, *search_report.run_overrides(p, setup.model)])
            for p in result.ranked[:verify]
            if tuple(search_report.run_overrides(p, setup.model)) not in rows]  # one compile each
    todo += [(p, p.candidate.row, []) for p in result.rows]
    found = []
    for prediction, experiment, overrides in todo:
        row = compile_row(resolve(experiment, overrides, full=True), gpu, target)
        what = experiment if prediction.candidate.row else " ".join(overrides[len(args):])
        replayed = predicted.of_experiment(row.setup.experiment, row.hlo, gpu, len(target.devices))
        found.append(search_report.Verified(prediction, row.compiled_memory(), replayed, what))
    print("\n".join(search_report.verified_lines(found, result.hw.capacity)))
