"""Train a Llama decoder with a per-tensor activation placement policy.

    python train.py EXPERIMENT [key=value ...]     run an experiment (see --list)
    python train.py --list                         the experiments, one line each

Resolve (config, scale, policy, data: any mistake is one line and exit status 2) -> mesh ->
sharded init -> jit(train_step, donated state) compiled ahead of time -> loop -> report.
"""

import dataclasses
import os
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import configs
import report
from configs import ConfigError
from data import DataError, token_source
from model import common, llama
from model.hf import CheckpointError, load_llama
from offload import policies


@dataclasses.dataclass
class Setup:
    """Everything a run needs, resolved and checked before anything is compiled."""
    experiment: configs.Experiment
    scale: str
    scale_reason: str
    model: llama.LlamaConfig
    run: configs.RunConfig
    table: dict | None  # placement table; None when checkpointing is off
    data: object
    hf_params: dict | None


def cross_entropy(logits, targets):
    """Mean next-token cross-entropy in fp32; logits [B, T, V], targets [B, T]."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logprobs, targets[..., None], axis=-1))


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


def make_optimizer(cfg: configs.OptimizerConfig, steps: int):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, max(steps, cfg.warmup_steps + 1), cfg.lr * cfg.min_lr_ratio)
    # No weight decay on norm weights, the usual choice for RMSNorm gains.
    decay = partial(jax.tree_util.tree_map_with_path,
                    lambda path, _: not str(path[-1].key).endswith("norm"))
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, cfg.b1, cfg.b2, weight_decay=cfg.weight_decay,
                                   mask=decay))


def maybe_initialize_distributed() -> None:
    """Multi-host runs (SLURM, Open MPI, or an explicit coordinator) join one JAX cluster."""
    env = os.environ
    if (env.get("JAX_COORDINATOR_ADDRESS") or int(env.get("SLURM_NTASKS", "1")) > 1
            or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1):
        jax.distributed.initialize()


def choose_scale(experiment: configs.Experiment, requested: str) -> tuple[str, str]:
    """(scale, why). Full scale needs as many accelerators as the experiment's mesh has."""
    need = experiment.run.mesh.data * experiment.run.mesh.fsdp
    devices = jax.devices()
    have = f"{len(devices)} {devices[0].platform} device(s)"
    enough = devices[0].platform != "cpu" and len(devices) >= need
    if requested == "full" and not enough:
        raise ConfigError(f"{experiment.name} at full scale needs {need} accelerators (mesh "
                          f"data={experiment.run.mesh.data} x fsdp={experiment.run.mesh.fsdp}); "
                          f"this machine has {have}")
    if requested == "proxy" or not enough:
        why = "asked for" if requested == "proxy" else f"full scale needs {need} accelerators"
        return "proxy", f"{why}; this machine has {have}"
    return "full", f"{have} cover the experiment's mesh"


def resolve(name: str, args: list[str]) -> Setup:
    experiment = configs.get(name)
    overrides = configs.parse_overrides(args)
    requested = overrides.get("scale", experiment.run.scale)
    if requested not in configs.SCALES:
        raise ConfigError(f"scale={requested!r}: choose one of {', '.join(configs.SCALES)}")
    scale, why = choose_scale(experiment, requested)
    model, run = configs.apply_overrides(*experiment.at_scale(scale), overrides)
    hf_params = None
    if run.init_from:
        if any(k.startswith("model.") for k in overrides):
            raise ConfigError("model.* overrides conflict with init_from (the checkpoint's "
                              "config.json defines the model)")
        model, hf_params = load_llama(run.init_from)
    if found := configs.problems(model, run, jax.device_count()):
        raise ConfigError("; ".join(found))
    table = None
    if run.policy != policies.NO_CHECKPOINT:
        try:
            table = policies.placement_table(run.policy, run.placements)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif run.placements:
        raise ConfigError("policy.<tag> overrides need a policy preset, not policy=none")
    data = token_source(run.data.path, run.data.dtype, model.vocab, run.seed)
    return Setup(experiment, scale, why, model, run, table, data, hf_params)


