"""The train step as a program (`Program`), traced and compiled ahead of time for a target when
first asked for: a run's for this machine's devices, the study tools' for GPUs they lack."""

import functools
import time
from functools import partial

import jax
import jax.numpy as jnp
import optax

from configs import MESH_AXES, ConfigError, RunConfig
from model import families, quant
from model.options import ForwardOptions
from model.experts import ExpertParallel
from model.params import abstract_params, indivisible, init_params, param_shardings
from model.sharding import AxisRules, make_mesh
from offload import activations
from runtime.backend import explained_compile
from trainer.step import loss_fn, make_optimizer, train_step
from trainer.target import ANY, Target, compiler_options, quantization


def mesh_of(run: RunConfig, devices) -> jax.sharding.Mesh:
    """The run's data x fsdp x expert mesh over `devices` in their order, the expert axis
    innermost: each expert group is mesh.expert consecutive devices (one NVLink domain when
    processes take consecutive ranks by host), so its exchanges stay among them (docs/model.md)."""
    return make_mesh(run.mesh.shape(len(devices)), MESH_AXES, devices)


UNROLLED_LAYERS = 8  # the longest layer scan a CPU program unrolls


def forward_options(model, run: RunConfig, placement: dict | None, rules: AxisRules | None,
                    target: Target) -> ForwardOptions:
    """What the forward depends on for this run and target (model/options.py): by default
    cuDNN's attention on a GPU in bf16 or f16, and tiled experts on CPUs (ragged_dot is slow)."""
    attention = "xla" if target.platform == "any" else run.attention
    if attention == "auto":
        fused = target.platform == "gpu" and run.compute_dtype in ("bfloat16", "float16")
        attention = "cudnn" if fused else "xla"
    experts = run.expert_path
    if experts == "auto":
        experts = "tiled" if target.platform == "cpu" else "sorted"
    # A capacity asks for the experts in blocks, one device's too (a fit of an expert row on
    # fewer GPUs than its expert degree): XLA expands a ragged_dot per expert (docs/model.md).
    parallel = None
    if hasattr(model, "n_experts") and (run.mesh.expert > 1 or run.expert_capacity):
        parallel = ExpertParallel(run.mesh.expert, run.expert_capacity)
    policies = tuple((s, activations.checkpoint_policy(t)) for s, t in (placement or {}).items())
    # XLA's CPU backend zero-fills and copies a layer loop's stacked residuals each step
    # (docs/runs.md: what a CPU step costs); unrolled, they stay where each layer wrote them.
    # Not long scans, nor NVFP4's emulated weights (the compile grows with every layer, each
    # layer's quantization compiled again: by more than the steps save), nor a fit (its search
    # compares programs on both sides of the bound: one form for every layer count).
    unrolled = (target.platform == "cpu" and run.scale != "fit" and run.quant == "none"
                and model.n_layers <= UNROLLED_LAYERS)
    return ForwardOptions(run.compute_dtype, policies, rules, attention,
                          quantization(run, target), experts, parallel, unrolled,
                          flat_products=target.platform == "cpu",
                          weights_on_host=run.parameters == "host")


def abstract_state(model, run: RunConfig, rules: AxisRules, optimizer):
    """The train state as sharded ShapeDtypeStructs: what `init_state` makes, without making it."""
    specs = families.of(model).param_specs(model)
    params = abstract_params(specs, jnp.dtype(run.param_dtype))
    shardings = param_shardings(specs, rules)
    replicated = rules.sharding(())
    opt_state = jax.eval_shape(optimizer.init, params)
    if run.parameters == "host":  # the layer scans' weights and, below, their moments
        shardings = {k: _on_host(s) if k in families.of(model).SCANS else s
                     for k, s in shardings.items()}
    opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, opt_state, shardings,
                                          transform_non_params=lambda _: replicated)
    if run.optimizer_state == "host":  # the moments; the step counts (0-d) stay on device
        opt_shardings = jax.tree.map(lambda a, s: s.with_memory_kind("pinned_host") if a.ndim
                                     else s, opt_state, opt_shardings)
    elif run.parameters == "host":  # the moments on the device, wherever the weights are
        opt_shardings = jax.tree.map(lambda a, s: s.with_memory_kind("device") if a.ndim
                                     else s, opt_state, opt_shardings)
    shapes = {"params": params, "opt_state": opt_state, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    shardings = {"params": shardings, "opt_state": opt_shardings, "step": replicated}
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, shardings)


def _on_host(shardings):
    return jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), shardings)


