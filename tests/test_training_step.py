"""The optimizer step and the router-bias update, each against its definition: AdamW's
decoupled weight decay and its mask, the warmup + cosine schedule, DeepSeek-V3's bias rule."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import OptimizerConfig
from conftest import SHARDED_DEEPSEEK, TINY_LLAMA
from model import common, deepseek, llama
from trainer.step import make_optimizer, update_router_bias


# Kept out of weight decay (the RMSNorm gains; the router bias has its own update rule).
UNDECAYED = {"attn_norm", "mlp_norm", "q_norm", "kv_norm", "final_norm", "router_bias"}

def named_leaves(tree) -> dict[str, jax.Array]:
    return {jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}

def zero_gradient_steps(params, optimizer, steps: int) -> list:
    """The parameters after each of `steps` optimizer steps whose gradients are all zero."""
    @jax.jit
    def step(params, state):
        updates, state = optimizer.update(jax.tree.map(jnp.zeros_like, params), state, params)
        return optax.apply_updates(params, updates), state

    state, history = optimizer.init(params), [params]
    for _ in range(steps):
        params, state = step(history[-1], state)
        history.append(params)
    return history


@pytest.mark.parametrize("family, model", [(deepseek, SHARDED_DEEPSEEK),
                                           (llama, TINY_LLAMA)])
def test_a_zero_gradient_step_decays_every_matrix_and_nothing_else(family, model):
    """AdamW (optax's definition, decoupled): with zero gradients the Adam term is 0, so one
    step moves each decayed weight by exactly -lr x weight_decay x itself."""
    lr, decay = 0.01, 0.1
    mesh = common.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
    params = common.init_params(family.param_specs(model), common.AxisRules(mesh=mesh),
                                jax.random.key(0))
    optimizer = make_optimizer(
        OptimizerConfig(lr=lr, warmup_steps=0, weight_decay=decay), steps=10)
    before, after = (named_leaves(p) for p in zero_gradient_steps(params, optimizer, 1))
    for key, old in before.items():
        name = key.rpartition("'")[0].rpartition("'")[2]
        if name in UNDECAYED:
            np.testing.assert_array_equal(after[key], old, err_msg=key)
        else:
            stacked = not key.startswith(("['embed']", "['lm_head']"))
            assert old.ndim - stacked >= 2, key  # a matrix (each layer's, when stacked)
            np.testing.assert_allclose(after[key], old * (1 - lr * decay), rtol=2e-7,
                                       err_msg=key)

def test_the_learning_rate_warms_up_then_decays_by_a_cosine():
    """The rate of each step, read off the decay of a weight under zero gradients, against the
    formula: linear from 0 to the peak over the warmup, then a cosine to min_lr_ratio x peak
    at the end of the run."""
    peak, floor, warmup, steps, decay = 0.5, 0.1, 4, 12, 0.5
    optimizer = make_optimizer(OptimizerConfig(
        lr=peak, warmup_steps=warmup, min_lr_ratio=floor, weight_decay=decay), steps=steps)
    history = zero_gradient_steps({"w": jnp.ones((2, 2))}, optimizer, steps)
    rates = [float((a["w"][0, 0] - b["w"][0, 0]) / (decay * a["w"][0, 0]))
             for a, b in zip(history, history[1:])]

    def formula(t):
        if t < warmup:
            return peak * t / warmup
        cosine = 0.5 * (1 + math.cos(math.pi * (t - warmup) / (steps - warmup)))
        return peak * floor + (peak - peak * floor) * cosine

    assert rates[0] == 0  # the first step moves nothing: warmup starts at 0
    assert rates[warmup] == pytest.approx(peak, rel=1e-5)
    np.testing.assert_allclose(rates, [formula(t) for t in range(steps)], rtol=1e-5, atol=1e-7)

def test_the_router_bias_moves_against_each_layers_own_mean_load():
    """DeepSeek-V3's update, layer by layer: b += rate x sign(mean load of the layer - load).
    The two layers' mean loads differ (2 and 3), so the global mean (2.5) would not do."""
    load = np.array([[5, 0, 3, 3, 1, 2, 2, 0], [1, 1, 3, 1, 1, 1, 8, 8]])
    bias = np.linspace(-0.2, 0.2, 16, dtype=np.float32).reshape(2, 8)
    params = {"moe_layers": {"router_bias": jnp.asarray(bias)}}
    moved = update_router_bias(params, jnp.asarray(load), 0.01)
    want = bias.copy()
    for layer in range(2):
        mean = load[layer].sum() / load.shape[1]
        for expert in range(load.shape[1]):
            want[layer, expert] += 0.01 * np.sign(mean - load[layer, expert])
    np.testing.assert_allclose(moved["moe_layers"]["router_bias"], want, atol=1e-7)
