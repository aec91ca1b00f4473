"""The math of one training step: loss, optimizer, sharded state, the jitted step.

Shared by the trainer (train.py), the memory plan and placement proof (plan.py), the tests
and the benchmarks; nothing here reads experiments or the command line.
"""

from functools import partial

import jax
import jax.numpy as jnp
import optax

from configs import OptimizerConfig, RunConfig
from model import common, llama
from offload import policies


def cross_entropy(logits, targets):
    """Mean next-token cross-entropy in fp32; logits [B, T, V], targets [B, T]."""
    # logsumexp - the target's logit is -log_softmax[target]; its gradient is softmax - one_hot,
    # with no [B, T, V] log-probabilities kept for the backward pass.
    logits = logits.astype(jnp.float32)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logits)


def loss_fn(params, batch, *, model, policy, rules, dtype):
    """batch [B, T+1]: predict tokens 1..T from tokens 0..T-1."""
    logits = llama.forward(params, batch[:, :-1], model, policy=policy, rules=rules, dtype=dtype)
    return cross_entropy(logits, batch[:, 1:])


def train_step(state, batch, *, loss, optimizer):
    value, grads = jax.value_and_grad(loss)(state["params"], batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": value, "grad_norm": optax.tree.norm(grads)}
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


def make_optimizer(cfg: OptimizerConfig, steps: int):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, max(steps, cfg.warmup_steps + 1), cfg.lr * cfg.min_lr_ratio)
    # No weight decay on norm weights, the usual choice for RMSNorm gains.
    decay = partial(jax.tree_util.tree_map_with_path,
                    lambda path, _: not str(path[-1].key).endswith("norm"))
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, cfg.b1, cfg.b2, weight_decay=cfg.weight_decay,
                                   mask=decay))


def abstract_state(model, run: RunConfig, rules: common.AxisRules, optimizer):
    """The train state as sharded ShapeDtypeStructs: what init_state makes, without making it."""
    specs = llama.param_specs(model)
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


def gpu_compiler_options(flags: dict[str, str]) -> dict:
    """XLA flags as per-compile options, typed; applied only on a GPU backend."""
    def typed(v: str):
        return {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
    return {k: typed(v) for k, v in flags.items()}


def make_step(model, run: RunConfig, table: dict | None, rules, optimizer):
    """The jitted train step (state donated); XLA flags go in only on a GPU backend."""
    policy = None if table is None else policies.checkpoint_policy(table)
    loss = partial(loss_fn, model=model, policy=policy, rules=rules,
                   dtype=jnp.dtype(run.compute_dtype))
    on_gpu = jax.default_backend() == "gpu"
    return jax.jit(partial(train_step, loss=loss, optimizer=optimizer), donate_argnums=0,
                   compiler_options=gpu_compiler_options(run.xla_flags) if on_gpu else None)
