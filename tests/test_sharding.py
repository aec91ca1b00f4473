"""FSDP and expert parallelism over 8 devices compute what one device computes."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import MeshConfig, OptimizerConfig, RunConfig
from conftest import SHARDED_DEEPSEEK, SHARDED_LLAMA
from model import deepseek, experts, llama
from model.options import ForwardOptions
from model.params import ParamSpec, init_params, param_shardings
from model.sharding import AxisRules, make_mesh
from offload import activations
from trainer.program import forward_options, make_loss, mesh_of
from trainer.step import expert_metrics, loss_fn, make_optimizer, train_step
from trainer.target import Target


def step(params, batch, rules, loss_chunks=1):
    run = RunConfig(optimizer=OptimizerConfig(lr=1e-2, warmup_steps=0), steps=4,
                    loss_chunks=loss_chunks)
    optimizer = make_optimizer(run.optimizer, run.steps)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), int)}
    policy = activations.checkpoint_policy(activations.PRESETS["qkv_offload"])
    options = ForwardOptions(policies=(("layers", policy),), rules=rules)
    loss = partial(loss_fn, model=SHARDED_LLAMA, loss_chunks=loss_chunks, options=options)
    grads = jax.grad(loss, has_aux=True)(params, batch)
    _, metrics = train_step(state, batch, model=SHARDED_LLAMA, run=run, options=options)
    # Not the updated parameters: Adam's first step is about lr * sign(g), so a gradient
    # near zero turns a rounding-level difference into one of order lr.
    return grads, metrics


@pytest.mark.parametrize("loss_chunks", [1, 4])
def test_fsdp_over_8_devices_equals_one_device(loss_chunks):
    """Also: the loss in 4 chunks of the sequence (logits recomputed per chunk in the
    backward pass) equals the loss of all logits at once, gradients included."""
    specs = llama.param_specs(SHARDED_LLAMA)
    one = make_mesh((1, 1), ("data", "fsdp"), devices=jax.devices()[:1])
    eight = make_mesh((1, 8), ("data", "fsdp"))
    rules = AxisRules(mesh=eight)
    params = init_params(specs, AxisRules(mesh=one), jax.random.key(0))
    batch = np.asarray(jax.random.randint(jax.random.key(1), (8, 17), 0, SHARDED_LLAMA.vocab))

    reference = jax.jit(partial(step, rules=None))(params, batch)
    sharded_params = jax.device_put(params, param_shardings(specs, rules))
    assert sharded_params["layers"]["wq"].sharding.spec[1] == "fsdp"  # really sharded
    sharded_batch = jax.device_put(batch, rules.sharding(("batch", None)))
    sharded = jax.jit(partial(step, rules=rules, loss_chunks=loss_chunks))(sharded_params,
                                                                          sharded_batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
                 sharded, reference)


# Under expert parallelism each device runs its experts as one GEMM over their blocks, whatever
# expert_path says. Mesh (data, fsdp, expert).
@pytest.mark.parametrize("expert_path, mesh", [
    ("tiled", (1, 8, 1)), ("sorted", (1, 8, 1)), ("dense", (1, 2, 4)), ("dense", (2, 2, 2))])
def test_deepseek_over_8_devices_equals_one_device(expert_path, mesh):
    """MoE layers route each device's own tokens (shard_map), with the experts gathered (FSDP)
    or split over an expert axis of 4 or 2 (expert parallelism, dropless blocks, FSDP-sharded
    over fsdp along the expert axis and gathered there; with 2 fsdp shards, and with 2 data
    replicas, each exchanging only within its own expert group), under the DeepSeek offload
    policy (what it does not save, exchanges included, is recomputed): the loss, the expert
    loads and the gradients equal those of one device without checkpointing; nothing is
    dropped."""
    specs = deepseek.param_specs(SHARDED_DEEPSEEK)
    one = make_mesh((1, 1), ("data", "fsdp"), devices=jax.devices()[:1])
    params = init_params(specs, AxisRules(mesh=one), jax.random.key(0))
    batch = np.asarray(jax.random.randint(jax.random.key(1), (8, 17), 0, SHARDED_DEEPSEEK.vocab))
    run = RunConfig(compute_dtype="float32", expert_path=expert_path, mesh=MeshConfig(*mesh))

    def loss_and_grads(params, batch, rules, run, tables):
        options = forward_options(SHARDED_DEEPSEEK, run, tables, rules, Target("cpu"))
        loss = make_loss(SHARDED_DEEPSEEK, run, options)
        return jax.value_and_grad(loss, has_aux=True)(params, batch)

    reference = jax.jit(partial(loss_and_grads, rules=None, tables=None,
                                run=dataclasses.replace(run, mesh=MeshConfig())))(params, batch)
    rules = AxisRules(mesh=mesh_of(run, jax.devices()))
    tables = activations.resolve("dsv3_offload", {}, deepseek.SCANS)
    sharded_params = jax.device_put(params, param_shardings(specs, rules))
    experts = sharded_params["moe_layers"]["we_gate"]  # [L, E, D, F]: E/(expert x fsdp) each
    assert experts.sharding.shard_shape(experts.shape)[1:3] == (
        SHARDED_DEEPSEEK.n_experts // (mesh[1] * mesh[2]), SHARDED_DEEPSEEK.d_model)
    sharded = jax.jit(partial(loss_and_grads, rules=rules, run=run, tables=tables))(
        sharded_params, jax.device_put(batch, rules.sharding(("batch", None))))
    assert sharded[0][1]["expert_dropped"].sum() == 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
                 sharded, reference)


@pytest.mark.parametrize("devices", [8, 1])
def test_expert_blocks_drop_exactly_the_pairs_beyond_their_room(devices):
    """Expert parallelism with small blocks, against float64 numpy: per device, (token,
    expert) pairs in token order (then choice) fill their expert's block of C rows; the rest
    are dropped and add nothing; every kept pair is computed exactly. The drops are counted
    per expert, and reported for the whole and for the worst device of the expert axis (the
    experts it holds). On 8 devices of an expert axis, and on one (a fit of an expert row on
    one GPU: the same blocks, no exchange)."""
    cfg, capacity, tokens = SHARDED_DEEPSEEK, 0.5, 48 // devices
    rng = np.random.default_rng(3)
    x = rng.normal(size=(devices, tokens, cfg.d_model)).astype(np.float32)  # one row a device
    layer = jax.tree.map(lambda s: rng.normal(scale=0.2, size=s.shape[1:]).astype(np.float32),
                         deepseek.param_specs(cfg)["moe_layers"],
                         is_leaf=lambda s: isinstance(s, ParamSpec))
    rules = AxisRules(mesh=make_mesh((1, devices), ("fsdp", "expert")))
    parallel = deepseek.ExpertParallel(devices, capacity)
    options = ForwardOptions(rules=rules, experts="dense", expert_parallel=parallel)
    out, stats = jax.jit(partial(deepseek.moe, cfg=cfg, options=options))(x, layer)
    weights, experts, _ = deepseek.route(x.reshape(-1, cfg.d_model), layer["router"],
                                         layer["router_bias"], cfg)
    weights = np.asarray(weights).reshape(devices, tokens, -1)
    experts = np.asarray(experts).reshape(devices, tokens, -1)
    k = cfg.experts_per_token
    room = parallel.block_rows(tokens, k, cfg.n_experts)
    assert room < tokens  # small enough to drop
    w64 = {name: np.asarray(a, np.float64) for name, a in layer.items()}
    want, dropped = np.zeros(x.shape), np.zeros(cfg.n_experts, int)
    for d in range(devices):
        used = np.zeros(cfg.n_experts, int)
        for t, j in ((t, j) for t in range(tokens) for j in range(k)):
            e = experts[d, t, j]
            if used[e] == room:
                dropped[e] += 1
                continue
            used[e] += 1
            h = x[d, t].astype(np.float64)
            gate, up = h @ w64["we_gate"][e], h @ w64["we_up"][e]
            want[d, t] += weights[d, t, j] * ((gate / (1 + np.exp(-gate)) * up) @ w64["we_down"][e])
        h = x[d].astype(np.float64)
        gate, up = h @ w64["w_gate"], h @ w64["w_up"]
        want[d] += (gate / (1 + np.exp(-gate)) * up) @ w64["w_down"]
    assert dropped.sum() > 0
    np.testing.assert_array_equal(stats["expert_dropped"], dropped)
    load = np.bincount(experts.reshape(-1), minlength=cfg.n_experts)
    # The expert axis: each device holds 16 / devices of the 16 experts.
    share = dropped.reshape(devices, -1).sum(1) / load.reshape(devices, -1).sum(1)
    assert devices == 1 or share.max() > share.min()  # they differ: the worst is not the mean
    metrics = expert_metrics({name: jnp.asarray(a)[None] for name, a in (
        ("expert_load", load), ("expert_dropped", dropped))}, devices)
    np.testing.assert_allclose(metrics["expert_dropped"], dropped.sum() / load.sum())
    np.testing.assert_allclose(metrics["expert_dropped_worst_device"], share.max())
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_dispatch_and_combine_transpose_by_gathers():
    """The exchange's gather-only dispatch and combine give autodiff's gradients of the
    plain gather and scatter-add they replace, dropped pairs and empty slots included."""
    S, k, D, slots = 6, 3, 5, 16
    rng = np.random.default_rng(4)
    x, weights = rng.normal(size=(S, D)), rng.normal(size=(S, k))
    blocks = rng.normal(size=(slots, D))
    pair_slots = rng.permutation(slots + 4)[: S * k].reshape(S, k)  # >= slots: dropped
    slot_pairs = np.full(slots, S * k)  # S * k: an empty slot
    kept = pair_slots.reshape(-1) < slots
    slot_pairs[pair_slots.reshape(-1)[kept]] = np.arange(S * k)[kept]
    assert (~kept).any() and (slot_pairs == S * k).any()

    def dispatched(x):
        return jnp.zeros((slots, D)).at[jnp.asarray(pair_slots)].set(
            jnp.broadcast_to(x[:, None], (S, k, D)), mode="drop")

    def combined(blocks, weights):
        rows = jnp.take(blocks, jnp.asarray(pair_slots), axis=0, mode="fill", fill_value=0)
        return (rows * weights[..., None]).sum(axis=1)

    probe, probe_out = rng.normal(size=(slots, D)), rng.normal(size=(S, D))
    for ours, plain, args, out_probe in [
            (lambda x: experts._dispatch(x, slot_pairs, pair_slots), dispatched, (x,), probe),
            (lambda b, w: experts._combine(b, w, slot_pairs, pair_slots), combined,
             (blocks, weights), probe_out)]:
        np.testing.assert_allclose(ours(*args), plain(*args), rtol=1e-6)
        grads = jax.grad(lambda *a: jnp.sum(ours(*a) * out_probe), argnums=range(len(args)))
        expected = jax.grad(lambda *a: jnp.sum(plain(*a) * out_probe),
                            argnums=range(len(args)))
        for got, want in zip(grads(*args), expected(*args)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# (capacity, a device's tokens S, k, E) -> rows per block: the balanced share c S k / E rounded
# up, by hand; 0 or a share of S or more: S rows. Shares below, at and above half a row.
BLOCK_ROWS = [((1.0, 1, 1, 8), 1), ((1.0, 3, 1, 8), 1), ((1.0, 5, 1, 8), 1),
              ((1.0, 4, 2, 16), 1), ((1.0, 12, 2, 16), 2), ((1.0, 18, 2, 16), 3),
              ((1.0, 20, 2, 16), 3), ((1.0, 22, 2, 16), 3), ((0.5, 6, 3, 16), 1),
              ((1.25, 16, 3, 16), 4), ((1.0, 16, 3, 16), 3), ((2.0, 8, 2, 16), 2),
              ((0.0, 7, 2, 16), 7), ((4.0, 4, 2, 4), 4)]


@pytest.mark.parametrize("case, rows", BLOCK_ROWS, ids=[
    f"share {c * s * k / e:g} of {s}" for (c, s, k, e), _ in BLOCK_ROWS])
def test_a_block_holds_the_balanced_share_rounded_up(case, rows):
    """Guards the class: the block size rounded any way but up (to nearest, half to even,
    down), which gives shares below half a row blocks of 0 rows (every pair dropped) and
    drops pairs a balanced routing sends; or a whole share rounded up once more."""
    capacity, tokens, k, n_experts = case
    assert experts.ExpertParallel(8, capacity).block_rows(tokens, k, n_experts) == rows


def test_balanced_routing_at_capacity_1_drops_nothing():
    """The end-to-end consequence, on 8 devices of an expert axis (16 experts, 2 each): 3
    tokens per device, k = 2, a balanced share of 3/8 of a row. Each device sends each expert
    at most one pair and every expert gets 3 in all: at capacity 1.0 nothing is dropped and
    the output is the float64 mixture of each token's experts."""
    devices, S, k, E, D, F = 8, 3, 2, 16, 8, 4
    rng = np.random.default_rng(5)
    x = rng.normal(size=(devices * S, D)).astype(np.float32)
    weights = rng.uniform(0.1, 1, size=(devices * S, k)).astype(np.float32)
    # Device d's pair (t, j) goes to expert 6d + 2t + j mod 16: 6 distinct experts per device.
    chosen = (6 * np.arange(devices)[:, None, None] + 2 * np.arange(S)[:, None]
              + np.arange(k)) % E
    chosen = chosen.reshape(devices * S, k).astype(np.int32)
    assert (np.bincount(chosen.reshape(-1), minlength=E) == devices * S * k // E).all()
    assert all(len(set(pairs)) == S * k for pairs in chosen.reshape(devices, S * k))
    w = {name: rng.normal(scale=0.3, size=shape).astype(np.float32) for name, shape in
         (("we_gate", (E, D, F)), ("we_up", (E, D, F)), ("we_down", (E, F, D)))}
    parallel = deepseek.ExpertParallel(devices, 1.0)
    axis = jax.sharding.PartitionSpec("expert")

    def local(x, weights, chosen, w):
        out, dropped = experts.experts_exchanged(x, weights, chosen, w, E, parallel, "expert")
        return out, dropped[None]

    out, dropped = jax.jit(jax.shard_map(
        local, mesh=make_mesh((devices,), ("expert",)), in_specs=(axis,) * 4,
        out_specs=(axis, axis)))(x, weights, chosen, w)
    assert not np.asarray(dropped).any()
    w64 = {name: a.astype(np.float64) for name, a in w.items()}
    want = np.zeros(x.shape)
    for s, j in np.ndindex(chosen.shape):
        e, h = chosen[s, j], x[s].astype(np.float64)
        gate, up = h @ w64["we_gate"][e], h @ w64["we_up"][e]
        want[s] += weights[s, j] * ((gate / (1 + np.exp(-gate)) * up) @ w64["we_down"][e])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
