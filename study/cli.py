"""The study's per-experiment modes (`python -m study plan|compile|search EXPERIMENT`): full scale
by the trainer's settings (runtime/setup.py) on any machine, writing only where a run would."""

import dataclasses
import time

import jax

from runtime import checkpoints, header, report
from runtime.setup import Setup, resolve
from study.command_line import study_setup
from study.compiling.compiled_row import compile_row, host_weight_lines
from study.hardware.compile_only import DEVICELESS, compile_only
from study.plan import memory_plan, printed
from study.search import placements
from study.timing import predicted_step


def check_out_dir(setup: Setup) -> None:
    """out_dir checked as a run checks it (checkpoints.check_outputs), before anything is traced or
    compiled; not checkpoint_dir or resume: these modes neither checkpoint nor resume."""
    run = dataclasses.replace(setup.run, checkpoint_dir="", resume="")
    checkpoints.check_outputs(setup.model, run, "", 0)


def plan(name: str, args: list[str]) -> None:
    """The experiment's full-scale memory plan and placement list (overrides applied)."""
    setup, gpu = study_setup(name, args)
    started = time.perf_counter()
    planned = memory_plan.full_scale(setup.experiment, gpu, setup.placement)
    print("\n".join(printed.plan_lines(name, setup.run, gpu, planned)))
    print(f"(planned in {time.perf_counter() - started:.1f} s from abstract values: nothing "
          "allocated; offloads read from the step exported for a GPU)")


def compile(name: str, args: list[str]) -> None:
    """The experiment's full-scale step compiled for its GPUs (`device`) on compile-only devices,
    as a run would (the trainer's `build`): XLA's memory beside the plan, and the step replayed."""
    setup, gpu = study_setup(name, args)
    check_out_dir(setup)
    row = compile_row(setup, gpu)
    run, target = setup.run, row.program.target
    print(f"compiled: {name} at full scale for {target.description}, "
          f"topology {gpu.topology(len(target.devices))}, mesh {dict(row.mesh.shape)}, "
          f"{header.model_line(setup.model)}; in {row.program.compile_s:.1f} s")
    deviceless = " ".join(f"{k}={v}" for k, v in DEVICELESS.items())
    print(f"xla flags: {header.flags_line(run, target)} (compile-only devices also set "
          f"{deviceless}: study/hardware/compile_only.py); kernels: "
          f"{row.program.options.describe(hasattr(row.program.model, 'n_experts'))}")
    print("\n".join(printed.plan_lines(name, run, gpu, row.full_plan)))
    print("\n".join(host_weight_lines(row.host_weights)))
    compiled = row.compiled_memory()
    print("\n".join(printed.compiled_lines(compiled, row.full_plan, gpu)))
    prediction = predicted_step.of_experiment(setup.experiment, row.hlo, gpu, len(target.devices),
                                              keep_slices=True,
                                              device_ids=[d.id for d in target.devices])
    print("\n".join(predicted_step.lines(prediction)))
    print(predicted_step.exchange_line(prediction.exchanges))
    if jax.process_index() == 0:
        folder = report.new_run_dir(run.out_dir, f"{name}-compile")
        predicted_step.write(prediction, compiled, row.full_plan, folder, name)
        print(f"wrote {folder}/compiled.json and {folder}/timeline.json (a Perfetto trace: "
              "ui.perfetto.dev)")


def search(name: str, args: list[str]) -> None:
    """The experiment's placements ranked by predicted memory and step time on its `device`;
    `search.verify=N` compiles the best N and the model's rows, ranked by their replay."""
    args, options = placements.split_options(args)
    setup, gpu = study_setup(name, args)
    if options["plot"] != "off":
        check_out_dir(setup)
    result = placements.run_search(setup.experiment, gpu, options, time.perf_counter)
    print("\n".join(placements.report_lines(result, int(options["top"]))))
    if options["plot"] != "off" and jax.process_index() == 0:  # one picture per launch
        print(placements.write_plot(result, setup.run.out_dir))
    if not (verify := int(options["verify"])):
        return
    target = compile_only(gpu, setup.run.mesh.devices)
    args = [a for a in args if not a.startswith("device=")]  # the rows' GPU is `gpu`
    rows = {tuple(placements.run_overrides(p, setup.model)) for p in result.rows}
    todo = [(p, name, [*args, *placements.run_overrides(p, setup.model)])
            for p in result.ranked[:verify]
            if tuple(placements.run_overrides(p, setup.model)) not in rows]  # one compile each
    todo += [(p, p.candidate.row, []) for p in result.rows]
    found = []
    for prediction, experiment, overrides in todo:
        row = compile_row(resolve(experiment, overrides, full=True), gpu, target)
        what = experiment if prediction.candidate.row else " ".join(overrides[len(args):])
        replayed = predicted_step.of_experiment(row.setup.experiment, row.hlo, gpu,
                                                len(target.devices))
        found.append(placements.Verified(prediction, row.compiled_memory(), replayed, what))
    print("\n".join(placements.verified_lines(found, result.hw.capacity)))
