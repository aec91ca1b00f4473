"""Train a Llama or DeepSeek-V3 decoder with a per-tensor activation placement policy.

    python train.py EXPERIMENT [key=value ...]             run an experiment (see --list)
    python train.py EXPERIMENT --plan [key=value ...]      its full-scale memory plan
    python train.py EXPERIMENT --compile [key=value ...]   its full-scale step compiled for its
                                                           GPUs (device=...), without a GPU
    python train.py EXPERIMENT --search [key=value ...]    placements ranked by predicted memory
                                                           and step time (search_report.py)
    python train.py --list                                 the experiments, one line each
    python train.py export CHECKPOINT hf_dir=DIR [dtype=bfloat16]
                                                           trained weights as a Hugging Face
                                                           checkpoint (config.json + safetensors)

Resolve (config, scale, policy, data: any mistake is one line and exit status 2) -> build
(mesh, the step compiled ahead of time for the target: this machine's devices or compile-only
GPUs) -> sharded init -> loop -> report.
"""

from runtime import backend  # noqa: F401  (first: it settles the platform, GPU memory and XLA flags)

import dataclasses
import signal
import sys
import time

import jax

import configs
from analysis import plan, predicted, search_report
from configs import ConfigError
from configs.gpus import GPUS
from hf.safetensors import CheckpointError
from model import families
from runtime import checkpoints, distributed, report
from runtime.data import DataError
from runtime.setup import Setup, build, check_addressing, global_batch, resolve, start_state
from trainer.target import Target, compile_only, this_machine


def train(setup: Setup, target: Target) -> dict | None:
    """Run the experiment; its summary (with `stopped_by` when a signal ended it early), or
    None when the loss stopped being finite."""
    run, devices = setup.run, len(target.devices)
    with checkpoints.StopRequests() as stop:  # from the start: a signal while compiling counts
        state, done = start_state(setup, target)
        built = build(setup, target)
        check_addressing(built)
        run_dir = report.RunDir.create(setup)
        run_dir.write("config.json", {
            "experiment": setup.experiment.name, "scale": setup.scale,
            "model": dataclasses.asdict(setup.model), "run": dataclasses.asdict(run),
            "policy": setup.tables})
        batch_size = run.batch(devices)
        flops = families.of(setup.model).training_flops(setup.model, batch_size / devices,
                                                        run.seq)
        report.print_header(setup, built, batch_size, flops, run_dir, first_step=done + 1)
        log = report.StepLog(setup, built, run_dir, batch_size, flops, first_step=done + 1)
        saver = checkpoints.Saver(run_dir.checkpoints, run.keep, run.checkpoint_every)
        try:
            last = loop(setup, built, state, done, log, saver, stop)
        finally:
            saver.close()
    if last is None:
        return None
    stopped = stop.signal if last < run.steps else None  # on the last step it stops nothing
    if saver.saved:
        report.say(report.checkpoint_line(setup, run_dir, saver.saved[-1], stopped))
    return {**log.summary(), **({"stopped_by": stopped.name} if stopped else {})}


def loop(setup: Setup, built, state, done: int, log, saver, stop) -> int | None:
    """Steps done+1.. to the last, or to a stop request: each step dispatched, then the
    previous one's metrics read (the host runs a step ahead), a checkpoint where one is due
    (its step's loss read first: only a finite state is saved), then the stop. The last step
    done, or None when the loss stopped being finite."""
    run, sharding = setup.run, built.rules.sharding(("batch", None))
    batch_size = run.batch(len(built.target.devices))
    batch = global_batch(setup, done, sharding, batch_size)
    unread = None  # (step, metrics): dispatched, not read yet
    for step in range(done + 1, run.steps + 1):
        log.starting(step)
        state, metrics = built.compiled(state, batch)
        stopping = stop.reached(step)
        if step < run.steps and not stopping:
            batch = global_batch(setup, step, sharding, batch_size)
        if unread and not log.finished(*unread):
            return None
        unread = (step, metrics)
        if stopping or saver.due(step, run.steps):
            if not log.finished(*unread):
                return None
            unread = None
            saver.save(step, state, checkpoints.run_meta(step, setup, batch_size))
        if stopping:
            return step
    return run.steps if unread is None or log.finished(*unread) else None


