"""Proxy training-step time and model-FLOP rate, as a fraction of a same-run matmul ceiling.

    python -m study bench [experiment] [steps=N]

Figures are ratios within one run on whatever machine runs this (noisy if shared): the
model FLOP rate (MaxText's count, no recompute) over the rate of a large f32 matmul.
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
from runtime import report

from runtime.data import SyntheticTokens
from model import common
from offload import activations
from model import families
from trainer import program as trainer_build
from trainer import step as trainer_step
from trainer import target as trainer_target

def timed(fn, *args, repeats: int) -> float:
    """Median seconds per call, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_ceiling(n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n f32 matmul: what this machine's XLA does at its best."""
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.float32) for i in range(2))
    return 2 * n**3 / timed(jax.jit(jnp.matmul), a, b, repeats=repeats)


def proxy_params(model):
    mesh = common.make_mesh((1, 1), ("data", "fsdp"), devices=jax.devices()[:1])
    return common.init_params(families.of(model).param_specs(model),
                              common.AxisRules(mesh=mesh), jax.random.key(0))


def step_time(model, run, preset: str, repeats: int) -> float:
    tables = None if preset == activations.NO_CHECKPOINT else activations.placement(
        preset, {}, families.scan_tags(model))
    params = proxy_params(model)
    optimizer = trainer_step.make_optimizer(run.optimizer, run.steps)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), int)}
    loss = trainer_build.make_loss(model, run, tables, rules=None,
                                   target=trainer_target.this_machine())
    step = jax.jit(partial(trainer_step.train_step, loss=loss,
                           update=trainer_step.device_update(optimizer)),
                   donate_argnums=0)
    batch = jnp.asarray(SyntheticTokens(model.vocab, 0).batch(0, run.per_device_batch, run.seq))
    holder = [state]

    def one_step():
        holder[0], metrics = step(holder[0], batch)
        return metrics["loss"]

    return timed(one_step, repeats=repeats)


def bench(name: str, overrides: dict, repeats: int, ceiling: float) -> None:
    experiment = configs.get(name)
    model, run = configs.apply_overrides(*experiment.at_scale("proxy"), overrides)
    print(f"\n{name} proxy: {report.model_line(model)}; batch {run.per_device_batch} x "
          f"{run.seq}, compute {run.compute_dtype}, quant {run.quant}, "
          f"1 {jax.default_backend()} device; "
          f"median of {repeats} steps")
    flops = families.of(model).training_flops(model, run.per_device_batch, run.seq)
    print(f"{'preset':<14}{'step ms':>9}{'GFLOP/s':>10}{'of ceiling':>12}{'vs remat':>10}")
    times = {p: step_time(model, run, p, repeats)
             for p in ("none", "remat", experiment.run.preset)}
    for p, seconds in times.items():
        rate = flops / seconds
        print(f"{p:<14}{seconds * 1e3:>9.1f}{rate / 1e9:>10.1f}{rate / ceiling:>11.0%}"
              f"{seconds / times['remat']:>10.2f}")
    if run.quant != "none":
        nvfp4_costs(model, run, repeats)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "study", "plan", name], check=True,
                   stdout=subprocess.DEVNULL, cwd=Path(__file__).resolve().parent.parent)
    print(f"full-scale plan (python -m study plan {name}, a fresh process): "
          f"{time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "study", "search", name, "search.plot=off"],
                   check=True, stdout=subprocess.DEVNULL,
                   cwd=Path(__file__).resolve().parent.parent)
    print(f"placement search (python -m study search {name}, a fresh process): "
          f"{time.perf_counter() - started:.1f} s")


QUANT_ROWS = {"none": dict(quant="none"),
              "1x16, bf16 bwd": dict(quant="nvfp4", quant_tiles="1x16", quant_backward="bf16"),
              "16x16, bf16 bwd": dict(quant="nvfp4", quant_tiles="16x16", quant_backward="bf16"),
              "16x16, fp4 bwd": dict(quant="nvfp4", quant_tiles="16x16", quant_backward="fp4")}


def nvfp4_costs(model, run, repeats: int) -> None:
    """What NVFP4 costs a proxy step on this machine (the dequantize path: the values of the
    FP4 GEMMs, multiplied in the compute dtype), and how far it moves the logits of the same
    (random) weights from unquantized bf16 ones."""
    times = {row: step_time(model, dataclasses.replace(run, **changes), run.preset, repeats)
             for row, changes in QUANT_ROWS.items()}
    params = proxy_params(model)
    tokens = jnp.asarray(SyntheticTokens(model.vocab, 1).batch(0, run.per_device_batch,
                                                              run.seq)[:, :-1])

    def logits(dtype, changes):
        quantization = trainer_target.quantization(dataclasses.replace(run, **changes),
                                             trainer_target.this_machine())
        return np.asarray(jax.jit(partial(families.of(model).forward, cfg=model,
                                          dtype=dtype, quantization=quantization))(
            params, tokens)[0], np.float64)

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


def main(argv: list[str]) -> None:
    names = [a for a in argv if "=" not in a] or ["llama405b-offload", "deepseek671b-offload"]
    overrides = configs.parse_overrides([a for a in argv if "=" in a])
    repeats = int(overrides.pop("steps", "5"))
    ceiling = matmul_ceiling()
    print(f"ceiling: 2048^3 f32 matmul {ceiling / 1e9:.1f} GFLOP/s (same run)")
    for name in names:
        bench(name, overrides, repeats, ceiling)
    print("(on a CPU, offloaded tensors stay in memory: the gain over remat is the recompute "
          "saved, the cost the memory traffic of keeping them)")
