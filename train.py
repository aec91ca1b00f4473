"""Train a Llama or DeepSeek-V3 decoder with a per-tensor activation placement.

    python train.py EXPERIMENT [key=value ...]             run an experiment (see --list)
    python train.py --list                                 the experiments, one line each
    python train.py export CHECKPOINT hf_dir=DIR [dtype=bfloat16]
                                                           trained weights as a Hugging Face
                                                           checkpoint (config.json + safetensors)
    python train.py prepare SOURCE ... out=DIR [tokenizer=PATH|bpe:N] [val_fraction=F]
                            [text_field=NAME] [seed=S]     text files, folders or JSONL as
                                                           train.bin/val.bin (docs/data.md)
    python train.py sample RUN [prompt=TEXT] [tokens=N] [temperature=T] [top_k=K] [seed=S]
                                                           text from a run's last checkpoint
    python train.py fit EXPERIMENT [key=value ...]        how many of its layers fit this
                                                           machine (compiled, not run)

A run, a line each in train(): resolve (config, scale, placement, data: any mistake is one line
and exit status 2) -> program (mesh, optimizer; at fit scale, as many of the experiment's
layers as fit this machine; at preset=auto, the fastest placement that fits it) -> compile
(ahead of time, for this machine's devices) -> machine check -> state (sharded init, or a
checkpoint) -> run folder -> header -> loop -> summary. The full-scale plan, GPU compile,
search and step times: python -m study (study/).
"""

from runtime import backend  # (first: it settles the platform, GPU memory and XLA flags)

import math
import signal
import sys

import jax

import configs
from configs import ConfigError
from data import prepare
from data.tokens import DataError
from hf.safetensors import CheckpointError
from runtime import checkpoints, comparison, distributed, header, own_program, report, sample
from runtime.backend import BackendError
from runtime.own_program import size_words
from runtime.report import NonFiniteLoss
from runtime.setup import Setup, check_machine, fitted, program_for, resolve, start_state
from trainer.program import Program
from trainer.target import Target, this_machine


def train(setup: Setup, target: Target) -> dict:
    """Run the experiment, a stage a line: its summary, with `stopped_by` when a signal ended
    it early; NonFiniteLoss for a loss not finite."""
    run = setup.run
    with checkpoints.StopRequests() as stop:  # from the start: a signal while compiling counts
        setup, program = program_for(setup, target)  # the layers that fit; preset=auto's pick
        program.compile_run(evaluation=bool(run.eval_every))
        readings = own_program.read(program)
        check_machine(program, offloads=bool(readings.offloaded))
        state, done = start_state(program, setup)
        run_dir = report.RunDir.create(setup)  # only now: a run that never starts writes nothing
        for name, record in report.records(setup, program).items():
            run_dir.write(name, record)
        report.say("\n".join(header.lines(setup, program, readings, run_dir, done + 1)))
        tensorboard = report.tensorboard(run_dir, run)  # its folder: process 0, if asked for
        log = report.StepLog(run, readings, run_dir, tensorboard, program.batch_size * run.seq,
                             setup.data.unigram_entropy, first_step=done + 1)
        saver = checkpoints.Saver(run_dir.checkpoints, run.keep, run.checkpoint_every)
        try:
            last = loop(program, setup, state, done, log, saver, stop)
        finally:
            saver.close()
            log.close()
    stopped = stop.signal if last < run.steps else None  # on the last step it stops nothing
    if saver.saved:
        report.say(report.checkpoint_line(setup.experiment.name, setup.args, run, run_dir,
                                          saver.saved[-1], stopped))
    return {**log.summary(), "run_dir": run_dir.path,
            **({"stopped_by": stopped.name} if stopped else {})}


def evaluation(program: Program, setup: Setup, params) -> dict[str, float]:
    """The val split's mean loss over its fixed eval_batches batches, and its perplexity."""
    run, size = setup.run, program.batch_size
    loss = program.eval_loss(params, (setup.data.val.eval_batch(i, size, run.seq, run.eval_batches)
                                      for i in range(run.eval_batches)))
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700))}


def loop(program: Program, setup: Setup, state, done: int, log, saver, stop) -> int:
    """Steps done+1.. to the last, or to a stop request; the last step done. The host runs a
    step ahead: each step is dispatched, then the previous one finished (waited for, timed,
    checked, written). Where an evaluation, a checkpoint or the stop is due, the step itself
    is finished first: only a state whose loss is finite is evaluated or saved."""
    run, data, size = setup.run, setup.data, program.batch_size
    clock, profile = report.Clock(), report.Profile(log.run_dir, run.profile, done + 1, run.steps)

    def finish(step: int, metrics, params=None) -> None:
        values = clock.wait(metrics)
        profile.end(step)
        report.check_finite(values["loss"], step, run.steps)
        if params is not None:
            values |= evaluation(program, setup, params)
            clock.restart()  # the evaluation's time is not the next step's
        log.write(step, values)

    tokens, pending = program.batch(data.batch(done, size, run.seq)), None
    for step in range(done + 1, run.steps + 1):
        profile.begin(step)
        state, metrics = program.step(state, tokens)  # dispatched: the host goes on
        stopping = stop.reached(step)
        if step < run.steps and not stopping:
            tokens = program.batch(data.batch(step, size, run.seq))
        if pending:
            finish(*pending)
        pending = (step, metrics)
        evaluating = run.eval_every and (step % run.eval_every == 0 or step == run.steps)
        saving = stopping or saver.due(step, run.steps)
        if evaluating or saving:
            finish(step, metrics, state["params"] if evaluating else None)
            pending = None
        if saving:
            saver.save(step, state, checkpoints.run_meta(step, setup, size))
        if stopping:
            return step
    if pending:
        finish(*pending)
    return run.steps


