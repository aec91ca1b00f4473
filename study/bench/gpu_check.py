"""The study's four Llama rows on one GPU: their fit programs measured and replayed, and
offloaded gradients checked.

    python -m study gpu-check           one or more GPUs (jax[cuda12]==0.12.0.1: README)
    python -m study gpu-check --smoke   the same on any backend at proxy scale, tiny shapes
                                        (the CPU test of this)

1. Speed and memory, first, before this process touches a GPU (each row's process takes XLA's
   pool): `python train.py llama405b-compare`, each row in a process of its own at the fit
   every row fits (runtime/comparison.py: the study's layers, as many as fit), its step
   compiled by XLA and written out; then beside each row's measured median step the replay
   of that same program on this GPU's figures (study/timing/replay.py): the time model's error here.
2. Correctness (XLA has shipped wrong gradients for offloaded scan residuals, openxla/xla
   #46231): for each row's placement, XLA flags and NVFP4 weights, loss and gradients at f32 /
   highest matmul precision against no checkpointing, over several scanned layers, beside
   the addressing proof of the same compiled program (study/programs/addressing.py: the two must
   agree); NVFP4 logits on this backend against the CPU's (and the FP4 path on Blackwell).
"""

import dataclasses
import os
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import configs
from model import quant
from model.options import ForwardOptions
from runtime import comparison
from runtime.setup import resolve_placement
from study import command_line
from study.programs import addressing, hlo
from study.timing import replay
from study.bench.proxy_step import proxy_params
from study.hardware.gpus import GPUS
from trainer import program, step as trainer_step, target as trainer_target

NAME = "llama405b-compare"
ROWS = configs.COMPARISONS[NAME]
SMOKE = dataclasses.replace(configs.get("llama405b-offload").proxy_model, vocab=512,
                            d_model=128, n_layers=3, n_heads=4, head_dim=32, d_ff=416)
# --smoke: each row's proxy, as small (tests/conftest.py's SMALL, without NVFP4's emulation).
SMOKE_RUN = ["steps=3", "seq=32", "model.n_layers=2", "model.vocab=512", "model.d_model=128",
             "model.d_ff=256", "quant=none"]


def value_and_grad_fn(model, placement, dtype, run):
    """Forward + backward as a run here computes it (the trainer's loss: cuDNN's fused attention
    on a GPU in bf16, the run's NVFP4 path), with its flags, over whole sequences (no chunks)."""
    target = trainer_target.this_machine()
    run = dataclasses.replace(run, compute_dtype=jnp.dtype(dtype).name, loss_chunks=1)
    options = program.forward_options(model, run, placement, None, target)
    loss = program.make_loss(model, run, options)
    return jax.jit(jax.value_and_grad(lambda p, b: loss(p, b)[0]),
                   compiler_options=trainer_target.compiler_options(run, target) or None)


def row_tables(name: str):
    return resolve_placement(SMOKE, configs.get(name).run)


def random_params(model, dtype):
    return jax.tree.map(lambda p: p.astype(dtype), proxy_params(model))


def check_gradients(smoke: bool) -> list[dict]:
    """Every row's placement and flags against no checkpointing, in f32."""
    model = SMOKE if smoke else dataclasses.replace(
        configs.get("llama405b-offload").model, d_model=2048, d_ff=6656, n_heads=16, n_layers=6,
        vocab=32_768)
    params = random_params(model, jnp.float32)
    batch = jax.random.randint(jax.random.key(1), (2, 65 if smoke else 1025), 0, model.vocab)
    with jax.default_matmul_precision("highest"):
        results, references = [], {}
        for name in ROWS:
            run = configs.get(name).run
            if smoke:  # as its rows ran (SMOKE_RUN); check_nvfp4 checks NVFP4's path
                run = dataclasses.replace(run, quant="none")
            quantization = trainer_target.quantization(run, trainer_target.this_machine())
            if quantization not in references:  # no checkpointing, no flags, same weights
                plain = value_and_grad_fn(model, None, jnp.float32,
                                          dataclasses.replace(run, xla_flags={}))
                references[quantization] = plain(params, batch)
            ref_loss, ref_grads = references[quantization]
            compiled = value_and_grad_fn(model, row_tables(name), jnp.float32, run).lower(
                params, batch).compile()
            proofs = addressing.prove(compiled.as_text())
            loss, grads = compiled(params, batch)
            scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads))
            error = max(float(jnp.abs(a - b).max()) for a, b in
                        zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
            results.append({"row": name, "loss_diff": abs(float(loss - ref_loss)),
                            "grad_max_abs_diff": error, "grad_rel": error / scale,
                            "ok": error <= 1e-5 * scale, "host_buffers": len(proofs),
                            "addressing": sorted({p.verdict for p in proofs})})
    return results


def measure_rows(smoke: bool, out_dir: str) -> list[dict]:
    """The comparison's rows run (each in a process of its own, its compiled step written to
    `hlo/` in its run folder), each with the replay of that program on this GPU (nan off a
    known GPU); [] if a row failed."""
    def dumping(row: str) -> dict:
        where = Path(out_dir).absolute() / f"{row}-hlo"
        flags = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={where} "
                 "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_step")
        return {**os.environ, "XLA_FLAGS": flags.strip()}

    status, rows, folder = comparison.run_rows(
        NAME, [*(SMOKE_RUN if smoke else []), f"out_dir={out_dir}"], dumping)
    if status:
        return []
    comparison.table(NAME, rows, folder)
    kind = jax.devices()[0].device_kind if jax.default_backend() == "gpu" else ""
    gpu = next((g for g in GPUS.values() if kind and (
        g.device_kind.startswith(kind) or kind.startswith(g.device_kind))), None)
    for row in rows:
        step_s, devices = row["summary"]["median_step_s"], int(row["devices"].split()[0])
        dumped = sorted((Path(out_dir).absolute() / f"{row['experiment']}-hlo").glob(
            "*jit_step*after_optimizations.txt"))
        row["replayed_s"] = (float("nan") if gpu is None or not dumped else replay.replay(
            hlo.parse_module(dumped[-1].read_text()), gpu, devices).step_s)
        row["replay_error"] = row["replayed_s"] / step_s - 1
    return rows


