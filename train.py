"""Train a Llama or DeepSeek-V3 decoder with a per-tensor activation placement policy.

    python train.py EXPERIMENT [key=value ...]             run an experiment (see --list)
    python train.py EXPERIMENT --plan [key=value ...]      its full-scale memory plan
    python train.py EXPERIMENT --compile [key=value ...]   its full-scale step compiled for its
                                                           GPUs (device=...), without a GPU
    python train.py --list                                 the experiments, one line each

Resolve (config, scale, policy, data: any mistake is one line and exit status 2) -> build
(mesh, the step compiled ahead of time for the target: this machine's devices or compile-only
GPUs) -> sharded init -> loop -> report.
"""

import backend  # first: it settles the platform and GPU memory before JAX starts

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp

import configs
import distributed
import plan
import report
import training
from configs import ConfigError
from configs.gpus import GPUS
from data import DataError, token_source
from model import common
from model.checkpoint import CheckpointError
from model.hf import Checkpoint, open_checkpoint
from offload import memory, policies


@dataclasses.dataclass
class Setup:
    """Everything a run needs, resolved and checked before anything is compiled."""
    experiment: configs.Experiment
    scale: str
    scale_reason: str
    model: configs.ModelConfig
    run: configs.RunConfig
    tables: dict | None  # scan -> placement table; None when checkpointing is off
    data: object
    hf_params: Checkpoint | None  # init_from, not read yet: each process reads its share


def choose_scale(experiment: configs.Experiment, overrides: dict, requested: str,
                 devices: tuple):
    """(scale, why). Full scale needs exactly the accelerators of the (overridden) full mesh."""
    mesh = configs.apply_overrides(*experiment.at_scale("full"), overrides)[1].mesh
    if mesh.data < 1:
        raise ConfigError(f"mesh.data={mesh.data} must be at least 1")
    need = mesh.data * mesh.fsdp if mesh.fsdp > 0 else None  # fsdp=-1: any multiple of data
    have = f"{len(devices)} {devices[0].platform} device(s)"
    enough = devices[0].platform != "cpu" and (
        len(devices) == need if need else len(devices) % mesh.data == 0)
    if requested == "full" and not enough:
        raise ConfigError(f"{experiment.name} at full scale needs {need or 'a multiple of'} "
                          f"{mesh.data if need is None else ''} accelerators (mesh data="
                          f"{mesh.data} x fsdp={mesh.fsdp}); this machine has {have}")
    if requested == "proxy" or not enough:
        why = "asked for" if requested == "proxy" else f"full scale needs {need} accelerators"
        return "proxy", f"{why}; this machine has {have}"
    return "full", f"{have} cover the experiment's mesh"


def check(model, run: configs.RunConfig, n_devices: int) -> None:
    """Every impossible setting, as one ConfigError; NVFP4 widths only once the rest is sound
    (they are found by tracing the model)."""
    found = configs.problems(model, run, n_devices)
    if found := found or training.quantization_problems(model, run):
        raise ConfigError("; ".join(found))


def resolve(name: str, args: list[str], devices: tuple = (), full: bool = False) -> Setup:
    """The run's settings, checked: at the scale these `devices` can run, or at full scale
    for the experiment's own mesh (`full`: a plan or a compile without its GPUs)."""
    experiment = configs.get(name)
    overrides = configs.parse_overrides(args)
    requested = overrides.get("scale", experiment.run.scale)
    if requested not in configs.SCALES:
        raise ConfigError(f"scale={requested!r}: choose one of {', '.join(configs.SCALES)}")
    scale, why = (("full", "asked for its GPUs") if full
                  else choose_scale(experiment, overrides, requested, devices))
    model, run = configs.apply_overrides(*experiment.at_scale(scale), overrides)
    hf_params = None
    if run.init_from:
        if any(k.startswith("model.") for k in overrides):
            raise ConfigError("model.* overrides conflict with init_from (the checkpoint's "
                              "config.json defines the model)")
        model, hf_params = open_checkpoint(run.init_from)
        if type(model) is not type(experiment.model):
            raise ConfigError(f"init_from={run.init_from}: a {type(model).__name__} checkpoint, "
                              f"but {experiment.name} trains a {type(experiment.model).__name__}")
    if full and run.mesh.fsdp < 1:
        raise ConfigError("full scale without its GPUs needs the mesh spelled out: set mesh.fsdp")
    check(model, run, run.mesh.data * run.mesh.fsdp if full else len(devices))
    data = token_source(run.data.path, run.data.dtype, model.vocab, run.seed, run.seq)
    experiment = dataclasses.replace(experiment, model=model, run=run) if full else experiment
    return Setup(experiment, scale, why, model, run, placement_tables(model, run), data,
                 hf_params)


