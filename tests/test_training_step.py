"""The optimizer step and the router-bias update, each against its definition: AdamW's
decoupled weight decay and its mask, the warmup + cosine schedule, DeepSeek-V3's bias rule;
and the trainer's whole step, number for number, against a float64 reference written from
those definitions (tests/reference_step.py)."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import configs
from configs import MeshConfig, OptimizerConfig
import reference_step
from conftest import SHARDED_DEEPSEEK, SHARDED_LLAMA, TINY_LLAMA, one_device_params, tokens
from model import deepseek, llama
from model.options import ForwardOptions
from model.params import init_params
from model.sharding import AxisRules, make_mesh
from runtime import setup as runtime_setup
from trainer import target as trainer_target
from trainer.program import Program, make_loss
from trainer.step import loss_fn, make_optimizer, update_router_bias


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
    mesh = make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
    params = init_params(family.param_specs(model), AxisRules(mesh=mesh),
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
    formula (tests/reference_step.py): linear from 0 to the peak over the warmup, then a
    cosine to min_lr_ratio x peak at the end of the run."""
    peak, warmup, steps, decay = 0.5, 4, 12, 0.5
    cfg = OptimizerConfig(lr=peak, warmup_steps=warmup, min_lr_ratio=0.1, weight_decay=decay)
    history = zero_gradient_steps({"w": jnp.ones((2, 2))}, make_optimizer(cfg, steps), steps)
    rates = [float((a["w"][0, 0] - b["w"][0, 0]) / (decay * a["w"][0, 0]))
             for a, b in zip(history, history[1:])]
    assert rates[0] == 0  # the first step moves nothing: warmup starts at 0
    assert rates[warmup] == pytest.approx(peak, rel=1e-5)
    np.testing.assert_allclose(
        rates, [reference_step.learning_rate(cfg, steps, t) for t in range(steps)],
        rtol=1e-5, atol=1e-7)

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


# The run's hyperparameters, none at its default, so that each wired to the wrong place shows:
# a peak rate of 0.02 (updates of a few % of the weights' scale), 2 warmup steps then a cosine
# over 2 more, and a clip norm (per model) that the first 3 steps' gradient norms exceed and
# the 4th's does not.
STEPS = 4
REFERENCE_RUN = configs.RunConfig(
    compute_dtype="float32", steps=STEPS, router_bias_rate=0.003, balance_loss_weight=0.01,
    optimizer=OptimizerConfig(lr=0.02, warmup_steps=2, min_lr_ratio=0.3, b1=0.8, b2=0.9,
                              weight_decay=0.25))
TRAINERS = {  # model, clip norm, run: an offload policy; the MoE model's experts exchanged
    "llama": (SHARDED_LLAMA, 1.5, {"preset": "qkv_offload"}),
    "llama-host-state": (SHARDED_LLAMA, 1.5, {"preset": "qkv_offload",
                                              "optimizer_state": "host"}),
    "deepseek": (SHARDED_DEEPSEEK, 2.0, {"preset": "dsv3_offload",
                                         "mesh": MeshConfig(fsdp=2, expert=4)}),
}


@pytest.mark.parametrize("name", TRAINERS)
def test_the_trainers_steps_are_a_float64_reference_written_from_the_formulas(name):
    """4 steps of the trainer's jitted step (float32, FSDP over 8 devices, activations
    offloaded) against tests/reference_step.py: the same updates in numpy float64 from their
    definitions, on float64 gradients of the reference's own parameters. After every step, each
    parameter's change since the start and each moment equal the reference's to 2e-4 of their
    norm: float32 gradients differ from float64 ones by ~1e-6 of their scale, which Adam's
    division by each element's own gradient size amplifies in the few elements whose gradient
    is tiny (measured: at most 4e-5 of a leaf's update norm, the DeepSeek embedding; moments
    3e-6). A constant, rate or order wired wrongly moves a whole leaf by 1e-2 of it or more.
    The first step's rate is 0 (warmup from 0): no parameter moves but the router bias."""
    model, clip_norm, changes = TRAINERS[name]
    run = dataclasses.replace(REFERENCE_RUN, optimizer=dataclasses.replace(
        REFERENCE_RUN.optimizer, clip_norm=clip_norm), **changes)
    params = one_device_params(model)
    batches = [np.asarray(tokens(model, batch=8, seq=17, seed=s)) for s in range(STEPS)]
    got, gradients = trainer_steps(model, run, params, batches), float64_gradients(model, run,
                                                                                  params)
    start = flat(params)
    want = {"params": start, "mu": {k: 0 * v for k, v in start.items()},
            "nu": {k: 0 * v for k, v in start.items()}, "t": 0}
    clipped = []
    for t, (batch, state) in enumerate(zip(batches, got)):
        grads, load = gradients(want["params"], batch)
        clipped.append(reference_step.clip_scale(grads, run.optimizer.clip_norm) < 1)
        want = reference_step.reference_step(want, grads, load, run.optimizer, run.steps,
                                             run.router_bias_rate)
        for part in ("params", "mu", "nu"):
            for key, value in want[part].items():
                change = value - (start[key] if part == "params" else 0)
                error = np.linalg.norm(state[part][key] - value)
                assert error <= 2e-4 * np.linalg.norm(change), (
                    f"step {t} {part} {key}: |trainer - reference| {error:.3g}, "
                    f"|reference| {np.linalg.norm(change):.3g}")
    assert clipped == [True, True, True, False]