def check_nvfp4() -> list[str]:
    """NVFP4 (every GEMM in FP4) of the small model: the dequantize path's loss and gradients
    on this backend against the CPU's, in f32 at highest precision; on a Blackwell GPU also
    the FP4 tensor cores' (path "scaled") against the dequantize path's in bf16: the same
    quantized values, so only the GEMMs' accumulation and bf16 rounding may differ."""
    params = random_params(SMOKE, jnp.float32)
    tokens = jax.random.randint(jax.random.key(2), (2, 65), 0, SMOKE.vocab)

    def loss_and_grads(path, dtype, device=None):
        loss = partial(trainer_step.loss_fn, model=SMOKE,
                       options=ForwardOptions(dtype, quantization=quant.Quantization(path)))
        args = jax.device_put((params, tokens), device) if device else (params, tokens)
        (value, _), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
            *args, jax.random.key(3))
        return np.concatenate([np.asarray(x, np.float64).ravel()
                               for x in jax.tree.leaves((value, grads))])

    with jax.default_matmul_precision("highest"):
        here = loss_and_grads("dequantize", jnp.float32)
        there = loss_and_grads("dequantize", jnp.float32, jax.devices("cpu")[0])
    # A last-bit difference upstream may round a block's code the other way: compared as a
    # whole, not element by element.
    error = np.linalg.norm(here - there) / np.linalg.norm(there)
    lines = [f"nvfp4 dequantize path, {jax.default_backend()} vs cpu: loss and gradients, rel. "
             f"error {error:.2e}  {'OK' if error <= 1e-3 else 'WRONG'}"]
    if trainer_target.this_machine().blackwell:
        scaled, dequantized = (loss_and_grads(p, jnp.bfloat16) for p in ("scaled", "dequantize"))
        error = np.linalg.norm(scaled - dequantized) / np.linalg.norm(dequantized)
        lines.append(f"nvfp4 on FP4 tensor cores vs the dequantize path, bf16: rel. error "
                     f"{error:.2e}  {'OK' if error <= 2e-2 else 'WRONG'}")
    return lines


def main(argv: list[str]) -> int:
    flags, _, words = command_line.tool_words("gpu-check [--smoke] [out_dir=DIR]", argv,
                                              {"--smoke": None}, names=False, keys=True)
    if unknown := [w for w in words if not w.startswith("out_dir=")]:
        raise configs.ConfigError(f"gpu-check takes out_dir= only, got {unknown[0]!r}")
    smoke = "--smoke" in flags
    out_dir = configs.parse_overrides(words).get("out_dir", configs.RunConfig.out_dir)
    rows = measure_rows(smoke, out_dir)  # first: this process has not touched a GPU yet
    if not rows:
        return 1
    print(f"{'row':<30}{'step ms':>12}{'replayed ms':>14}{'replay error':>14}")
    for r in rows:
        print(f"{r['experiment']:<30}{r['summary']['median_step_s'] * 1e3:>12.1f}"
              f"{r['replayed_s'] * 1e3:>14.1f}{r['replay_error']:>+14.1%}")
    print(f"(each row's own compiled step, replayed on study/hardware/gpus.py's figures for this "
          f"GPU; nan off a known GPU: {jax.devices()[0].device_kind}"
          + (", smoke shapes: not the real check)" if smoke else ")"))
    correctness = check_gradients(smoke)
    for r in correctness:
        print(f"gradients {r['row']:<30} max|diff| {r['grad_max_abs_diff']:.3e} "
              f"({r['grad_rel']:.2e} of max|grad|), loss diff {r['loss_diff']:.2e}  "
              f"{'OK' if r['ok'] else 'WRONG'}; addressing of its {r['host_buffers']} host "
              f"buffers: {', '.join(r['addressing']) or '-'}")
    nvfp4 = check_nvfp4()
    print("\n".join(nvfp4))
    proven = all(v == addressing.CHECKED for r in correctness for v in r["addressing"])
    return 0 if all(r["ok"] for r in correctness) and proven and not any(
        "WRONG" in line for line in nvfp4) else 1
