"""The run header: a row per part of the run, each run setting in the row its declaration
names (configs/__init__.py: `setting(shown=...)`), then where each offloaded activation lives
in the run's compiled program."""

import os

from configs import MESH_AXES
from model import families
from model.config import LlamaConfig
from model.params import param_count
from offload import activations
from runtime import backend, own_program
from runtime.own_program import GiB, size_words

ROWS = ("experiment", "scale", "fit", "model", "full scale", "devices", "batch", "optimizer",
        "dtypes", "kernels", "placement", "xla flags", "memory", "data", "checkpoints", "compile",
        "output")
_INDENT = "\n" + " " * 12  # a row's next line


def model_line(cfg) -> str:
    count = param_count(families.of(cfg).param_specs(cfg))
    if isinstance(cfg, LlamaConfig):
        shape = (f"L={cfg.n_layers} D={cfg.d_model} N={cfg.n_heads} K={cfg.n_kv_heads} "
                 f"H={cfg.head_dim} F={cfg.d_ff} V={cfg.vocab}")
    else:
        shape = (f"L={cfg.n_dense_layers}+{cfg.n_moe_layers} D={cfg.d_model} N={cfg.n_heads} "
                 f"E={cfg.n_experts} (k={cfg.experts_per_token}) F={cfg.d_ff}/{cfg.moe_d_ff} "
                 f"V={cfg.vocab}")
    return f"{shape}: {count:,} parameters"


def flags_line(run, target) -> str:
    flags = " ".join(f"--{k}={v}" for k, v in run.xla_flags.items()) or "(none)"
    if target.platform != "gpu":
        return f"{flags} [NOT applied: {target.platform} backend, GPU only]"
    return f"{flags} [applied]; XLA_FLAGS (every compile): {os.environ.get('XLA_FLAGS', '')}"


def settings_rows(setup, target, options, run_dir, first_step: int) -> dict[str, str]:
    """Every row but the compiled program's (memory, compile): what the settings say."""
    run, full = setup.run, setup.experiment
    devices = len(target.devices)
    own = full.model == full.proxy_model  # an experiment at one size (shakespeare)
    scale = ("FULL -- the experiment's model and run settings" if setup.scale == "full" else
             "FIT -- the experiment's own layers, as many as fit this machine"
             if setup.scale == "fit" else
             "PROXY -- its own model, with CPU settings" if own else
             "PROXY -- a small model of the same family, not the study's numbers")
    compute = run.compute_dtype
    if setup.scale == "proxy" and compute != full.run.compute_dtype:
        compute += f" (proxy setting for CPUs; full scale computes {full.run.compute_dtype})"
    batch = run.batch(devices)
    rows = {
        "experiment": f"{full.name}: {full.summary}",
        "scale": f"{scale}{_INDENT}(scale={run.scale}: {setup.scale_reason})",
        "fit": _fit_words(setup, target) if setup.fit else "",
        "model": model_line(setup.model) + (f" from {run.init_from}" if run.init_from else ""),
        "full scale": "" if own else (f"{model_line(full.model)}; its memory plan and GPU "
                                      f"program: python -m study plan|compile {full.name}"),
        "devices": f"{target.description}, mesh "
                   f"{dict(zip(MESH_AXES, run.mesh.shape(devices)))}",
        "batch": f"{batch} sequences x {run.seq} tokens ({batch / devices:g} per device; "
                 + (f"global_batch={run.global_batch}" if run.global_batch  # the one that counts
                    else f"per_device_batch={run.per_device_batch}") + f"), {run.steps} steps",
        "optimizer": _optimizer_words(setup),
        "dtypes": f"params {run.param_dtype}, compute {compute}; softmax, norms and loss float32",
        "kernels": f"{options.describe(hasattr(setup.model, 'n_experts'))}, the loss in "
                   f"{run.loss_chunks} chunk(s)",
        "placement": _placement_words(setup),
        "xla flags": flags_line(run, target),
        "data": _data_words(setup, batch),
        "checkpoints": _checkpoint_words(setup, run_dir, first_step),
        "output": _output_words(setup, run_dir),
    }
    return {k: v for k, v in rows.items() if v}


# The words that change what a fit keeps of the experiment.
KEPT = ("model.", "seq=", "per_device_batch=", "compute_dtype=", "param_dtype=", "quant",
        "preset=", "placement.", "xla_flags.")


def _fit_words(setup, target) -> str:
    """What a fit keeps and reduces, the machine and its budget, what the search found."""
    fit, full = setup.fit, setup.experiment.model
    reduced = [f"layers {fit.layers} of {full.n_layers}", *fit.reductions()]
    memory = fit.memory
    placement = ("the placement preset=auto chose" if setup.run.preset == activations.AUTO
                 else "placement")
    given = [a for a in setup.args if a.startswith(KEPT) and a.partition("=")[0] not in fit.words]
    kept = (f"the experiment's layer, sequence, micro batch per device, dtypes, NVFP4, "
            f"{placement} and XLA flags (below)")
    if given:
        kept += f", with the command line's {' '.join(given)}"
    words = [f"kept: {kept}; reduced: {'; '.join(reduced)}",
             f"machine: {target.description}; budget per device {fit.budget.device_words}, "
             f"host {fit.budget.host_words}",
             f"{fit.found()}: {fit.layers} layers take {size_words(memory.device)} per device and "
             f"{size_words(memory.host)} in host memory (compiled)"]
    if fit.over is not None:
        words[-1] += (f"; one more layer does not fit: {size_words(fit.over.device)}, "
                      f"{size_words(fit.over.host)} in host memory")
    return _INDENT.join(words)