def check_out_dir(setup: Setup) -> None:
    """out_dir for a mode that writes into it (`--compile`, `--search`'s picture), checked as
    a run checks it (checkpoints.check_outputs), before anything is traced or compiled. These
    modes neither checkpoint nor resume: checkpoint_dir and resume are not theirs to check."""
    run = dataclasses.replace(setup.run, checkpoint_dir="", resume="")
    checkpoints.check_outputs(dataclasses.replace(setup, run=run), 0)


def print_plan(name: str, args: list[str]) -> None:
    """The experiment's full-scale memory plan and placement list (overrides applied)."""
    setup = resolve(name, args, full=True)
    started = time.perf_counter()
    memory_plan = plan.full_scale(setup.experiment, setup.tables)
    print("\n".join(plan.plan_lines(name, setup.run, memory_plan)))
    print(f"(planned in {time.perf_counter() - started:.1f} s from abstract values: nothing "
          "allocated; offloads read from the step exported for a GPU)")


def print_compile(name: str, args: list[str]) -> None:
    """The experiment's full-scale step compiled for its GPUs (`device`) on compile-only
    devices, through `build` as a run on them would: XLA's memory beside the static plan, and
    the step's time replayed from the compiled schedule (into a run folder: compiled.json,
    timeline.json)."""
    setup = resolve(name, args, full=True)
    check_out_dir(setup)
    run = setup.run
    gpu = GPUS[run.device]
    target = compile_only(gpu, run.mesh.devices)
    built = build(setup, target)
    print(f"compiled: {name} at full scale for {target.description}, topology "
          f"{gpu.topology(len(target.devices))}, mesh {dict(built.mesh.shape)}, "
          f"{report.model_line(setup.model)}; in {built.compile_s:.1f} s")
    print(f"xla flags: {report.flags_line(run, target)}; kernels: "
          f"{report.kernels_line(setup.model, run, target)}")
    print("\n".join(plan.plan_lines(name, run, built.full_plan)))
    compiled = built.compiled_memory()
    print("\n".join(plan.compiled_lines(compiled, built.full_plan, gpu)))
    flops = families.of(setup.model).training_flops(setup.model, run.per_device_batch, run.seq)
    prediction = predicted.predict(built.compiled.as_text(), gpu, len(target.devices), flops,
                                   configs.STUDY_TFLOPS.get(name), keep_slices=True,
                                   device_ids=[d.id for d in built.mesh.devices.flat])
    print("\n".join(predicted.lines(prediction)))
    print(predicted.exchange_line(prediction.exchanges))
    if jax.process_index() == 0:
        folder = report.new_run_dir(run.out_dir, f"{name}-compile")
        predicted.write(prediction, compiled, built.full_plan, folder, name)
        print(f"wrote {folder}/compiled.json and {folder}/timeline.json (a Perfetto trace: "
              "ui.perfetto.dev)")


def print_search(name: str, args: list[str]) -> None:
    """The experiment's placements ranked by predicted memory and step time on its `device`;
    `search.verify=N` compiles the best N and the model's registered rows for those GPUs
    through `build` and ranks them by the replay of their compiled programs."""
    args, options = search_report.split_options(args)
    setup = resolve(name, args, full=True)
    if options["plot"] != "off":
        check_out_dir(setup)
    result = search_report.run_search(setup.experiment, options, time.perf_counter)
    print("\n".join(search_report.report_lines(result, int(options["top"]))))
    if options["plot"] != "off" and jax.process_index() == 0:  # one picture per launch
        print(search_report.write_plot(result, setup.run.out_dir))
    if not (verify := int(options["verify"])):
        return
    gpu, run = GPUS[setup.run.device], setup.run
    target = compile_only(gpu, run.mesh.devices)
    rows = {tuple(search_report.run_overrides(p, setup.model)) for p in result.rows}
    todo = [(p, name, [*args, *search_report.run_overrides(p, setup.model)])
            for p in result.ranked[:verify]
            if tuple(search_report.run_overrides(p, setup.model)) not in rows]  # one compile each
    todo += [(p, p.candidate.row, [f"device={gpu.name}"]) for p in result.rows]
    found = []
    for prediction, experiment, overrides in todo:
        row = resolve(experiment, overrides, full=True)
        built = build(row, target)
        flops = families.of(row.model).training_flops(row.model, row.run.per_device_batch,
                                                       row.run.seq)
        replayed = predicted.predict(built.compiled.as_text(), gpu, len(target.devices), flops,
                                     configs.STUDY_TFLOPS.get(experiment))
        what = experiment if prediction.candidate.row else " ".join(overrides[len(args):])
        found.append(search_report.Verified(prediction, built.compiled_memory(),
                                            replayed, what))
    print("\n".join(search_report.verified_lines(found, result.hw.capacity)))