def abstract_batch(run: RunConfig, rules: AxisRules, n_devices: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((run.batch(n_devices), run.seq + 1), jnp.int32,
                                sharding=rules.sharding(("batch", None)))


def global_batch(tokens, sharding) -> jax.Array:
    """The global batch [B, T+1] every process built alike, each holding its devices' rows."""
    return jax.make_array_from_callback(tokens.shape, sharding, lambda index: tokens[index])


def make_loss(model, run: RunConfig, options: ForwardOptions):
    """(params, batch, key) -> (loss, aux): of a sharded batch on `options.rules`' mesh or,
    with rules None, of one device's share traced alone (under expert parallelism its
    parameters then hold only that device's routed experts, as the study tools trace it)."""
    return partial(loss_fn, model=model, options=options,
                   balance_weight=run.balance_loss_weight, loss_chunks=run.loss_chunks)


def sharding_problems(model, run: RunConfig, n_devices: int) -> list[str]:
    """Whether the run's mesh divides every sharded axis of the model's weights."""
    shape = run.mesh.shape(n_devices)
    rules = AxisRules(mesh=jax.sharding.AbstractMesh(shape, MESH_AXES))
    if problem := indivisible(families.of(model).param_specs(model), rules):
        mesh = " x ".join(f"{a}={n}" for a, n in zip(MESH_AXES, shape))
        return [f"the mesh ({mesh}) does not fit the model: {problem}"]
    return []


def quantization_problems(model, run: RunConfig) -> list[str]:
    """Whether NVFP4 can encode every quantized matrix of `model`: its forward traced abstractly."""
    if run.quant == "none":
        return []
    family = families.of(model)
    options = ForwardOptions(quantization=quantization(run, ANY), experts="sorted")
    try:
        jax.eval_shape(partial(family.forward, cfg=model, options=options),
                       abstract_params(family.param_specs(model)),
                       jax.ShapeDtypeStruct((1, 16), jnp.int32))
    except quant.QuantError as e:
        return [f"quant={run.quant}: {e}"]
    return []


class Program:
    """One run's train step for one target. Nothing is allocated or compiled until asked:
    `traced` on first use, `step` and `evaluate` in `compile_run` (their seconds add up in
    `compile_s`); `state_shapes` describe the state without making it."""

    def __init__(self, model, run: RunConfig, placement: dict | None, target: Target):
        self.model, self.run, self.target = model, run, target
        self.device_mesh = mesh_of(run, target.devices)
        self.rules = AxisRules(mesh=target.mesh(self.device_mesh))
        self.optimizer = make_optimizer(run.optimizer, run.steps)
        self.options = forward_options(model, run, placement, self.rules, target)
        self.state_shapes = abstract_state(model, run, self.rules, self.optimizer)
        self.batch_shape = abstract_batch(run, self.rules, len(target.devices))
        self.batch_size = self.batch_shape.shape[0]
        self.compile_s = 0.0
        self.step = self.evaluate = None  # compiled: compile_run

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.rules.mesh

    @functools.cached_property
    def traced(self) -> jax.stages.Traced:
        """The step traced on the abstract state and batch (its jaxpr: what it offloads)."""
        step = partial(train_step, model=self.model, run=self.run, options=self.options)
        with self.target.tracing(self.device_mesh):
            return jax.jit(step, donate_argnums=0).trace(self.state_shapes, self.batch_shape)

    def compile(self, traced: jax.stages.Traced, options: dict | None = None):
        """`traced` compiled with the run's XLA flags (a GPU target's) and `options`, timed."""
        started = time.perf_counter()
        try:
            with explained_compile():
                compiled = traced.lower().compile({**compiler_options(self.run, self.target),
                                                   **(options or {})})
        except jax.errors.JaxRuntimeError as e:
            # An XLA flag this jaxlib does not know, or a value its type refuses (docs/runs.md).
            if "compile option" in str(e) or "While setting option" in str(e):
                raise ConfigError(f"xla_flags: {str(e).splitlines()[0]}") from None
            raise
        self.compile_s += time.perf_counter() - started
        return compiled

    def compile_run(self, evaluation: bool = False) -> jax.stages.Compiled:
        """`step`, the traced step compiled for the target, and with `evaluation`, `evaluate`:
        each compiled once, here (a run's compile stage; a fit's search compiles its steps)."""
        if self.step is None:
            self.step = self.compile(self.traced)
        if evaluation and self.evaluate is None:
            loss = make_loss(self.model, self.run, self.options)
            evaluate = jax.jit(lambda params, batch: loss(params, batch)[1]["cross_entropy"])
            with self.target.tracing(self.device_mesh):
                traced = evaluate.trace(self.state_shapes["params"], self.batch_shape)
            self.evaluate = self.compile(traced)
        return self.step

    def init_state(self, checkpoint=None) -> dict:
        """Parameters (random, or a Hugging Face `checkpoint`'s) and optimizer state, sharded."""
        shardings = jax.tree.map(lambda a: a.sharding, self.state_shapes)
        specs = families.of(self.model).param_specs(self.model)
        dtype = jnp.dtype(self.run.param_dtype)
        params = (init_params(specs, self.rules, jax.random.key(self.run.seed), dtype)
                  if checkpoint is None else checkpoint.arrays(shardings["params"], dtype))
        # Made on the device, then moved where the state keeps them (parameters=host: the
        # layer scans' weights to host memory; elsewhere nothing moves).
        params = jax.device_put(params, shardings["params"])
        opt_state = jax.jit(self.optimizer.init, out_shardings=shardings["opt_state"])(params)
        return {"params": params, "opt_state": opt_state,
                "step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])}

    def batch(self, tokens) -> jax.Array:
        return global_batch(tokens, self.batch_shape.sharding)

    def eval_loss(self, params, batches) -> float:
        """The mean cross-entropy over `batches` (numpy [B, T+1] each)."""
        losses = [self.evaluate(params, self.batch(tokens)) for tokens in batches]
        return float(sum(map(float, losses)) / len(losses))
