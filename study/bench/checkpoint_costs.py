"""Checkpoint costs on a proxy: save and restore time of its train state, and what asynchronous
saves every N steps add to the mean step time.

    python -m study checkpoint-bench [EXPERIMENT ...] [steps=N]

Ratios within one run on whatever machine runs this: on a CPU the background write competes
with the step for the same cores, which a GPU run does not.
"""

import contextlib
import dataclasses
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax

import configs
import train
from configs import ConfigError
from runtime import checkpoints
from runtime import setup as runtime_setup
from study import command_line
from trainer import target as trainer_target
from trainer.program import Program

INTERVALS = (0, 1, 10)  # checkpoint_every: none, every step, a realistic interval


def mean_step_s(name: str, args: list[str], out_dir: str) -> float:
    """Mean step time over steps 2..N of a run (not the median: a save costs on its steps only)."""
    target = trainer_target.this_machine()
    with contextlib.redirect_stdout(io.StringIO()):
        setup = runtime_setup.resolve(name, [*args, f"out_dir={out_dir}"], target.devices)
        train.train(setup, target)
    (run_dir,) = Path(out_dir).iterdir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.mean(r["step_s"] for r in records[1:])


def save_and_restore(name: str, args: list[str], directory: Path) -> str:
    """The proxy's train state: its size, and how long saving and restoring it take."""
    target = trainer_target.this_machine()
    setup = runtime_setup.resolve(name, args, target.devices)
    program = Program(setup.model, setup.run, setup.placement, target)
    state, _ = runtime_setup.start_state(program, setup)
    saver = checkpoints.Saver(directory, keep=1, every=1)
    started = time.perf_counter()
    saver.save(1, jax.block_until_ready(state), {"step": 1})
    blocking = time.perf_counter() - started
    saver.close()
    on_disk = time.perf_counter() - started
    setup = dataclasses.replace(setup, resume=checkpoints.find(str(directory), "", ""))
    started = time.perf_counter()
    jax.block_until_ready(runtime_setup.start_state(program, setup)[0])
    restore = time.perf_counter() - started
    mib = sum(a.nbytes for a in jax.tree.leaves(state)) / 2**20
    return (f"\n{name} proxy train state: {mib:.0f} MiB (parameters and Adam moments, f32), "
            f"{jax.device_count()} {jax.default_backend()} device(s)\n"
            f"save: {blocking * 1e3:.0f} ms before the next step may run, {on_disk * 1e3:.0f} "
            f"ms until complete on disk ({mib / on_disk:.0f} MiB/s); restore: "
            f"{restore * 1e3:.0f} ms ({mib / restore:.0f} MiB/s)")


def arguments(argv: list[str]) -> tuple[list[str], int]:
    """(the experiments, each run's steps), every word and row checked before the first runs."""
    _, names, words = command_line.tool_words("checkpoint-bench [EXPERIMENT ...] [steps=N]",
                                              argv, {}, keys=True)
    if unknown := configs.parse_overrides(words).keys() - {"steps"}:
        raise ConfigError(f"checkpoint-bench: unknown key {sorted(unknown)[0]!r}; it takes steps")
    names = names or ["llama405b-offload"]
    args = [f"steps={configs.parse_overrides(words).get('steps', '21')}"]
    setups = [runtime_setup.resolve(name, args, trainer_target.this_machine().devices)
              for name in names]
    if (steps := setups[0].run.steps) < 2:  # the mean step time leaves the first out
        raise ConfigError(f"steps={steps}: checkpoint-bench needs 2 or more")
    return names, steps


def main(argv: list[str]) -> int:
    names, steps = arguments(argv)
    args = [f"steps={steps}"]
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            print(save_and_restore(name, args, Path(tmp) / "checkpoints"))
            times = {every: mean_step_s(name, [*args, f"checkpoint_every={every}"],
                                        f"{tmp}/runs-{every}") for every in INTERVALS}
        print(f"{'checkpoint_every':<18}{'mean step ms':>14}{'vs none':>10}  (steps 2..{steps})")
        for every, seconds in times.items():
            print(f"{every or 'off':<18}{seconds * 1e3:>14.1f}{seconds / times[0] - 1:>+10.1%}")
    return 0
