"""The math of one training step: loss, optimizer, sharded state, the jitted step.

Shared by the trainer (train.py), the memory plan and placement proof (plan.py), the tests
and the benchmarks; nothing here reads experiments or the command line.
"""

from functools import partial

import jax
import jax.numpy as jnp
import optax
from einops import rearrange

from backend import Target, kernel_checks
from configs import ConfigError, OptimizerConfig, RunConfig
from model import common, deepseek, llama, quant
from model.common import constrain, unembed
from model.config import DeepSeekConfig, LlamaConfig
from offload import policies


def cross_entropy(logits, targets):
    """Mean next-token cross-entropy in fp32; logits [B, T, V], targets [B, T]."""
    # logsumexp - the target's logit is -log_softmax[target]; its gradient is softmax - one_hot,
    # with no [B, T, V] log-probabilities kept for the backward pass.
    logits = logits.astype(jnp.float32)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logits)


FAMILIES = {LlamaConfig: llama, DeepSeekConfig: deepseek}


def family(model):
    """The model module (param_specs, forward, training_flops, SCANS) of a model config."""
    return FAMILIES[type(model)]


def scan_tags(model) -> dict[str, tuple[str, ...]]:
    return policies.SCAN_TAGS[family(model).__name__.rpartition(".")[2]]


def chunked_cross_entropy(x, params, targets, eps: float, chunks: int, rules=None):
    """`cross_entropy` of the final norm and LM head's logits of x [B, T, D], T/chunks
    positions of every sequence at a time. A chunk's [B, T/chunks, V] fp32 logits exist only
    while it runs and again in the backward pass (recomputed: one more LM-head GEMM), instead
    of all B x T x V logits and their gradient at once: 2 x 15.8 GiB per GPU for DeepSeek-V3
    at micro batch 8, 2 x 7.8 GiB for Llama 405B at 2."""
    if chunks == 1:
        return cross_entropy(unembed(x, params["final_norm"], params["lm_head"], eps), targets)

    def chunk(total, inputs):
        x, targets = inputs
        logits = unembed(x, params["final_norm"], params["lm_head"], eps)
        return total + cross_entropy(logits, targets), None

    # Chunks along the sequence, so each holds every (batch-sharded) sequence.
    xs = constrain(rearrange(x, "b (c t) d -> c b t d", c=chunks), rules,
                   (None, "batch", "seq", None))
    ts = rearrange(targets, "b (c t) -> c b t", c=chunks)
    total, _ = jax.lax.scan(jax.checkpoint(chunk, prevent_cse=False),
                            jnp.zeros((), jnp.float32), (xs, ts))
    return total / chunks


def loss_fn(params, batch, *, model, policies, rules, dtype, balance_weight=0.0,
            loss_chunks=1, **options):
    """batch [B, T+1]: predict tokens 1..T from tokens 0..T-1. (loss, aux): aux holds the
    cross-entropy and, for MoE models, the expert loads and the balance term."""
    x, stats = family(model).decode(params, batch[:, :-1], model, policies=policies,
                                    rules=rules, dtype=dtype, **options)
    loss = chunked_cross_entropy(x, params, batch[:, 1:], model.norm_eps, loss_chunks, rules)
    aux = {"cross_entropy": loss, **stats}
    if "balance_loss" in stats:
        loss = loss + balance_weight * stats["balance_loss"].sum()
    return loss, aux


