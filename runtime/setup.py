"""A run's settings, resolved and checked before anything is compiled (any mistake is one
line and exit status 2), then built: the mesh, the step compiled ahead of time for its target
(this machine's devices or compile-only GPUs), the full-scale plan, the state."""

import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp

import configs
from analysis import memory, plan
from analysis.memory import MemoryPlan, TagLine
from analysis.traced import TracedStep
from configs import ConfigError
from hf.load import Checkpoint, open_checkpoint
from model import common, families
from offload import policies
from runtime import checkpoints
from runtime.data import token_source
from trainer import build as step_build
from trainer.step import make_optimizer
from trainer.target import Target


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
    resume: checkpoints.Source | None = None  # the checkpoint this run continues from
    args: tuple[str, ...] = ()  # the command line's key=value overrides, as given


def choose_scale(experiment: configs.Experiment, overrides: dict, requested: str,
                 devices: tuple):
    """(scale, why). Full scale needs exactly the accelerators of the (overridden) full mesh."""
    model, run = configs.apply_overrides(*experiment.at_scale("full"), overrides)
    if bad := [line for line in configs.out_of_range(model, run) if line.startswith("mesh.")]:
        raise ConfigError("; ".join(bad))  # the count of devices below needs the mesh sound
    mesh = run.mesh
    need = mesh.devices if mesh.fsdp > 0 else None  # fsdp=-1: any multiple of data x expert
    have = f"{len(devices)} {devices[0].platform} device(s)"
    enough = devices[0].platform != "cpu" and (
        len(devices) == need if need else len(devices) % (mesh.data * mesh.expert) == 0)
    if requested == "full" and not enough:
        count = need or f"a multiple of {mesh.data * mesh.expert}"
        raise ConfigError(f"{experiment.name} at full scale needs {count} accelerators (mesh "
                          f"data={mesh.data} x fsdp={mesh.fsdp} x expert={mesh.expert}); this "
                          f"machine has {have}")
    if requested == "proxy" or not enough:
        why = "asked for" if requested == "proxy" else f"full scale needs {need} accelerators"
        return "proxy", f"{why}; this machine has {have}"
    return "full", f"{have} cover the experiment's mesh"


def check(model, run: configs.RunConfig, n_devices: int) -> None:
    """Every impossible setting, as one ConfigError; NVFP4 widths only once the rest is sound
    (they are found by tracing the model)."""
    found = configs.problems(model, run, n_devices)
    if found := found or step_build.quantization_problems(model, run):
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
    check(model, run, run.mesh.devices if full else len(devices))
    data = token_source(run.data.path, run.data.dtype, model.vocab, run.seed, run.seq)
    experiment = dataclasses.replace(experiment, model=model, run=run) if full else experiment
    setup = Setup(experiment, scale, why, model, run, placement_tables(model, run), data,
                  hf_params, args=tuple(args))
    if not full:
        setup.resume = checkpoints.check_outputs(setup, run.batch(len(devices)))
    return setup


def placement_tables(model, run: configs.RunConfig) -> dict | None:
    """The run's placement table per layer scan; None when checkpointing is off."""
    if run.policy == policies.NO_CHECKPOINT:
        if run.placements:
            raise ConfigError("policy.<tag> overrides need a policy preset, not policy=none")
        return None
    try:
        return policies.placement_tables(run.policy, run.placements, families.scan_tags(model))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def init_state(setup: Setup, rules: common.AxisRules, optimizer):
    """Parameters and optimizer state, created sharded (FSDP) on the mesh."""
    shardings = jax.tree.map(lambda a: a.sharding,
                             step_build.abstract_state(setup.model, setup.run, rules, optimizer))
    specs = families.of(setup.model).param_specs(setup.model)
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
    target: Target
    mesh: jax.sharding.Mesh
    rules: common.AxisRules
    optimizer: object
    compiled: jax.stages.Compiled
    compile_s: float
    full_plan: MemoryPlan  # the full-scale static plan
    run_tags: list[TagLine]  # this run's placement list, checked on its own program
    arrived: int = 0  # host optimizer state compiled as device arguments (memory.CompiledMemory)

    def compiled_memory(self) -> memory.CompiledMemory:
        return memory.CompiledMemory.of(self.compiled, self.arrived)


