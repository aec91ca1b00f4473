"""The train step as a program: its mesh, sharded abstract state and batch, its loss with
the run's placement and kernels, jitted, and compiled ahead of time for a target. The study
tools (study/) build on these functions; nothing here knows of them."""

from functools import partial

import jax
import jax.numpy as jnp
import optax

from configs import MESH_AXES, ConfigError, RunConfig
from model import common, families, quant
from offload import activations
from offload.optimizer_state import host_update
from runtime.backend import explained_compile
from trainer.step import device_update, loss_fn, optimizer_parts, train_step
from trainer.target import ANY, Target, compiler_options, forward_options, quantization


def make_mesh(run: RunConfig, devices) -> jax.sharding.Mesh:
    """The run's data x fsdp x expert mesh over `devices` in their order, the expert axis
    innermost: each expert group is mesh.expert consecutive devices (one NVLink domain when
    processes take consecutive ranks by host), so its exchanges stay among them (docs/model.md)."""
    return common.make_mesh(run.mesh.shape(len(devices)), MESH_AXES, devices)


def abstract_state(model, run: RunConfig, rules: common.AxisRules, optimizer):
    """The train state as sharded ShapeDtypeStructs: what init_state makes, without making it."""
    specs = families.of(model).param_specs(model)
    params = common.abstract_params(specs, jnp.dtype(run.param_dtype))
    param_shardings = common.param_shardings(specs, rules)
    replicated = rules.sharding(())
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, opt_state, param_shardings,
                                          transform_non_params=lambda _: replicated)
    if run.optimizer_state == "host":  # the moments; the step counts (0-d) stay on device
        opt_shardings = jax.tree.map(lambda a, s: s.with_memory_kind("pinned_host") if a.ndim
                                     else s, opt_state, opt_shardings)
    shapes = {"params": params, "opt_state": opt_state, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated}
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, shardings)


def abstract_batch(run: RunConfig, rules: common.AxisRules, n_devices: int):
    return jax.ShapeDtypeStruct((run.batch(n_devices), run.seq + 1), jnp.int32,
                                sharding=rules.sharding(("batch", None)))


def quantization_problems(model, run: RunConfig) -> list[str]:
    """Whether NVFP4 can encode every quantized matrix of `model` (dims multiples of 16),
    found by tracing its forward on abstract values."""
    if run.quant == "none":
        return []
    family = families.of(model)
    forward = partial(family.forward, cfg=model, quantization=quantization(run, ANY))
    try:
        jax.eval_shape(forward, common.abstract_params(family.param_specs(model)),
                       jax.ShapeDtypeStruct((1, 16), jnp.int32))
    except quant.QuantError as e:
        return [f"quant={run.quant}: {e}"]
    return []


def make_loss(model, run: RunConfig, placement: dict | None, rules, target: Target):
    """The loss of a sharded step (`rules`), or, with rules=None, of one device's share traced
    alone: under expert parallelism (run.mesh.expert > 1) its parameters then hold only that
    device's E/mesh.expert routed experts (as study/traced_step.py makes them)."""
    return partial(loss_fn, model=model, policies=activations.checkpoint_policies(placement),
                   rules=rules, dtype=jnp.dtype(run.compute_dtype),
                   balance_weight=run.balance_loss_weight, loss_chunks=run.loss_chunks,
                   **forward_options(model, run, target))


def make_step(model, run: RunConfig, placement: dict | None, rules, optimizer, target: Target):
    if run.optimizer_state == "host":
        clip, adamw = optimizer_parts(run.optimizer, run.steps)
        update = host_update(clip, adamw, families.of(model).SCANS)
    else:
        update = device_update(optimizer)
    step = partial(train_step, loss=make_loss(model, run, placement, rules, target),
                   update=update, router_bias_rate=run.router_bias_rate,
                   expert_devices=run.mesh.expert, seed=run.seed)
    return jax.jit(step, donate_argnums=0)


def compile_eval(model, run: RunConfig, placement: dict | None, rules, optimizer,
                 target: Target) -> jax.stages.Compiled:
    """The forward-only loss of one batch (its cross-entropy), compiled ahead of time on the
    step's mesh and for the parameters as its state holds them."""
    loss = make_loss(model, run, placement, rules, target)
    evaluate = jax.jit(lambda params, batch: loss(params, batch)[1]["cross_entropy"])
    params = abstract_state(model, run, rules, optimizer)["params"]
    traced = evaluate.trace(params, abstract_batch(run, rules, rules.mesh.devices.size))
    return traced.lower().compile()


def compile_step(model, run: RunConfig, placement: dict | None, rules, optimizer,
                 target: Target, extra_options: dict | None = None):
    """(the traced step's jaxpr, the step compiled ahead of time) as `target` runs it, from the
    abstract state and batch on `rules.mesh` (nothing allocated): a run compiles for its own
    devices, the study tools for compile-only GPUs (with `extra_options`), the same program."""
    step = make_step(model, run, placement, rules, optimizer, target)
    traced = step.trace(abstract_state(model, run, rules, optimizer),
                        abstract_batch(run, rules, rules.mesh.devices.size))
    try:
        with explained_compile():
            compiled = traced.lower().compile({**compiler_options(run, target),
                                               **(extra_options or {})})
    except jax.errors.JaxRuntimeError as e:
        # An XLA flag this jaxlib does not know, or a value its type refuses (configs checks
        # the types of the study's flags before tracing; XLA those of any other flag, here).
        if "compile option" in str(e) or "While setting option" in str(e):
            raise ConfigError(f"xla_flags: {str(e).splitlines()[0]}") from None
        raise
    return traced.jaxpr, compiled