def test_a_deepseek_step_reports_the_drops_of_the_worst_device_of_its_expert_axis():
    """What a run reports, read off the trainer's own step (train_step reads mesh.expert in
    it): expert parallelism 4 x FSDP 2 over 8 devices, blocks small enough to drop. The test
    groups the loss's per-expert loads and drops [L, E] by device of the expert axis itself
    (4 consecutive experts of 16, every MoE layer): the reported worst share is the largest
    of their drops over their pairs; the overall share and the worst layer's imbalance too.
    Guards the class: a reported figure computed with a count wired from the wrong place (the
    axis taken as one device, the fsdp axis, every device, one per expert: each gives another
    worst share here)."""
    model = SHARDED_DEEPSEEK
    run = configs.RunConfig(compute_dtype="float32", expert_capacity=1.0,
                            mesh=MeshConfig(fsdp=2, expert=4))
    params = one_device_params(model)  # the router alone chooses: a third of pairs dropped
    params["moe_layers"]["router_bias"] = jnp.zeros_like(params["moe_layers"]["router_bias"])
    batch = np.asarray(tokens(model, batch=8, seq=17, seed=3))
    program, state = trainer(model, run, params, batch.shape)
    batch = program.batch(batch)
    loss = make_loss(model, program.run, program.options)  # the step's own loss
    _, aux = jax.jit(loss)(state["params"], batch)  # before the step: it donates the state
    _, metrics = program.compile_run()(state, batch)
    load, dropped = (np.asarray(aux[k], np.float64) for k in ("expert_load", "expert_dropped"))

    def worst(devices: int) -> float:
        pairs, lost = (a.reshape(len(a), devices, -1).sum(axis=(0, 2)) for a in (load, dropped))
        return np.where(pairs > 0, lost / np.maximum(pairs, 1), 0.0).max()

    assert 0 < dropped.sum() < load.sum()
    assert all(abs(worst(devices) - worst(4)) > 0.03 for devices in (1, 2, 8, 16))
    np.testing.assert_allclose(metrics["expert_dropped_worst_device"], worst(4), rtol=1e-6)
    np.testing.assert_allclose(metrics["expert_dropped"], dropped.sum() / load.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["expert_load_max_over_mean"],
                               (load.max(axis=1) / load.mean(axis=1)).max(), rtol=1e-6)


def flat(tree) -> dict[str, np.ndarray]:
    """{"moe_layers/router_bias": float64 array, ...}"""
    return {"/".join(k.key for k in path): np.asarray(leaf, np.float64)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def float64_gradients(model, run, like):
    """(flat params, batch) -> (flat gradients, expert load or None), params nested as `like`:
    the project's loss differentiated in float64, on one device, with no checkpointing and
    every expert computed densely (each checked against the trainer's path:
    tests/test_invariances.py, tests/test_sharding.py)."""
    loss = partial(loss_fn, model=model, balance_weight=run.balance_loss_weight,
                   options=ForwardOptions("float64", experts="dense"))

    def gradients(params, batch):
        with jax.enable_x64(True):
            params = jax.tree.unflatten(jax.tree.structure(like),
                                        [jnp.asarray(a, jnp.float64) for a in params.values()])
            (_, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
                params, jnp.asarray(batch))
            load = aux.get("expert_load")
            return flat(grads), None if load is None else np.asarray(load, np.float64)
    return gradients


def trainer(model, run, params, batch_shape):
    """The trainer's own program (trainer/program.py) over 8 CPU devices, compiled for batches
    of `batch_shape`, and its first state (FSDP-sharded copies of `params`)."""
    run = dataclasses.replace(run, seq=batch_shape[1] - 1, global_batch=batch_shape[0])
    program = Program(model, run, runtime_setup.resolve_placement(model, run),
                      trainer_target.this_machine())
    shardings = jax.tree.map(lambda a: a.sharding, program.state_shapes)
    # Copies: the step donates its state, and the caller's `params` start the reference.
    params = jax.device_put(jax.tree.map(np.asarray, params), shardings["params"])
    state = {"params": params, "opt_state": jax.jit(
        program.optimizer.init, out_shardings=shardings["opt_state"])(params),
        "step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])}
    return program, state


def trainer_steps(model, run, params, batches):
    """The state after each batch of the trainer's compiled step, FSDP over 8 CPU devices."""
    program, state = trainer(model, run, params, batches[0].shape)
    history = []
    for batch in batches:
        state, _ = program.compile_run()(state, program.batch(np.asarray(batch)))
        history.append({"params": flat(state["params"]),
                        "mu": flat(optax.tree.get(state["opt_state"], "mu")),
                        "nu": flat(optax.tree.get(state["opt_state"], "nu"))})
    return history
