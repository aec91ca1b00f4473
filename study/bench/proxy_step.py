"""Proxy training-step time and model-FLOP rate, as a fraction of a same-run matmul ceiling.

    python -m study bench [EXPERIMENT ...] [steps=N] [key=value ...]

Ratios within one run on this machine (noisy if shared); FLOPs by MaxText's count, no recompute.
"""

import dataclasses
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import configs
from data.tokens import SyntheticTokens
from model import families
from model.options import ForwardOptions
from model.params import init_params
from model.sharding import AxisRules, make_mesh
from offload import activations
from runtime import header
from runtime import setup as runtime_setup
from study import command_line
from trainer import program
from trainer import step as trainer_step
from trainer import target as trainer_target

ROOT = Path(__file__).resolve().parents[2]  # the repository: where `python -m study` runs


def timed(fn, *args, repeats: int) -> float:
    """Median seconds per call, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_a_fresh_process(*words: str) -> str:
    """What `python -m study WORDS` prints in a new process (nothing compiled before, own peak)."""
    return subprocess.run([sys.executable, "-m", "study", *words], stdout=subprocess.PIPE,
                          text=True, check=True, cwd=ROOT).stdout


def matmul_ceiling(n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n f32 matmul: what this machine's XLA does at its best."""
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.float32) for i in range(2))
    return 2 * n**3 / timed(jax.jit(jnp.matmul), a, b, repeats=repeats)


def proxy_params(model):
    mesh = make_mesh((1, 1), ("data", "fsdp"), devices=jax.devices()[:1])
    return init_params(families.of(model).param_specs(model), AxisRules(mesh=mesh),
                       jax.random.key(0))


def step_time(model, run, preset: str, repeats: int) -> float:
    placement = None if preset == activations.NO_CHECKPOINT else activations.resolve(
        preset, {}, families.of(model).SCANS)
    params = proxy_params(model)
    optimizer = trainer_step.make_optimizer(run.optimizer, run.steps)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), int)}
    run = dataclasses.replace(run, optimizer_state="device")  # where `state` is made here
    options = program.forward_options(model, run, placement, None, trainer_target.this_machine())
    step = jax.jit(partial(trainer_step.train_step, model=model, run=run, options=options),
                   donate_argnums=0)
    batch = jnp.asarray(SyntheticTokens(model.vocab, 0).batch(0, run.per_device_batch, run.seq))

    def one_step():
        nonlocal state  # donated: each step consumes the last one's state
        state, metrics = step(state, batch)
        return metrics["loss"]

    return timed(one_step, repeats=repeats)


def bench(setup: runtime_setup.Setup, repeats: int, ceiling: float) -> None:
    model, run, name = setup.model, setup.run, setup.experiment.name
    print(f"\n{name} proxy: {header.model_line(model)}; batch {run.per_device_batch} x "
          f"{run.seq}, compute {run.compute_dtype}, quant {run.quant}, "
          f"1 {jax.default_backend()} device; median of {repeats} steps")
    flops = families.of(model).training_flops(model, run.per_device_batch, run.seq)
    print(f"{'preset':<14}{'step ms':>9}{'GFLOP/s':>10}{'of ceiling':>12}{'vs remat':>10}")
    presets = ("none", "remat", setup.experiment.run.preset)
    times = {p: step_time(model, run, p, repeats) for p in presets}
    for p, seconds in times.items():
        rate = flops / seconds
        print(f"{p:<14}{seconds * 1e3:>9.1f}{rate / 1e9:>10.1f}{rate / ceiling:>11.0%}"
              f"{seconds / times['remat']:>10.2f}")
    if run.quant != "none":
        nvfp4_costs(model, run, repeats)
    for what, words in (("full-scale plan", ["plan", name]),
                        ("placement search", ["search", name, "search.plot=off"])):
        started = time.perf_counter()
        in_a_fresh_process(*words)
        print(f"{what} (python -m study {' '.join(words)}, a fresh process): "
              f"{time.perf_counter() - started:.1f} s")


QUANT_ROWS = {"none": dict(quant="none"),
              "1x16, bf16 bwd": dict(quant="nvfp4", quant_tiles="1x16", quant_backward="bf16"),
              "16x16, bf16 bwd": dict(quant="nvfp4", quant_tiles="16x16", quant_backward="bf16"),
              "16x16, fp4 bwd": dict(quant="nvfp4", quant_tiles="16x16", quant_backward="fp4")}


def nvfp4_costs(model, run, repeats: int) -> None:
    """What NVFP4 (the dequantize path: FP4 values, GEMMs in the compute dtype) costs a proxy step
    here, and how far it moves the logits of the same random weights from unquantized bf16 ones."""
    times = {row: step_time(model, dataclasses.replace(run, **changes), run.preset, repeats)
             for row, changes in QUANT_ROWS.items()}
    params = proxy_params(model)
    batch = SyntheticTokens(model.vocab, 1).batch(0, run.per_device_batch, run.seq)
    tokens = jnp.asarray(batch[:, :-1])

    def logits(dtype, changes):
        quantization = trainer_target.quantization(dataclasses.replace(run, **changes),
                                                   trainer_target.this_machine())
        forward = partial(families.of(model).forward, cfg=model,
                          options=ForwardOptions(dtype, quantization=quantization))
        return np.asarray(jax.jit(forward)(params, tokens)[0], np.float64)

    reference = logits(jnp.bfloat16, QUANT_ROWS["none"])
    errors = {"none, f32": logits(jnp.float32, QUANT_ROWS["none"])}
    errors.update({f"{row}, bf16": logits(jnp.bfloat16, changes)
                   for row, changes in QUANT_ROWS.items() if row != "none"})
    print(f"NVFP4, preset {run.preset} (the dequantize path: FP4 values, GEMMs in the compute "
          "dtype):")
    print(f"{'quant':<17}{'step ms':>9}{'vs none':>10}")
    for row, seconds in times.items():
        print(f"{row:<17}{seconds * 1e3:>9.1f}{seconds / times['none']:>10.2f}")
    print(f"logits against unquantized bf16 logits (random init, {tokens.size} tokens):")
    print(f"{'weights, compute':<23}{'rel. error':>12}{'max |diff| / max |logit|':>28}")
    for row, values in errors.items():
        diff = values - reference
        print(f"{row:<23}{np.linalg.norm(diff) / np.linalg.norm(reference):>12.4f}"
              f"{np.abs(diff).max() / np.abs(reference).max():>28.4f}")


def main(argv: list[str]) -> int:
    _, names, words = command_line.tool_words(
        "bench [EXPERIMENT ...] [steps=N] [key=value ...]", argv, {}, keys=True)
    # Each experiment's proxy on one of this machine's devices, checked as a run checks it,
    # before the ceiling is measured; steps=N: the steps timed (typed and ranged as a run's).
    one = trainer_target.this_machine().devices[:1]
    setups = [runtime_setup.resolve(name, words, one)
              for name in names or ["llama405b-offload", "deepseek671b-offload"]]
    repeats = setups[0].run.steps if "steps" in configs.parse_overrides(words) else 5
    ceiling = matmul_ceiling()
    print(f"ceiling: 2048^3 f32 matmul {ceiling / 1e9:.1f} GFLOP/s (same run)")
    for setup in setups:
        bench(setup, repeats, ceiling)
    print("(on a CPU, offloaded tensors stay in memory: the gain over remat is the recompute "
          "saved, the cost the memory traffic of keeping them)")
    return 0
