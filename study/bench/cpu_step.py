"""The CPU training step: median ms per step and model FLOP/s at nanoGPT's CPU size and at both
families' proxies, beside this machine's large-matmul rate measured in the same process.

    python -m study cpu-step [steps=N] [rounds=R] [profile=1]

Each size runs in a process of its own, as a training run holds one model; there each round
times the 2048^3 f32 matmul and then the step, so every ratio is one round's; the spread over
rounds is the machine's noise (shared cores move every figure). nanoGPT's size runs
`steps` steps a round, a proxy as many as take the same FLOPs (at least 3: a proxy step does
~15x the FLOPs). "step" is the compiled step alone, the state donated; "loop" adds what the
trainer's loop does on the host each step (the next batch made and transferred, the metrics
fetched as floats)."""

import dataclasses
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import jax

from configs import ConfigError, whole
from model import families
from runtime import backend, header
from runtime import setup as runtime_setup
from runtime.setup import program_for, start_state
from study.bench import cpu_profile
from study.bench.proxy_step import matmul_ceiling
from trainer import target as trainer_target
from trainer.program import Program

# nanoGPT's CPU "baby" configuration (4 layers, 4 heads, width 128, block 64, batch 12, f32),
# as a Llama of the same width: the text experiment's optimizer, synthetic tokens.
NANOGPT = ("shakespeare", ["model.d_model=128", "model.n_layers=4", "model.n_heads=4",
                           "model.n_kv_heads=4", "model.head_dim=32", "model.d_ff=344",
                           "seq=64", "per_device_batch=12", "global_batch=0", "preset=none",
                           "quant=none", "compute_dtype=float32", "data.path=", "eval_every=0"])
SIZES = {"nanogpt": NANOGPT, "llama proxy": ("llama405b-offload", []),
         "deepseek proxy": ("deepseek671b-offload", [])}
OPTIONS = {"steps": 30, "rounds": 3, "profile": 0}  # profile=1: where nanoGPT's size's goes


@dataclasses.dataclass
class Size:
    """One size's step as the trainer compiles it (its Program) for one of this machine's devices,
    and its state."""
    setup: runtime_setup.Setup
    program: Program
    state: dict
    flops: float  # model FLOPs per step (MaxText's count)

    def time(self, steps: int, host: bool) -> float:
        """Median seconds per step; `host`: with the trainer loop's per-step host work."""
        run, data, size = self.setup.run, self.setup.data, self.program.batch_size
        batch = self.program.batch(data.batch(0, size, run.seq))
        times = []
        for i in range(steps + 1):  # the first call is a warm-up
            started = time.perf_counter()
            self.state, metrics = self.program.step(self.state, batch)
            if host:
                batch = self.program.batch(data.batch(i + 1, size, run.seq))
                self.fetched = {k: float(v) for k, v in metrics.items()}
            else:
                jax.block_until_ready(metrics)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])


def prepared(name: str, words: list[str]) -> Size:
    """The experiment at proxy scale with `words` on one of this machine's devices, its step
    compiled and its state made as the trainer does it."""
    machine = trainer_target.this_machine()
    one = dataclasses.replace(machine, devices=machine.devices[:1])
    setup, program = program_for(runtime_setup.resolve(name, words, one.devices), one)
    program.compile_run()
    state, _ = start_state(program, setup)
    flops = families.of(setup.model).training_flops(setup.model, program.batch_size,
                                                    setup.run.seq)
    return Size(setup, program, state, flops)


def options_of(argv: list[str]) -> dict:
    found = dict(OPTIONS)
    for word in argv:
        key, _, value = word.partition("=")
        if key not in OPTIONS or not whole(value) or int(value) < (key != "profile") or (
                key == "profile" and int(value) > 1):
            raise ConfigError(f"{word!r}: cpu-step takes steps=N and rounds=N (whole numbers "
                              ">= 1) and profile=0|1")
        found[key] = int(value)
    return found


def measured(what: tuple[str, list[str]], rounds: int, steps: int, flops: float,
             profile: bool) -> dict:
    """One size in a process of its own, as a training run holds one model (beside other
    models' steps and states, a step ran slower: docs/runs.md): `rounds` of the matmul's rate
    then the step's medians over `steps` steps, or as many as take `flops` (at least 3); with
    `profile`, where its step goes."""
    backend.keep_freed_memory()  # as a training run does (train.py), before JAX's client starts
    size = prepared(*what)
    steps = max(3, round(flops / size.flops)) if flops else steps
    found = {"flops": size.flops, "ceiling": [], "step": [], "loop": [],
             "about": f"{header.model_line(size.setup.model)}; batch "
                      f"{size.setup.run.per_device_batch} x {size.setup.run.seq}, preset "
                      f"{size.setup.run.preset}, {size.flops / 1e9:.2f} GFLOP/step"}
    for done in range(1, rounds + 1):
        found["ceiling"].append(matmul_ceiling())
        for mode in ("step", "loop"):
            found[mode].append(size.time(steps, mode == "loop"))
        print(f"  round {done} of {rounds}: step {found['step'][-1] * 1e3:.1f} ms",
              file=sys.stderr, flush=True)  # (progress: a loaded machine takes minutes)
    found["profile"] = profiled(size, steps) if profile else []
    return found


def main(argv: list[str]) -> int:
    options = options_of(argv)
    sizes, flops = {}, 0.0
    for label, what in SIZES.items():  # nanoGPT's size first: its steps' FLOPs set the others'
        print(f"cpu-step: {label}, compiling and timing in a process of its own",
              file=sys.stderr, flush=True)
        with ProcessPoolExecutor(1, multiprocessing.get_context("spawn")) as alone:
            sizes[label] = alone.submit(measured, what, options["rounds"], options["steps"],
                                        flops, label == "nanogpt" and options["profile"]).result()
        flops = flops or options["steps"] * sizes["nanogpt"]["flops"]
    print(f"CPU step on 1 {jax.default_backend()} device, each size in a process of its own; "
          f"{options['rounds']} rounds, {options['steps']} steps at nanoGPT's size (medians; "
          "min-max over rounds; each round the 2048^3 f32 matmul's rate, then the step)")
    for label, found in sizes.items():
        ceilings = found["ceiling"]
        print(f"{label}: {found['about']}\n  ceiling: {statistics.median(ceilings) / 1e9:.1f} "
              f"GFLOP/s ({min(ceilings) / 1e9:.1f}-{max(ceilings) / 1e9:.1f})")
        for mode in ("step", "loop"):
            seconds, rate = found[mode], found["flops"] / statistics.median(found[mode])
            shares = [found["flops"] / s / c for s, c in zip(seconds, ceilings)]
            print(f"  {mode}: {statistics.median(seconds) * 1e3:7.1f} ms "
                  f"({min(seconds) * 1e3:.1f}-{max(seconds) * 1e3:.1f}), {rate / 1e9:6.1f} "
                  f"GFLOP/s, {statistics.median(shares):.0%} of the ceiling "
                  f"({min(shares):.0%}-{max(shares):.0%})")
    if options["profile"]:
        print("\n".join(sizes["nanogpt"]["profile"]))
    return 0


def profiled(size: Size, steps: int) -> list[str]:
    """Where `size`'s step spends its time: its program compiled again with XLA's trace events."""
    program = size.program
    timed_step = program.step
    program.step = program.compile(program.traced, {"xla_cpu_enable_xprof_traceme": True})
    try:
        return cpu_profile.lines(program.step, lambda: size.time(steps, False), steps + 1)
    finally:
        program.step = timed_step