def layout(setup: Setup, target: Target) -> tuple[common.AxisRules, object]:
    """The run's mesh (in its axis rules) and optimizer: what its state is made for and its
    step compiled for; first, whether the target can run it at all."""
    run = setup.run
    if run.attention == "cudnn" and target.platform != "gpu":
        raise ConfigError(f"attention=cudnn needs a GPU; this backend is {target.platform}")
    mesh = step_build.make_mesh(run, target.devices)
    rules, optimizer = common.AxisRules(mesh=mesh), make_optimizer(run.optimizer, run.steps)
    if run.optimizer_state == "host" and target.gpu is None:
        check_host_state(setup, target, rules, optimizer)
    return rules, optimizer


def check_host_state(setup: Setup, target: Target, rules, optimizer) -> None:
    """optimizer_state=host on this machine: its devices must have pinned host memory, and
    the host room for the state twice over (it and its new copy, during the update)."""
    kinds = {m.kind for m in target.devices[0].addressable_memories()}
    if "pinned_host" not in kinds:
        raise ConfigError(f"optimizer_state=host: the {target.platform} backend has no "
                          f"pinned_host memory (it has {', '.join(sorted(kinds)) or 'none'})")
    abstract = step_build.abstract_state(setup.model, setup.run, rules, optimizer)
    moments = memory.moment_bytes(abstract["opt_state"])
    need = 2 * moments * len(jax.local_devices())
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have:
        raise ConfigError(f"optimizer_state=host: the state and its new copy need "
                          f"{need / 2**30:.1f} GiB of host memory here, the host has "
                          f"{have / 2**30:.1f} GiB; keep it on the device or use more hosts")


def build(setup: Setup, target: Target) -> Built:
    """The one path from settings to a compiled step: a run on this machine's devices and
    `--compile` on compile-only GPUs both come here. The full-scale plan is traced with kernels
    every backend has (it needs no device); on a GPU the run's placement list is checked on
    the compiled program's host buffers, elsewhere on the program exported for a GPU."""
    run = setup.run
    rules, optimizer = layout(setup, target)
    mesh, mesh_shape = rules.mesh, run.mesh.shape(len(target.devices))
    started = time.perf_counter()
    compiled = step_build.compile_step(setup.model, run, setup.tables, rules, optimizer, target)
    compile_s = time.perf_counter() - started
    hlo = compiled.as_text() if target.platform == "gpu" else None
    arrived = 0
    if run.optimizer_state == "host" and target.gpu is not None:
        abstract = step_build.abstract_state(setup.model, run, rules, optimizer)
        arrived = memory.moment_bytes(abstract["opt_state"])
    full = setup.experiment
    if (full.model, full.run, full.run.mesh.shape(full.run.mesh.devices)) == (
            setup.model, run, mesh_shape):  # this run is the full-scale one: plan it once
        full_plan = plan.full_scale(full, setup.tables, hlo)
        return Built(target, mesh, rules, optimizer, compiled, compile_s, full_plan,
                     full_plan.tags, arrived)
    full_plan = plan.full_scale(full, setup.tables)
    run_tags = memory.tag_lines(TracedStep(setup.model, run, mesh_shape), setup.tables, hlo)
    return Built(target, mesh, rules, optimizer, compiled, compile_s, full_plan, run_tags,
                 arrived)


def check_addressing(built: Built) -> None:
    """Before step 1 on GPUs: a step that reads offloaded activations back from the wrong
    bytes stops the run; one whose addressing cannot be verified runs, with a warning."""
    if refusal := plan.addressing_refusal(built.run_tags):
        raise ConfigError(refusal)
    if problems := plan.addressing_problems(built.run_tags):
        if jax.process_index() == 0:
            print(f"warning: {problems[0]}: the gradients of this run are unproven; "
                  "benchmarks/gpu_check.py checks them on a GPU", file=sys.stderr)


def start_state(setup: Setup, target: Target) -> tuple[dict, int]:
    """(state, steps already done): restored from the resume checkpoint, resharded onto this
    run's mesh, or freshly initialized. Before the step is compiled: a checkpoint that does
    not read back costs no compile."""
    rules, optimizer = layout(setup, target)
    if setup.resume is None:
        return init_state(setup, rules, optimizer), 0
    abstract = step_build.abstract_state(setup.model, setup.run, rules, optimizer)
    state, meta = checkpoints.restore(setup.resume, abstract)
    return state, meta["step"]