def placement_tables(model, run: configs.RunConfig) -> dict | None:
    """The run's placement table per layer scan; None when checkpointing is off."""
    if run.policy == policies.NO_CHECKPOINT:
        if run.placements:
            raise ConfigError("policy.<tag> overrides need a policy preset, not policy=none")
        return None
    try:
        return policies.placement_tables(run.policy, run.placements, training.scan_tags(model))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def init_state(setup: Setup, rules: common.AxisRules, optimizer):
    """Parameters and optimizer state, created sharded (FSDP) on the mesh."""
    shardings = jax.tree.map(lambda a: a.sharding,
                             training.abstract_state(setup.model, setup.run, rules, optimizer))
    specs = training.family(setup.model).param_specs(setup.model)
    dtype = jnp.dtype(setup.run.param_dtype)
    if setup.hf_params is None:
        params = common.init_params(specs, rules, jax.random.key(setup.run.seed), dtype)
    else:
        params = setup.hf_params.arrays(shardings["params"], dtype)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(params)
    return {"params": params, "opt_state": opt_state,
            "step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])}


def global_batch(setup: Setup, step: int, sharding, batch_size: int):
    tokens = setup.data.batch(step, batch_size, setup.run.seq)
    return jax.make_array_from_callback(tokens.shape, sharding, lambda index: tokens[index])


@dataclasses.dataclass
class Built:
    """A run's step compiled for its target, and what its report needs; no array exists yet."""
    target: backend.Target
    mesh: jax.sharding.Mesh
    rules: common.AxisRules
    optimizer: object
    compiled: jax.stages.Compiled
    compile_s: float
    full_plan: memory.MemoryPlan  # the full-scale static plan
    run_tags: list[memory.TagLine]  # this run's placement list, checked on its own program


def build(setup: Setup, target: backend.Target) -> Built:
    """The one path from settings to a compiled step: a run on this machine's devices and
    `--compile` on compile-only GPUs both come here. The full-scale plan is traced with kernels
    every backend has (it needs no device); on a GPU the run's placement list is checked on
    the compiled program's host buffers, elsewhere on the program exported for a GPU."""
    run = setup.run
    if run.attention == "cudnn" and target.platform != "gpu":
        raise ConfigError(f"attention=cudnn needs a GPU; this backend is {target.platform}")
    mesh_shape = run.mesh.shape(len(target.devices))
    mesh = common.make_mesh(mesh_shape, ("data", "fsdp"), devices=target.devices)
    rules = training.axis_rules(run, mesh)
    optimizer = training.make_optimizer(run.optimizer, run.steps)
    started = time.perf_counter()
    compiled = training.compile_step(setup.model, run, setup.tables, rules, optimizer, target)
    compile_s = time.perf_counter() - started
    hlo = compiled.as_text() if target.platform == "gpu" else None
    full = setup.experiment
    if (full.model, full.run, (full.run.mesh.data, full.run.mesh.fsdp)) == (
            setup.model, run, mesh_shape):  # this run is the full-scale one: plan it once
        full_plan = plan.full_scale(full, setup.tables, hlo)
        return Built(target, mesh, rules, optimizer, compiled, compile_s, full_plan,
                     full_plan.tags)
    full_plan = plan.full_scale(full, setup.tables)
    run_tags = plan.Program(setup.model, run, setup.tables, mesh_shape).tag_lines(hlo)
    return Built(target, mesh, rules, optimizer, compiled, compile_s, full_plan, run_tags)


def train(setup: Setup, target: backend.Target) -> dict | None:
    """Run the experiment; its summary, or None when the loss stopped being finite."""
    built = build(setup, target)
    run, n_devices = setup.run, len(target.devices)
    batch_size = run.batch(n_devices)
    batch_sharding = built.rules.sharding(("batch", None))
    state = init_state(setup, built.rules, built.optimizer)
    batch = global_batch(setup, 0, batch_sharding, batch_size)
    flops = training.family(setup.model).training_flops(setup.model, batch_size / n_devices,
                                                        run.seq)
    log = report.RunLog(setup, built, batch_size, flops)
    pending = None  # (step, metrics) dispatched, not yet read: read it after the next dispatch
    for i in range(1, run.steps + 1):
        log.maybe_start_profile(i)
        state, metrics = built.compiled(state, batch)
        if i < run.steps:
            batch = global_batch(setup, i, batch_sharding, batch_size)
        if pending and not log.step_done(*pending):
            return None
        pending = (i, metrics)
    return log.summary() if log.step_done(*pending) else None


def print_plan(name: str, args: list[str]) -> None:
    """The experiment's full-scale memory plan and placement list (overrides applied)."""
    setup = resolve(name, args, full=True)
    started = time.perf_counter()
    memory_plan = plan.full_scale(setup.experiment, setup.tables)
    print("\n".join(plan.plan_lines(name, setup.run, memory_plan)))
    print(f"(planned in {time.perf_counter() - started:.1f} s from abstract values: nothing "
          "allocated; offloads read from the step exported for a GPU)")


def print_compile(name: str, args: list[str]) -> None:
    """The experiment's full-scale step compiled for its GPUs (`device`) on compile-only
    devices, through `build` as a run on them would; XLA's memory beside the static plan."""
    setup = resolve(name, args, full=True)
    run = setup.run
    gpu = GPUS[run.device]
    target = backend.compile_only(gpu, run.mesh.data * run.mesh.fsdp)
    built = build(setup, target)
    print(f"compiled: {name} at full scale for {target.description}, topology "
          f"{gpu.topology(len(target.devices))}, mesh {dict(built.mesh.shape)}, "
          f"{report.model_line(setup.model)}; in {built.compile_s:.1f} s")
    print(f"xla flags: {report.flags_line(run, target)}; kernels: "
          f"{report.kernels_line(setup.model, run, built.mesh, target)}")
    print("\n".join(plan.plan_lines(name, run, built.full_plan)))
    print("\n".join(plan.compiled_lines(memory.CompiledMemory.of(built.compiled),
                                        built.full_plan, gpu)))


def compare(name: str, args: list[str], target: backend.Target) -> int:
    """Run each experiment of a comparison, then print one table of them."""
    rows = []
    for experiment in configs.COMPARISONS[name]:
        setup = resolve(experiment, args, target.devices)
        summary = train(setup, target)
        if summary is None:
            return 1
        rows.append((setup, summary))
    report.comparison(name, rows)
    return 0


def list_experiments() -> None:
    width = max(map(len, [*configs.EXPERIMENTS, *configs.COMPARISONS]))
    for name, experiment in configs.EXPERIMENTS.items():
        print(f"{name:<{width}}  {experiment.summary}")
    for name, members in configs.COMPARISONS.items():
        print(f"{name:<{width}}  runs {', '.join(members)}; one table")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    if argv[0] == "--list":
        list_experiments()
        return 0
    name, args = argv[0], [a for a in argv[1:] if a not in ("--plan", "--compile")]
    try:
        distributed.initialize()  # before the backend starts: multi-host runs join here
        target = backend.this_machine()  # starts JAX's backend (quietly; see backend.py)
        if "--plan" in argv:
            print_plan(name, args)
            return 0
        if "--compile" in argv:
            print_compile(name, args)
            return 0
        if name in configs.COMPARISONS:
            return compare(name, args, target)
        return 0 if train(resolve(name, args, target.devices), target) is not None else 1
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