def exit_status(summary: dict | None) -> int:
    """0 done; 1 the loss stopped being finite; 128 + the signal's number when stopped by one
    (the shell's convention for a process a signal ended)."""
    if summary is None:
        return 1
    return 128 + signal.Signals[summary["stopped_by"]] if "stopped_by" in summary else 0


def compare(name: str, args: list[str], target: Target) -> int:
    """Run each experiment of a comparison, then print one table of them."""
    for key in ("resume", "checkpoint_dir"):
        if any(a.startswith(key + "=") for a in args):
            raise ConfigError(f"{name} runs several experiments: {key}= is for one of them "
                              f"({', '.join(configs.COMPARISONS[name])})")
    setups = [resolve(experiment, args, target.devices)  # every row checked before any runs
              for experiment in configs.COMPARISONS[name]]
    rows = []
    for setup in setups:
        summary = train(setup, target)
        if status := exit_status(summary):
            return status
        rows.append((setup, summary))
    report.comparison(name, rows)
    return 0


def export(argv: list[str]) -> None:
    """`export CHECKPOINT hf_dir=DIR [dtype=float32|bfloat16]`: the checkpoint's weights as a
    Hugging Face checkpoint."""
    if not argv or "=" in argv[0]:
        raise ConfigError("usage: python train.py export CHECKPOINT hf_dir=DIR "
                          "[dtype=float32|bfloat16]")
    options = configs.parse_overrides(argv[1:])
    if unknown := options.keys() - {"hf_dir", "dtype"}:
        raise ConfigError(f"export: unknown key {sorted(unknown)[0]!r}; it takes hf_dir, dtype")
    written = checkpoints.export(argv[0], options.get("hf_dir", ""),
                                 options.get("dtype", "float32"))
    print(f"exported {argv[0]} to {written[0].parent}: config.json and {len(written)} "
          f"safetensors file(s)")


def list_experiments() -> None:
    width = max(map(len, [*configs.EXPERIMENTS, *configs.COMPARISONS]))
    for name, experiment in configs.EXPERIMENTS.items():
        print(f"{name:<{width}}  {experiment.summary}")
    for name, members in configs.COMPARISONS.items():
        print(f"{name:<{width}}  runs {', '.join(members)}; one table")


MODES = {"--plan": print_plan, "--compile": print_compile, "--search": print_search}


def command(argv: list[str]) -> tuple[str, str | None, list[str]]:
    """(what to do, the experiment or comparison, its key=value words), or ConfigError for a
    word or flag the command line would otherwise ignore."""
    first, rest = argv[0], argv[1:]
    if first in ("-h", "--help", "--list") and rest:
        raise ConfigError(f"{first} takes nothing more, got {' '.join(rest)!r}")
    if first in ("-h", "--help", "--list", "export"):
        return first, None, rest
    if first.startswith("-"):
        raise ConfigError(f"unknown flag {first!r}: the first word names an experiment "
                          "(python train.py --list), export, --list or --help")
    flags = [a for a in rest if a.startswith("-")]
    if unknown := [f for f in flags if f not in MODES]:
        raise ConfigError(f"unknown flag {unknown[0]!r}; the modes are {', '.join(MODES)}")
    if len(flags) > 1:
        raise ConfigError(f"one mode at a time, got {' '.join(flags)}")
    return (flags[0] if flags else "run"), first, [a for a in rest if a not in flags]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip())
        return 2
    try:
        what, name, args = command(argv)
        if what in ("-h", "--help"):
            print(__doc__.strip())
            return 0
        if what == "--list":
            list_experiments()
            return 0
        if what != "export":
            configs.parse_overrides(args)  # a word that is not key=value, before JAX starts
        distributed.initialize()  # before the backend starts: multi-host runs join here
        target = this_machine()  # starts JAX's backend (quietly: runtime/backend.py)
        if what == "export":
            export(args)
        elif what in MODES:
            for member in configs.COMPARISONS.get(name, (name,)):
                MODES[what](member, args)
        elif name in configs.COMPARISONS:
            return compare(name, args, target)
        else:
            return exit_status(train(resolve(name, args, target.devices), target))
        return 0
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C: the checkpoint being written is not complete
        print("error: interrupted by a second Ctrl-C; a checkpoint still being written is "
              "incomplete and is never picked", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
