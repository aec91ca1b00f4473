"""Checkpoint costs on a proxy: save and restore time of its train state, and what asynchronous
saves every N steps add to the mean step time.

    python -m study checkpoint-bench [experiment] [steps=N]

Ratios within one run on whatever machine runs this: on a CPU the background write competes
with the step for the same cores, which a GPU run does not.
"""

import contextlib
import io
import json
import statistics
import tempfile
import time
from pathlib import Path


import jax

from runtime import checkpoints
import configs
import train
from runtime import setup as runtime_setup
from trainer import target as trainer_target

INTERVALS = (0, 1, 10)  # checkpoint_every: none, every step, a realistic interval


def mean_step_s(name: str, args: list[str], out_dir: str) -> float:
    """Mean step time over steps 2..N of a run (the mean, not the median: a save every N
    steps costs on those steps only)."""
    target = trainer_target.this_machine()
    with contextlib.redirect_stdout(io.StringIO()):
        setup = runtime_setup.resolve(name, [*args, f"out_dir={out_dir}"], target.devices)
        train.train(setup, target)
    (run_dir,) = Path(out_dir).iterdir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.mean(r["step_s"] for r in records[1:])


def save_and_restore(name: str, args: list[str], directory: Path) -> dict:
    target = trainer_target.this_machine()
    setup = runtime_setup.resolve(name, args, target.devices)
    state, _ = runtime_setup.start_state(setup, target)
    nbytes = sum(a.nbytes for a in jax.tree.leaves(state))
    saver = checkpoints.Saver(directory, keep=1, every=1)
    started = time.perf_counter()
    saver.save(1, jax.block_until_ready(state), {"step": 1})
    blocking = time.perf_counter() - started
    saver.close()
    on_disk = time.perf_counter() - started
    setup.resume = checkpoints.find(str(directory), "", "")
    started = time.perf_counter()
    jax.block_until_ready(runtime_setup.start_state(setup, target)[0])
    return {"bytes": nbytes, "blocking_s": blocking, "save_s": on_disk,
            "restore_s": time.perf_counter() - started}


def main(argv: list[str]) -> None:
    names = [a for a in argv if "=" not in a] or ["llama405b-offload"]
    steps = configs.parse_overrides([a for a in argv if "=" in a]).get("steps", "21")
    for name in names:
        args = [f"steps={steps}"]
        with tempfile.TemporaryDirectory() as tmp:
            costs = save_and_restore(name, args, Path(tmp) / "checkpoints")
            times = {every: mean_step_s(name, [*args, f"checkpoint_every={every}"],
                                        f"{tmp}/runs-{every}") for every in INTERVALS}
        mib = costs["bytes"] / 2**20
        print(f"\n{name} proxy train state: {mib:.0f} MiB (parameters and Adam moments, f32), "
              f"{jax.device_count()} {jax.default_backend()} device(s)")
        print(f"save: {costs['blocking_s'] * 1e3:.0f} ms before the next step may run, "
              f"{costs['save_s'] * 1e3:.0f} ms until complete on disk "
              f"({mib / costs['save_s']:.0f} MiB/s); restore: "
              f"{costs['restore_s'] * 1e3:.0f} ms ({mib / costs['restore_s']:.0f} MiB/s)")
        print(f"{'checkpoint_every':<18}{'mean step ms':>14}{'vs none':>10}  (steps 2..{steps})")
        for every, seconds in times.items():
            print(f"{every or 'off':<18}{seconds * 1e3:>14.1f}{seconds / times[0] - 1:>+10.1%}")
