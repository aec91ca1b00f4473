"""The study's four Llama rows on one GPU, at 405B width, with offloaded gradients checked.

    python -m study gpu-check           one GPU (e.g. an H200; jax[cuda12]==0.12.0.1: README)
    python -m study gpu-check --smoke   tiny shapes on any backend (the CPU test of this)
    python -m study gpu-check --row ROW [--smoke]   one row's speed and memory (2. below),
                                                    what the check runs in a process per row

1. Correctness (XLA has shipped wrong gradients for offloaded scan residuals, openxla/xla
   #46231): for each row's placement, XLA flags and NVFP4 weights, loss and gradients at f32 /
   highest matmul precision against no checkpointing, over several scanned layers, beside
   the addressing proof of the same compiled program (study/addressing.py: the two must
   agree); NVFP4 logits on this backend against the CPU's (and the FP4 path on Blackwell).
2. Speed and memory: each row in its own process (so peak memory is its own), a 405B-width
   proxy (the real layer width, heads and vocabulary; a few layers), sequence 8192, bf16:
   step time (forward + backward), TFLOP/s/device by MaxText's formula, peak device memory,
   the compiled program's host (pinned) bytes, and beside the measured step the replay of the
   same compiled program (study/replay.py): the time model's error on this GPU.
"""

import dataclasses
import json
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import configs
from configs import ConfigError
from model import llama, quant
from model.options import ForwardOptions
from runtime.setup import resolve_placement
from study import addressing, cli, hlo, replay
from study.bench import in_a_fresh_process, proxy_params, timed
from study.gpus import GPUS
from trainer import program, step as trainer_step, target as trainer_target

ROWS = configs.COMPARISONS["llama405b-compare"]
WIDE = dataclasses.replace(configs.get("llama405b-offload").model, n_layers=3)
SMOKE = dataclasses.replace(configs.get("llama405b-offload").proxy_model, vocab=512,
                            d_model=128, n_layers=3, n_heads=4, head_dim=32, d_ff=416)


def value_and_grad_fn(model, tables, dtype, run):
    """Forward + backward as a run here computes it (the trainer's loss: cuDNN's fused attention
    on a GPU in bf16, the run's NVFP4 path), with its flags, over whole sequences (no chunks)."""
    target = trainer_target.this_machine()
    run = dataclasses.replace(run, compute_dtype=jnp.dtype(dtype).name, loss_chunks=1)
    loss = program.make_loss(model, run, program.forward_options(model, run, tables, None, target))
    return jax.jit(jax.value_and_grad(lambda p, b: loss(p, b)[0]),
                   compiler_options=trainer_target.compiler_options(run, target) or None)


def row_tables(name: str):
    return resolve_placement(WIDE, configs.get(name).run)


def random_params(model, dtype):
    return jax.tree.map(lambda p: p.astype(dtype), proxy_params(model))


def check_gradients(smoke: bool) -> list[dict]:
    """Every row's placement and flags against no checkpointing, in f32."""
    model = SMOKE if smoke else dataclasses.replace(WIDE, d_model=2048, d_ff=6656, n_heads=16,
                                                    n_layers=6, vocab=32_768)
    params = random_params(model, jnp.float32)
    batch = jax.random.randint(jax.random.key(1), (2, 65 if smoke else 1025), 0, model.vocab)
    with jax.default_matmul_precision("highest"):
        results, references = [], {}
        for name in ROWS:
            run = configs.get(name).run
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


def measure_row(name: str, smoke: bool, steps: int = 5) -> dict:
    """Forward + backward of one row at 405B width; run in a fresh process."""
    run = configs.get(name).run
    model = SMOKE if smoke else WIDE
    seq, batch_size = (64, 2) if smoke else (run.seq, 1)
    dtype = jnp.float32 if smoke else jnp.bfloat16
    params = random_params(model, dtype)
    batch = jax.random.randint(jax.random.key(1), (batch_size, seq + 1), 0, model.vocab)
    fn = value_and_grad_fn(model, row_tables(name), dtype, run)
    started = time.perf_counter()
    compiled = fn.lower(params, batch).compile()
    compile_s = time.perf_counter() - started
    step_s = timed(compiled, params, batch, repeats=steps)
    kind = jax.devices()[0].device_kind
    gpu = next((g for g in GPUS.values() if jax.default_backend() == "gpu" and (
        g.device_kind.startswith(kind) or kind.startswith(g.device_kind))), None)
    replayed = (float("nan") if gpu is None else
                replay.replay(hlo.parse_module(compiled.as_text()), gpu, 1).step_s)
    stats = jax.local_devices()[0].memory_stats() or {}
    analysis = compiled.memory_analysis()
    return {"row": name, "layers": model.n_layers, "seq": seq, "batch": batch_size,
            "compile_s": compile_s, "step_ms": step_s * 1e3, "replayed_ms": replayed * 1e3,
            "replay_error": replayed / step_s - 1,
            "tflops_per_device": llama.training_flops(model, batch_size, seq) / step_s / 1e12,
            "peak_device_gib": stats.get("peak_bytes_in_use", float("nan")) / 2**30,
            "host_temp_gib": getattr(analysis, "host_temp_size_in_bytes", 0) / 2**30,
            "device_temp_gib": getattr(analysis, "temp_size_in_bytes", 0) / 2**30}


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
    flags, _, _ = cli.tool_words("gpu-check [--smoke] [--row ROW]", argv,
                                 {"--smoke": None, "--row": "ROW"}, names=False)
    smoke = "--smoke" in flags
    if "--row" in flags:
        if flags["--row"] not in ROWS:
            raise ConfigError(f"--row {flags['--row']!r}: choose one of {', '.join(ROWS)}")
        print(json.dumps(measure_row(flags["--row"], smoke)))
        return 0
    print(f"backend {jax.default_backend()}: {jax.devices()[0].device_kind}"
          + (" (smoke shapes: not the real check)" if smoke else ""))
    correctness = check_gradients(smoke)
    for r in correctness:
        print(f"gradients {r['row']:<30} max|diff| {r['grad_max_abs_diff']:.3e} "
              f"({r['grad_rel']:.2e} of max|grad|), loss diff {r['loss_diff']:.2e}  "
              f"{'OK' if r['ok'] else 'WRONG'}; addressing of its {r['host_buffers']} host "
              f"buffers: {', '.join(r['addressing']) or '-'}")
    nvfp4 = check_nvfp4()
    print("\n".join(nvfp4))
    flags = ["--smoke"] if smoke else []
    outputs = [in_a_fresh_process("gpu-check", "--row", name, *flags) for name in ROWS]
    rows = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    keys = ["step_ms", "replayed_ms", "replay_error", "tflops_per_device", "peak_device_gib",
            "host_temp_gib", "device_temp_gib", "compile_s"]
    print(f"{'row':<30}" + "".join(f"{k:>18}" for k in keys))
    for r in rows:
        print(f"{r['row']:<30}" + "".join(f"{r[k]:>18.2f}" for k in keys))
    print(f"(L={rows[0]['layers']}, seq {rows[0]['seq']}, batch {rows[0]['batch']}; forward + "
          "backward, no optimizer; TFLOP/s by MaxText's formula; replayed_ms: the same compiled "
          "program replayed on study/gpus.py's figures, nan off a known GPU)")
    proven = all(v == addressing.CHECKED for r in correctness for v in r["addressing"])
    return 0 if all(r["ok"] for r in correctness) and proven and not any(
        "WRONG" in line for line in nvfp4) else 1