def exit_status(summary: dict) -> int:
    """0 done; 128 + the signal's number when one stopped the run (the shell's convention)."""
    return 128 + signal.Signals[summary["stopped_by"]] if "stopped_by" in summary else 0


def compare(name: str, args: list[str]) -> int:
    """A comparison's rows, then one table: on one host each row in a process of its own
    (runtime/comparison.py); in a multi-process launch, one after another in these processes."""
    comparison.check_rows(name, args)
    if distributed.detect() is None:
        status, rows, folder = comparison.run_rows(name, args)
        if status == 0:
            comparison.table(name, rows, folder)
        return status
    distributed.initialize()
    target = this_machine()
    setups = [resolve(experiment, args, target.devices)  # every row checked before any runs
              for experiment in configs.COMPARISONS[name]]
    if fits := [s.experiment.name for s in setups if s.scale == "fit"]:
        raise ConfigError(f"{', '.join(fits)} would run at fit scale, which a comparison runs "
                          f"on one host, a process per row; this launch has "
                          f"{jax.process_count()} processes")
    run_dirs = []
    for setup in setups:
        summary = train(setup, target)
        if status := exit_status(summary):
            return status
        run_dirs.append(summary["run_dir"])
    if jax.process_index() == 0:
        comparison.table(name, [comparison.read_row(d) for d in run_dirs],
                         report.new_run_dir(setups[0].run.out_dir, name))
    return 0


def fit(args: list[str], target: Target) -> int:
    """`python train.py fit EXPERIMENT|COMPARISON [key=value ...]`: each row resolved and, at fit
    scale, fitted to this machine (compiled, nothing run or written); for a comparison the fit
    every row fits: each row after the first fitted with the reductions so far, at most as many
    layers as the fit so far."""
    if not args or "=" in args[0]:
        raise ConfigError("usage: python train.py fit EXPERIMENT [key=value ...]")
    name, words, common, most = args[0], args[1:], [], None
    for row in configs.COMPARISONS.get(name, (name,)):
        setup = resolve(row, [*words, *common], target.devices)
        if setup.scale != "fit":
            print(f"{row}: {setup.scale} scale here ({setup.scale_reason}): nothing to fit")
            continue
        setup, _ = fitted(setup, target, most)
        found, most = setup.fit, setup.fit.layers
        common = [w for w in found.word_list() if not w.startswith(("model.n_layers=",
                                                                    "model.n_dense_layers="))]
        print(f"{row}: {found.layers} of {setup.experiment.model.n_layers} layers fit "
              f"{target.description}: {size_words(found.memory.device)} per device, "
              f"{size_words(found.memory.host)} in host memory ({found.found()}): "
              f"{' '.join(found.word_list())}")
    if most and name in configs.COMPARISONS:
        print(comparison.FIT_LINE + " ".join(found.word_list()))
    return 0


def list_experiments() -> None:
    width = max(map(len, [*configs.EXPERIMENTS, *configs.COMPARISONS]))
    for name, experiment in configs.EXPERIMENTS.items():
        print(f"{name:<{width}}  {experiment.summary}")
    for name, members in configs.COMPARISONS.items():
        print(f"{name:<{width}}  runs {', '.join(members)}; one table")


def command(argv: list[str]) -> tuple[str, str | None, list[str]]:
    """(what to do, the experiment or comparison, its key=value words), or ConfigError for a
    word or flag the command line would otherwise ignore."""
    first, rest = argv[0], argv[1:]
    if first in ("-h", "--help", "--list") and rest:
        raise ConfigError(f"{first} takes nothing more, got {' '.join(rest)!r}")
    if first in ("-h", "--help", "--list", "export", "prepare", "sample", "fit"):
        return first, None, rest
    if first.startswith("-"):
        raise ConfigError(f"unknown flag {first!r}: the first word names an experiment "
                          "(python train.py --list), export, prepare, sample, fit, --list or "
                          "--help")
    if flags := [a for a in rest if a.startswith("-")]:
        if flags[0] in ("--plan", "--compile", "--search"):  # modes that moved to study/
            raise ConfigError(f"{flags[0]} is a study tool now: python -m study "
                              f"{flags[0].removeprefix('--')} {first} [key=value ...]")
        raise ConfigError(f"unknown flag {flags[0]!r}: after the experiment come key=value "
                          "words only")
    return "run", first, rest


def main(argv: list[str]) -> int:
    try:
        what, name, args = command(argv or ["--help"])
        if what in ("-h", "--help"):
            print(__doc__.strip())
            return 0 if argv else 2  # no words at all: the usage, as for a mistake
        if what == "--list":
            list_experiments()
            return 0
        if what == "prepare":  # text to tokens: no JAX
            return prepare.main(args)
        if name in configs.COMPARISONS:
            return compare(name, args)
        distributed.initialize()  # before the backend starts: multi-host runs join here
        target = this_machine()  # starts JAX's backend (quietly: runtime/backend.py)
        if what == "export":
            checkpoints.export(args)
            return 0
        if what == "sample":
            return sample.main(args)
        if what == "fit":
            return fit(args, target)
        return exit_status(train(resolve(name, args, target.devices), target))
    except (ConfigError, DataError, CheckpointError, BackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLoss as e:
        print(f"error: {e}; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C: the checkpoint being written is not complete
        print("error: interrupted by a second Ctrl-C; a checkpoint still being written is "
              "incomplete and is never picked", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    backend.keep_freed_memory()  # a CPU's steps reuse their buffers' memory (why: backend.py)
    sys.exit(main(sys.argv[1:]))