def update_router_bias(params, expert_load, rate: float):
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step, every expert's selection
    bias moves by `rate` towards balance (up if it got fewer tokens than the mean, down if
    more). It is not a gradient step: the bias never receives a gradient."""
    load = expert_load.astype(jnp.float32)
    step = rate * jnp.sign(load.mean(axis=-1, keepdims=True) - load)
    moe = params["moe_layers"]
    return {**params, "moe_layers": {**moe, "router_bias": moe["router_bias"] + step}}


def train_step(state, batch, *, loss, optimizer, router_bias_rate=0.0):
    (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(state["params"], batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": aux["cross_entropy"], "grad_norm": optax.tree.norm(grads)}
    if "expert_load" in aux:
        params = update_router_bias(params, aux["expert_load"], router_bias_rate)
        load = aux["expert_load"].astype(jnp.float32)
        metrics["expert_load_max_over_mean"] = (load.max(-1) / load.mean(-1)).max()
        metrics["balance_loss"] = aux["balance_loss"].mean()
        metrics["expert_dropped"] = aux["expert_dropped"].sum() / load.sum()
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


def make_optimizer(cfg: OptimizerConfig, steps: int):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, max(steps, cfg.warmup_steps + 1), cfg.lr * cfg.min_lr_ratio)
    # No weight decay on norm weights (the usual choice for RMSNorm gains), nor on the router
    # bias, which has no gradient (Adam then moves it by exactly zero) and its own update rule.
    decay = partial(jax.tree_util.tree_map_with_path, lambda path, _: not str(
        path[-1].key).endswith(("norm", "router_bias")))
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, cfg.b1, cfg.b2, weight_decay=cfg.weight_decay,
                                   mask=decay))


def abstract_state(model, run: RunConfig, rules: common.AxisRules, optimizer):
    """The train state as sharded ShapeDtypeStructs: what init_state makes, without making it."""
    specs = family(model).param_specs(model)
    params = common.abstract_params(specs, jnp.dtype(run.param_dtype))
    param_shardings = common.param_shardings(specs, rules)
    replicated = rules.sharding(())
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, opt_state, param_shardings,
                                          transform_non_params=lambda _: replicated)
    shapes = {"params": params, "opt_state": opt_state,
              "step": jax.ShapeDtypeStruct((), jnp.int32)}
    shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated}
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, shardings)


def abstract_batch(run: RunConfig, rules: common.AxisRules, n_devices: int):
    return jax.ShapeDtypeStruct((run.batch(n_devices), run.seq + 1), jnp.int32,
                                sharding=rules.sharding(("batch", None)))


def compiler_options(run: RunConfig, target: Target) -> dict:
    """The run's XLA flags as per-compile options, typed; a GPU target only, so they can never
    break a CPU compile. Compile-only devices also turn off XLA's CUB radix sort, whose
    rewriter asks the CUDA runtime for a device (a real GPU keeps it)."""
    if target.platform != "gpu":
        return {}
    def typed(v: str):
        return {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
    options = {k: typed(v) for k, v in run.xla_flags.items()}
    if target.gpu is not None:
        options["xla_gpu_enable_cub_radix_sort"] = False
    return options


def axis_rules(run: RunConfig, mesh) -> common.AxisRules:
    rules = common.AxisRules(mesh=mesh)
    return rules.expert_parallel() if run.expert_parallel else rules


def forward_options(model, run: RunConfig, fsdp_devices: int, target: Target) -> dict:
    """The forward arguments that depend on the target: the attention kernel (cuDNN's fused
    one on GPUs in bf16/fp16, XLA's elsewhere, and always on target "any"), the NVFP4 path
    and, for MoE models, how routed experts are computed (grouped GEMMs on accelerators; every
    expert densely on CPUs, where ragged_dot is slow) and split (over the fsdp devices, under
    expert parallelism)."""
    on_cpu = target.platform == "cpu"
    attention = "xla" if target.platform == "any" else run.attention
    if attention == "auto":
        fused = target.platform == "gpu" and run.compute_dtype in ("bfloat16", "float16")
        attention = "cudnn" if fused else "xla"
    options = {"attention": None if attention == "xla" else attention,
               "quantization": quantization(run, target)}
    if isinstance(model, DeepSeekConfig) and run.expert_parallel:
        # A device runs each of its experts as one GEMM over its blocks: no expert path.
        options["expert_parallel"] = deepseek.ExpertParallel(fsdp_devices, run.expert_capacity)
    elif isinstance(model, DeepSeekConfig):
        path = run.expert_path
        options["expert_path"] = ("dense" if on_cpu else "sorted") if path == "auto" else path
    return options


def quantization(run: RunConfig, target: Target) -> quant.Quantization | None:
    """NVFP4 products on Blackwell's FP4 tensor cores (JAX's block-scaled dot, 1x16 blocks
    only), else quantize-dequantize and a GEMM in the compute dtype."""
    if run.quant == "none":
        return None
    two_d = run.quant_tiles == "16x16"
    return quant.Quantization("scaled" if target.blackwell and not two_d else "dequantize",
                              two_d)


def quantization_problems(model, run: RunConfig) -> list[str]:
    """Whether NVFP4 can encode every quantized matrix of `model` (dims multiples of 16),
    found by tracing its forward on abstract values."""
    if run.quant == "none":
        return []
    params = common.abstract_params(family(model).param_specs(model))
    tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    two_d = run.quant_tiles == "16x16"
    forward = partial(family(model).forward, cfg=model,
                      quantization=quant.Quantization("dequantize", two_d))
    try:
        jax.eval_shape(forward, params, tokens)
    except quant.QuantError as e:
        return [f"quant={run.quant}: {e}"]
    return []


def make_loss(model, run: RunConfig, tables: dict | None, rules, target: Target,
              fsdp_devices: int = 0):
    """The loss of a sharded step (`rules`), or, with rules=None, of one device's share traced
    alone, which under expert parallelism needs the number of `fsdp_devices` it is one of."""
    fsdp_devices = fsdp_devices or (rules.mesh.shape.get("fsdp", 1) if rules else 1)
    return partial(loss_fn, model=model, policies=policies.checkpoint_policies(tables),
                   rules=rules, dtype=jnp.dtype(run.compute_dtype),
                   balance_weight=run.balance_loss_weight, loss_chunks=run.loss_chunks,
                   **forward_options(model, run, fsdp_devices, target))


def make_step(model, run: RunConfig, tables: dict | None, rules, optimizer, target: Target):
    """The jitted train step, its state donated."""
    step = partial(train_step, loss=make_loss(model, run, tables, rules, target),
                   optimizer=optimizer, router_bias_rate=run.router_bias_rate)
    return jax.jit(step, donate_argnums=0)


def compile_step(model, run: RunConfig, tables: dict | None, rules, optimizer, target: Target):
    """The train step as `target` runs it, compiled ahead of time from the abstract state and
    batch on `rules.mesh` (nothing allocated): a run calls it with its own devices, `--compile`
    and the tests with compile-only GPUs, so both compile the same program."""
    step = make_step(model, run, tables, rules, optimizer, target)
    n_devices = rules.mesh.devices.size
    with kernel_checks(target):
        lowered = step.lower(abstract_state(model, run, rules, optimizer),
                             abstract_batch(run, rules, n_devices))
    try:
        return lowered.compile(compiler_options(run, target))
    except jax.errors.JaxRuntimeError as e:
        if "compile option" in str(e):  # an XLA flag this jaxlib does not know
            raise ConfigError(f"xla_flags: {str(e).splitlines()[0]}") from None
        raise