def _optimizer_words(setup) -> str:
    o, run = setup.run.optimizer, setup.run
    words = (f"AdamW lr {o.lr:g} after {o.warmup_steps} warm-up steps, cosine to "
             f"{o.min_lr_ratio:g}x; b1 {o.b1:g}, b2 {o.b2:g}, weight decay {o.weight_decay:g}; "
             f"gradients clipped to norm {o.clip_norm:g}")
    if hasattr(setup.model, "n_experts"):
        words += (f"; router bias rate {run.router_bias_rate:g}, balance loss weight "
                  f"{run.balance_loss_weight:g}")
    return words


def _placement_words(setup) -> str:
    run, placement = setup.run, setup.placement
    state = (f"; optimizer state on {run.optimizer_state}, layers' weights on "
             f"{run.parameters}")
    chosen = "" if setup.choice is None else setup.choice.words() + _INDENT
    if placement is None:
        return chosen + "none: no checkpointing, autodiff keeps every residual on device" + state
    changes = ", ".join(f"{k}={v}" for k, v in run.tag_changes.items())
    return chosen + (f"{run.preset}{f' with {changes}' if changes else ''}: " + "; ".join(
        f"{scan}: " + (" ".join(f"{t}={p}" for t, p in table.items()) or "-")
        for scan, table in placement.items()) + "; all else remat" + state)


def _data_words(setup, batch_size: int) -> str:
    run, data = setup.run, setup.data
    words = f"{data.describe()}; seed {run.seed}"
    if data.unigram_entropy is not None:
        words += (f"{_INDENT}unigram entropy {data.unigram_entropy:.4f} nats/token (the loss of "
                  "a model that ignores the context)")
    if run.eval_every:
        words += (f"{_INDENT}evaluated every {run.eval_every} steps and after the last: the mean "
                  f"loss over {run.eval_batches} x {batch_size} windows of val.bin spread evenly "
                  f"over its {len(data.val.tokens):,} tokens, the same each time")
    return words


def _checkpoint_words(setup, run_dir, first_step: int) -> str:
    run, resume = setup.run, setup.resume
    every = (f"every {run.checkpoint_every} steps and at the end, the newest {run.keep} kept"
             if run.checkpoint_every else "off")
    words = f"{every}; on SIGTERM or Ctrl-C at the next step boundary; {run_dir.checkpoints}"
    if run.resume:
        words += (f"{_INDENT}resumed from {resume.directory if resume else run.resume} at step "
                  f"{first_step - 1} (resume={run.resume}; data continues: batches are a "
                  "function of (seed, step))")
    return words


def _output_words(setup, run_dir) -> str:
    words = str(run_dir.path)
    if setup.run.tensorboard:
        words += "; metrics also as TensorBoard scalars in tensorboard/"
    if setup.run.profile:
        words += "; a profile of steps 2-4 in profile/"
    return words


def lines(setup, program, readings, run_dir, first_step: int) -> list[str]:
    """The header (the program compiled), then where each offloaded activation lives."""
    compiled, target = readings.compiled, program.target
    rows = settings_rows(setup, target, program.options, run_dir, first_step)
    rows["memory"] = f"{compiled.device / GiB:.2f} GiB per device"
    if pool := target.pool_bytes():
        fraction, variable = backend.memory_fraction()
        rows["memory"] += f" of JAX's {pool / GiB:.1f} GiB pool ({variable}={fraction:g})"
    if target.platform == "gpu":
        rows["memory"] += f", {compiled.host / GiB:.2f} GiB in pinned host memory (compiled)"
    if any(readings.link):
        rows["memory"] += ("; over the host link per step {} to host, {} back (traced{})"
                           .format(*map(size_words, readings.link), "" if target.platform == "gpu"
                                   else f"; a {target.platform} has no host link"))
    rows["compile"] = (f"{program.compile_s:.1f} s (the step"
                       + (" and the evaluation" if setup.run.eval_every else "")
                       + f"); model {readings.flops / 1e12:,.2f} TFLOP per device per step "
                       f"(MaxText's formula); its checkpoint policies recompute "
                       f"{readings.recomputed / 1e12:.3g} TFLOP (matrix products)")
    out = ["=" * 100, *(f"{key:<11} {rows[key]}" for key in ROWS if key in rows)]
    if readings.offloaded:
        hlo = program.step.as_text() if target.platform == "gpu" else None
        out += ["-" * 100, "offloaded, per layer and device, in this run's compiled program:",
                *own_program.placement_lines(readings.offloaded, hlo)]
    out += own_program.unplaced_lines(readings.offloaded, setup.run.tag_changes)
    return [*out, "=" * 100]
