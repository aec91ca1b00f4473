"""FSDP over 8 devices computes what one device computes."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import training
from configs import OptimizerConfig
from model import common, llama
from model.config import LlamaConfig
from offload import policies

# Every sharded dimension (embed 64) and the batch (8) divide over 8 devices.
CFG = LlamaConfig(vocab=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  d_ff=96, rope_theta=1000.0)


def step(params, batch, rules):
    optimizer = training.make_optimizer(OptimizerConfig(lr=1e-2, warmup_steps=0), steps=4)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), int)}
    policy = policies.checkpoint_policy(policies.PRESETS["qkv_offload"])
    loss = partial(training.loss_fn, model=CFG, policies={"layers": policy}, rules=rules,
                   dtype=jnp.float32)
    grads = jax.grad(loss, has_aux=True)(params, batch)
    _, metrics = training.train_step(state, batch, loss=loss, optimizer=optimizer)
    # Not the updated parameters: Adam's first step is about lr * sign(g), so a gradient
    # near zero turns a rounding-level difference into one of order lr.
    return grads, metrics


def test_fsdp_over_8_devices_equals_one_device():
    specs = llama.param_specs(CFG)
    one = common.make_mesh((1, 1), ("data", "fsdp"), devices=jax.devices()[:1])
    eight = common.make_mesh((1, 8), ("data", "fsdp"))
    rules = common.AxisRules(mesh=eight)
    params = common.init_params(specs, common.AxisRules(mesh=one), jax.random.key(0))
    batch = np.asarray(jax.random.randint(jax.random.key(1), (8, 17), 0, CFG.vocab))

    reference = jax.jit(partial(step, rules=None))(params, batch)
    sharded_params = jax.device_put(params, common.param_shardings(specs, rules))
    assert sharded_params["layers"]["wq"].sharding.spec[1] == "fsdp"  # really sharded
    sharded_batch = jax.device_put(batch, rules.sharding(("batch", None)))
    sharded = jax.jit(partial(step, rules=rules))(sharded_params, sharded_batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
                 sharded, reference)


def test_deepseek_over_8_devices_equals_one_device():
    """MoE layers route each device's own tokens (shard_map): the loss, the expert loads and
    the gradients still equal the single-device ones."""
    import dataclasses
    from configs import RunConfig
    from model import deepseek
    from model.config import DeepSeekConfig, YarnScaling
    cfg = DeepSeekConfig(vocab=64, d_model=64, n_layers=3, n_dense_layers=1, n_heads=2,
                         q_lora_rank=16, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8,
                         v_head_dim=8, d_ff=48, moe_d_ff=16, n_experts=8, experts_per_token=2,
                         n_shared_experts=1, n_groups=4, topk_groups=2, routed_scaling=2.5,
                         rope_scaling=YarnScaling(factor=4.0, original_max_position=64))
    specs = deepseek.param_specs(cfg)
    one = common.make_mesh((1, 1), ("data", "fsdp"), devices=jax.devices()[:1])
    eight = common.make_mesh((1, 8), ("data", "fsdp"))
    params = common.init_params(specs, common.AxisRules(mesh=one), jax.random.key(0))
    batch = np.asarray(jax.random.randint(jax.random.key(1), (8, 17), 0, cfg.vocab))
    for path in deepseek.EXPERT_PATHS:
        run = dataclasses.replace(RunConfig(compute_dtype="float32"), expert_path=path)

        def loss_and_grads(params, batch, rules):
            loss = training.make_loss(cfg, run, None, rules)
            return jax.value_and_grad(loss, has_aux=True)(params, batch)

        reference = jax.jit(partial(loss_and_grads, rules=None))(params, batch)
        rules = common.AxisRules(mesh=eight)
        sharded = jax.jit(partial(loss_and_grads, rules=rules))(
            jax.device_put(params, common.param_shardings(specs, rules)),
            jax.device_put(batch, rules.sharding(("batch", None))))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
                     sharded, reference)