def init_state(setup: Setup, mesh, rules, optimizer):
    """Parameters and optimizer state, created sharded (FSDP) on the mesh."""
    specs = llama.param_specs(setup.model)
    dtype = jnp.dtype(setup.run.param_dtype)
    shardings = common.param_shardings(specs, rules, mesh)
    if setup.hf_params is None:
        params = common.init_params(specs, rules, mesh, jax.random.key(setup.run.seed), dtype)
    else:
        params = jax.device_put(jax.tree.map(lambda a: a.astype(dtype), setup.hf_params),
                                shardings)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shardings = optax.tree_map_params(
        optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, params), shardings,
        transform_non_params=lambda _: replicated)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    return {"params": params, "opt_state": opt_state, "step": jnp.zeros((), jnp.int32)}


def gpu_compiler_options(flags: dict[str, str]) -> dict:
    """XLA flags as per-compile options, typed; applied only on a GPU backend."""
    def typed(v: str):
        return {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
    return {k: typed(v) for k, v in flags.items()}


def compile_step(setup: Setup, mesh, rules, optimizer, state, batch):
    policy = None if setup.table is None else policies.checkpoint_policy(setup.table)
    loss = partial(loss_fn, model=setup.model, policy=policy, rules=rules,
                   dtype=jnp.dtype(setup.run.compute_dtype))
    on_gpu = jax.default_backend() == "gpu"
    options = gpu_compiler_options(setup.run.xla_flags) if on_gpu else None
    step = jax.jit(partial(train_step, loss=loss, optimizer=optimizer), donate_argnums=0,
                   compiler_options=options)
    try:
        return step.lower(state, batch).compile()
    except jax.errors.JaxRuntimeError as e:
        if "compile option" in str(e):  # an XLA flag this jaxlib does not know
            raise ConfigError(f"xla_flags: {str(e).splitlines()[0]}") from None
        raise


def global_batch(setup: Setup, step: int, sharding, batch_size: int):
    tokens = setup.data.batch(step, batch_size, setup.run.seq)
    return jax.make_array_from_callback(tokens.shape, sharding, lambda index: tokens[index])


def train(setup: Setup) -> int:
    run, n_devices = setup.run, jax.device_count()
    data_axis, fsdp_axis = run.mesh.shape(n_devices)
    mesh = common.make_mesh((data_axis, fsdp_axis), ("data", "fsdp"))
    rules = common.AxisRules()
    batch_size = run.batch(n_devices)
    batch_sharding = NamedSharding(mesh, rules.spec(("batch", None)))
    optimizer = make_optimizer(run.optimizer, run.steps)
    with jax.set_mesh(mesh):
        state = init_state(setup, mesh, rules, optimizer)
        batch = global_batch(setup, 0, batch_sharding, batch_size)
        started = time.perf_counter()
        step = compile_step(setup, mesh, rules, optimizer, state, batch)
        compile_s = time.perf_counter() - started
    flops = llama.training_flops(setup.model, batch_size / n_devices, run.seq)
    log = report.RunLog(setup, mesh, batch_size, flops, compile_s, step)
    pending = None  # (step, metrics) dispatched, not yet read: read it after the next dispatch
    for i in range(1, run.steps + 1):
        log.maybe_start_profile(i)
        state, metrics = step(state, batch)
        if i < run.steps:
            batch = global_batch(setup, i, batch_sharding, batch_size)
        if pending and not log.step_done(*pending):
            return 1
        pending = (i, metrics)
    if not log.step_done(*pending):
        return 1
    log.summary()
    return 0


def list_experiments() -> None:
    width = max(map(len, configs.EXPERIMENTS))
    for name, experiment in configs.EXPERIMENTS.items():
        print(f"{name:<{width}}  {experiment.summary}")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    if argv[0] == "--list":
        list_experiments()
        return 0
    try:
        maybe_initialize_distributed()
        setup = resolve(argv[0], argv[1:])
        return train(setup)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
