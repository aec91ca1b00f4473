"""The plumbing between the model and the optimizer, each piece against an independent
reference: Hugging Face's loss, AdamW's definition, the schedule's formula, the study's table."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import configs
from analysis import plan

from configs import OptimizerConfig
from model import common, deepseek, llama
from model.config import DeepSeekConfig, YarnScaling
from hf.load import load_checkpoint
from offload import policies
from trainer import step as trainer_step

FIXTURES = "tests/fixtures"
GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize("name", ["llama_gqa", "deepseek_yarn"])
def test_the_training_loss_is_hugging_faces(name):
    """loss_fn on a fixture's tokens is the loss transformers computes with labels=tokens
    (it shifts them itself: position t predicts token t + 1)."""
    cfg, params = load_checkpoint(f"{FIXTURES}/{name}")
    expected = np.load(f"{FIXTURES}/{name}/expected.npz")
    options = {"expert_path": "dense"} if isinstance(cfg, DeepSeekConfig) else {}
    loss, aux = jax.jit(lambda p, b: trainer_step.loss_fn(
        p, b, model=cfg, policies=None, rules=None, dtype=jnp.float32, **options))(
        params, expected["tokens"])
    np.testing.assert_allclose(loss, expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(aux["cross_entropy"], expected["loss"], rtol=1e-5)


TINY = DeepSeekConfig(vocab=64, d_model=32, n_layers=3, n_dense_layers=1, n_heads=2,
                      q_lora_rank=16, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8,
                      v_head_dim=8, d_ff=48, moe_d_ff=16, n_experts=8, experts_per_token=2,
                      n_shared_experts=1, n_groups=4, topk_groups=2, routed_scaling=2.5,
                      rope_scaling=YarnScaling(factor=4.0, original_max_position=64))
# Kept out of weight decay (the RMSNorm gains; the router bias has its own update rule).
UNDECAYED = {"attn_norm", "mlp_norm", "q_norm", "kv_norm", "final_norm", "router_bias"}


def named_leaves(tree) -> dict[str, jax.Array]:
    return {jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def zero_gradient_steps(params, optimizer, steps: int) -> list:
    """The parameters after each of `steps` optimizer steps whose gradients are all zero."""
    state, history = optimizer.init(params), [params]
    zeros = jax.tree.map(jnp.zeros_like, params)
    for _ in range(steps):
        updates, state = optimizer.update(zeros, state, history[-1])
        history.append(optax.apply_updates(history[-1], updates))
    return history


@pytest.mark.parametrize("family, model", [(deepseek, TINY),
                                           (llama, configs.get("llama8b-offload").proxy_model)])
def test_a_zero_gradient_step_decays_every_matrix_and_nothing_else(family, model):
    """AdamW (optax's definition, decoupled): with zero gradients the Adam term is 0, so one
    step moves each decayed weight by exactly -lr x weight_decay x itself."""
    lr, decay = 0.01, 0.1
    mesh = common.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
    params = common.init_params(family.param_specs(model), common.AxisRules(mesh=mesh),
                                jax.random.key(0))
    optimizer = trainer_step.make_optimizer(
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
    optimizer = trainer_step.make_optimizer(OptimizerConfig(
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
    moved = trainer_step.update_router_bias(params, jnp.asarray(load), 0.01)
    want = bias.copy()
    for layer in range(2):
        mean = load[layer].sum() / load.shape[1]
        for expert in range(load.shape[1]):
            want[layer, expert] += 0.01 * np.sign(mean - load[layer, expert])
    np.testing.assert_allclose(moved["moe_layers"]["router_bias"], want, atol=1e-7)


def test_the_study_llama_table():
    """experiments.md: "offload the Q, K and V projection outputs of every layer"."""
    tables = policies.placement_tables("qkv_offload", {}, llama.SCANS)
    assert tables == {"layers": {"query_proj": "offload", "key_proj": "offload",
                                 "value_proj": "offload"}}
    assert configs.get("llama405b-offload").run.policy == "qkv_offload"


def test_the_study_deepseek_tables_tag_by_tag():
    """experiments.md: in the MoE layers the MLA query and key/value projection
    intermediates and the routed experts' up-projections; in the dense layers the MLP up and
    down projections. Offloaded in `dsv3_offload`, kept on device in `dsv3_device`."""
    moe = {"query_wa_proj", "mla_q", "kv_wa_proj", "mla_kv", "moe_mlpwi_0", "moe_mlpwi_1"}
    dense = {"mlpwi_0", "mlpwi_1", "mlpwo"}
    for preset, place in [("dsv3_offload", "offload"), ("dsv3_device", "device")]:
        tables = policies.placement_tables(preset, {}, deepseek.SCANS)
        assert tables == {"dense_layers": {t: place for t in dense},
                          "moe_layers": {t: place for t in moe}}


def test_the_deepseek_offload_plan_stores_the_tables_tensors_on_host():
    """Per GPU at micro batch 8 x 4096 tokens, bf16, from the tensors' shapes: the MLA
    latents [8, 4096, 1536 / 1536 / 512 + 64 / 512], and the experts' up-projections over
    their blocks, 256 experts x ceil(1.25 x 8 x 4096 x 8 / 256) = 1280 rows x 2048, in each of
    58 MoE layers; the dense MLP's [8, 4096, 18432] up-projections in each of 3 dense layers
    (its down-projection is never read by the backward pass: nothing to store)."""
    tokens = 8 * 4096
    latents = tokens * (1536 + 1536 + 576 + 512) * 2
    experts = 2 * 256 * math.ceil(1.25 * tokens * 8 / 256) * 2048 * 2
    dense = 2 * tokens * 18432 * 2
    host = 58 * (latents + experts) + 3 * dense
    assert f"{host / GiB:.1f}" == "166.5"
    experiment = configs.get("deepseek671b-offload")
    tables = policies.placement_tables("dsv3_offload", {}, deepseek.SCANS)
    assert plan.full_scale(experiment, tables).host_activations == host
