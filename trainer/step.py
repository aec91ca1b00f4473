"""The math of one training step (the loss, the optimizer, the router-bias update, the step),
shared by the trainer, the study tools and the tests; it reads no experiment or command line."""

from functools import partial

import jax
import jax.numpy as jnp
import optax
from einops import rearrange

from configs import OptimizerConfig, RunConfig
from model import families
from model.layers import unembed
from model.sharding import constrain
from offload import state as host_state
from offload.state import DEVICE


def cross_entropy(logits, targets):
    """Mean next-token cross-entropy in fp32; logits [B, T, V], targets [B, T]."""
    # logsumexp - the target's logit is -log_softmax[target]; its gradient is softmax - one_hot,
    # with no [B, T, V] log-probabilities kept for the backward pass.
    logits = logits.astype(jnp.float32)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logits)


def chunked_cross_entropy(x, params, targets, eps: float, chunks: int, rules=None):
    """`cross_entropy` of the final norm and LM head's logits of x [B, T, D], T/chunks
    positions of every (batch-sharded) sequence at a time: a chunk's fp32 logits exist only
    while it runs and, recomputed, in the backward pass (docs/model.md: what that saves)."""
    def loss(x, targets):
        return cross_entropy(unembed(x, params["final_norm"], params["lm_head"], eps), targets)

    def chunk(total, inputs):
        return total + loss(*inputs), None

    if chunks == 1:
        return loss(x, targets)
    xs = constrain(rearrange(x, "b (c t) d -> c b t d", c=chunks), rules,
                   (None, "batch", "seq", None))
    ts = rearrange(targets, "b (c t) -> c b t", c=chunks)
    total, _ = jax.lax.scan(jax.checkpoint(chunk, prevent_cse=False),
                            jnp.zeros((), jnp.float32), (xs, ts))
    return total / chunks


def loss_fn(params, batch, key=None, *, model, options, balance_weight=0.0, loss_chunks=1):
    """batch [B, T+1]: predict tokens 1..T from tokens 0..T-1, the forward as `options` says;
    `key`: the step's random bits (an FP4 backward's rounding). (loss, aux): aux holds the
    cross-entropy and, for MoE models, the expert loads and the balance term."""
    x, stats = families.of(model).trunk(params, batch[:, :-1], model, options, key)
    loss = chunked_cross_entropy(x, params, batch[:, 1:], model.norm_eps, loss_chunks,
                                 options.rules)
    aux = {"cross_entropy": loss, **stats}
    if "balance_loss" in stats:
        loss = loss + balance_weight * stats["balance_loss"].sum()
    return loss, aux


def update_router_bias(params, expert_load, rate: float):
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step, every expert's selection
    bias moves by `rate` towards balance. It is not a gradient step: the bias never gets one."""
    load = expert_load.astype(jnp.float32)
    step = rate * jnp.sign(load.mean(axis=-1, keepdims=True) - load)
    moe = params["moe_layers"]
    bias, space = moe["router_bias"], jax.typeof(moe["router_bias"]).memory_space
    if space == DEVICE:
        bias = bias + step
    else:  # parameters=host: added on the device, written back to host
        with jax.named_scope(host_state.SCOPE):
            bias = jax.device_put(jax.device_put(bias, DEVICE) + step, space)
    return {**params, "moe_layers": {**moe, "router_bias": bias}}


def train_step(state, batch, *, model, run: RunConfig, options):
    """One step of `run` for `model`, its forward as `options` say: the loss's gradients,
    clipping and AdamW's update (the moments and, parameters=host, the layers' weights on the
    device or in host memory: offload/state.py), DeepSeek's router bias. The step's key is a
    function of (seed, step), so a resumed run draws the same bits; the experts' drops are
    reported apart for each device of the expert axis."""
    key = jax.random.fold_in(jax.random.key(run.seed), state["step"])
    loss = partial(loss_fn, model=model, options=options, balance_weight=run.balance_loss_weight,
                   loss_chunks=run.loss_chunks)
    scans = families.of(model).SCANS
    params = state["params"]
    if run.parameters == "host":  # each layer's share of the norm taken as its gradient is made
        params = host_state.with_norm_probes(params, scans)
    (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(params, batch, key)
    grads, squares = host_state.norm_probes(grads, scans)
    _, adamw = optimizer_parts(run.optimizer, run.steps)
    norm = host_state.global_norm(grads, scans, squares)
    params, opt_state = host_state.update(
        grads, state["opt_state"], state["params"], norm, run.optimizer.clip_norm, adamw, scans,
        params_on_host=run.parameters == "host", moments_on_host=run.optimizer_state == "host")
    metrics = {"loss": aux["cross_entropy"], "grad_norm": norm}
    if "expert_load" in aux:
        params = update_router_bias(params, aux["expert_load"], run.router_bias_rate)
        metrics |= expert_metrics(aux, run.mesh.expert)
        metrics["balance_loss"] = aux["balance_loss"].mean()
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


def expert_metrics(aux, devices: int) -> dict:
    """The MoE layers' routing [L, E]: the most loaded expert over the mean (worst layer), the
    share of (token, expert) pairs dropped, overall and for the worst device of the expert axis
    (its E/devices experts, in order; one none of whose experts was chosen drops nothing)."""
    load = aux["expert_load"].astype(jnp.float32)
    per_device = rearrange(load, "l (g e) -> g (l e)", g=devices).sum(-1)
    dropped = rearrange(aux["expert_dropped"], "l (g e) -> g (l e)", g=devices).sum(-1)
    share = jnp.where(per_device > 0, dropped / jnp.maximum(per_device, 1), 0.0)
    return {"expert_load_max_over_mean": (load.max(-1) / load.mean(-1)).max(),
            "expert_dropped": dropped.sum() / load.sum(),
            "expert_dropped_worst_device": share.max()}


def make_optimizer(cfg: OptimizerConfig, steps: int):
    return optax.chain(*optimizer_parts(cfg, steps))


def optimizer_parts(cfg: OptimizerConfig, steps: int):
    """(global-norm clipping, AdamW): the optimizer is their chain."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, max(steps, cfg.warmup_steps + 1), cfg.lr * cfg.min_lr_ratio)
    # No weight decay on norm weights (the usual choice for RMSNorm gains), nor on the router
    # bias, which has no gradient (Adam then moves it by exactly zero) and its own update rule.
    decay = partial(jax.tree_util.tree_map_with_path, lambda path, _: not str(
        path[-1].key).endswith(("norm", "router_bias")))
    return (optax.clip_by_global_norm(cfg.clip_norm),
            optax.adamw(schedule, cfg.b1, cfg.b2, weight_decay=cfg.weight_decay, mask=decay))
