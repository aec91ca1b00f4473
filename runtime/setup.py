"""A run's settings, resolved and checked before anything is compiled (any mistake is one
line and exit status 2), then built: the mesh, the step compiled ahead of time for its target
(this machine's devices, or the study tools' compile-only GPUs), the state."""

import dataclasses
import importlib.util
import os
import time

import jax
import jax.numpy as jnp

import configs
from configs import ConfigError
from hf.load import Checkpoint, open_checkpoint
from model import common, families
from offload import activations, optimizer_state
from runtime import checkpoints, placement
from data.tokens import token_source
from trainer import program
from trainer.step import make_optimizer
from trainer.target import Target


@dataclasses.dataclass
class Setup:
    experiment: configs.Experiment
    scale: str
    scale_reason: str
    model: configs.ModelConfig
    run: configs.RunConfig
    placement: dict | None  # scan -> {tag: device|offload|remat}; None: checkpointing off
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
    count = need or f"a multiple of {mesh.data * mesh.expert}"
    if requested == "full" and not enough:
        raise ConfigError(f"{experiment.name} at full scale needs {count} accelerators (mesh "
                          f"data={mesh.data} x fsdp={mesh.fsdp} x expert={mesh.expert}); this "
                          f"machine has {have}")
    if requested == "proxy" or not enough:
        why = "asked for" if requested == "proxy" else f"full scale needs {count} accelerators"
        return "proxy", f"{why}; this machine has {have}"
    return "full", f"{have} cover the experiment's mesh"


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
    # Every impossible setting at once; NVFP4 widths only once the rest is sound (they are
    # found by tracing the model).
    found = configs.problems(model, run, run.mesh.devices if full else len(devices))
    if found := found or program.quantization_problems(model, run):
        raise ConfigError("; ".join(found))
    data = token_source(run.data.path, run.data.dtype, model.vocab, run.seed, run.seq)
    if run.eval_every and data.val is None:
        raise ConfigError(f"eval_every={run.eval_every} needs a val split: data.path= a folder "
                          "that python train.py prepare wrote")
    if run.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError("tensorboard=true writes through tensorboardX, which is not "
                          "installed: pip install -e '.[tensorboard]'")
    experiment = dataclasses.replace(experiment, model=model, run=run) if full else experiment
    setup = Setup(experiment, scale, why, model, run, resolve_placement(model, run), data,
                  hf_params, args=tuple(args))
    if not full:
        setup.resume = checkpoints.check_outputs(setup, run.batch(len(devices)))
    return setup


def resolve_placement(model, run: configs.RunConfig) -> dict | None:
    if run.preset == activations.NO_CHECKPOINT:
        if run.placement:
            raise ConfigError("placement.<tag> overrides need a preset, not preset=none")
        return None
    try:
        return activations.placement(run.preset, run.placement, families.scan_tags(model))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def init_state(setup: Setup, rules: common.AxisRules, optimizer):
    """Parameters and optimizer state, created sharded (FSDP) on the mesh."""
    shardings = jax.tree.map(lambda a: a.sharding,
                             program.abstract_state(setup.model, setup.run, rules, optimizer))
    specs = families.of(setup.model).param_specs(setup.model)
    dtype = jnp.dtype(setup.run.param_dtype)
    if setup.hf_params is None:
        params = common.init_params(specs, rules, jax.random.key(setup.run.seed), dtype)
    else:
        params = setup.hf_params.arrays(shardings["params"], dtype)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(params)
    return {"params": params, "opt_state": opt_state,
            "step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])}


def global_batch(tokens, sharding) -> jax.Array:
    """The global batch [B, T+1] every process built alike, each holding its devices' rows."""
    return jax.make_array_from_callback(tokens.shape, sharding, lambda index: tokens[index])


def evaluate(setup: Setup, built: "Built", params, batch_size: int) -> float:
    """The mean cross-entropy over the run's eval_batches fixed batches of val windows."""
    run, sharding = setup.run, built.rules.sharding(("batch", None))
    losses = [built.evaluate(params, global_batch(setup.data.val.eval_batch(
        index, batch_size, run.seq, run.eval_batches), sharding))
        for index in range(run.eval_batches)]
    return float(sum(map(float, losses)) / run.eval_batches)


@dataclasses.dataclass
class Built:
    """A run's step compiled for its target, and what its report needs; no array exists yet."""
    target: Target
    rules: common.AxisRules  # its mesh, rules.mesh
    optimizer: object
    compiled: jax.stages.Compiled
    compile_s: float
    offloaded: dict  # tag -> the values the traced step moves to host (runtime/placement.py)
    arrived: int = 0  # host optimizer state compiled as device arguments (compile-only GPUs)
    evaluate: jax.stages.Compiled | None = None  # the forward-only loss, with eval_every

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.rules.mesh

    def compiled_memory(self) -> placement.CompiledMemory:
        return placement.CompiledMemory.of(self.compiled, self.arrived)


def layout(setup: Setup, target: Target) -> tuple[common.AxisRules, object]:
    """The run's mesh (in its axis rules) and optimizer, once the target can run it at all."""
    run = setup.run
    if run.attention == "cudnn" and target.platform != "gpu":
        raise ConfigError(f"attention=cudnn needs a GPU; this backend is {target.platform}")
    mesh = program.make_mesh(run, target.devices)
    rules, optimizer = common.AxisRules(mesh=mesh), make_optimizer(run.optimizer, run.steps)
    if run.optimizer_state == "host" and not target.compile_only:
        check_host_state(setup, target, rules, optimizer)
    return rules, optimizer


def check_host_state(setup: Setup, target: Target, rules, optimizer) -> None:
    """optimizer_state=host on this machine: its devices must have pinned host memory, and
    the host room for the state twice over (it and its new copy, during the update)."""
    kinds = {m.kind for m in target.devices[0].addressable_memories()}
    if "pinned_host" not in kinds:
        raise ConfigError(f"optimizer_state=host: the {target.platform} backend has no "
                          f"pinned_host memory (it has {', '.join(sorted(kinds)) or 'none'})")
    abstract = program.abstract_state(setup.model, setup.run, rules, optimizer)
    need = 2 * optimizer_state.moment_bytes(abstract["opt_state"]) * len(jax.local_devices())
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have:
        raise ConfigError(f"optimizer_state=host: the state and its new copy need "
                          f"{need / 2**30:.1f} GiB of host memory here, the host has "
                          f"{have / 2**30:.1f} GiB; keep it on the device or use more hosts")


def build(setup: Setup, target: Target, laid_out=None, extra_options=None) -> Built:
    """The one path from settings to a compiled step, for a run here and for the study tools on
    compile-only GPUs (`extra_options`); `laid_out`: `layout`'s, when the caller has it."""
    run = setup.run
    rules, optimizer = laid_out or layout(setup, target)
    started = time.perf_counter()
    jaxpr, compiled = program.compile_step(setup.model, run, setup.placement, rules, optimizer,
                                           target, extra_options)
    arrived = 0
    if run.optimizer_state == "host" and target.compile_only:
        abstract = program.abstract_state(setup.model, run, rules, optimizer)
        arrived = optimizer_state.moment_bytes(abstract["opt_state"])
    evaluate = (program.compile_eval(setup.model, run, setup.placement, rules, optimizer, target)
                if run.eval_every and not target.compile_only else None)
    return Built(target, rules, optimizer, compiled, time.perf_counter() - started,
                 placement.tagged_in(jaxpr.jaxpr, offloaded=True), arrived, evaluate)


def check_host_reads(built: Built) -> None:
    """Stop an offloading GPU run whose jax reads activations back in the wrong layer order."""
    if (built.target.platform == "gpu" and not built.target.compile_only and built.offloaded
            and not placement.host_reads_in_order()):
        raise ConfigError("this jax reads offloaded activations back from the wrong layers on "
                          "this GPU (openxla/xla #46231; fixed in jax 0.11.1): the gradients "
                          "would be wrong; use the pinned jax or a placement without offload")


def start_state(setup: Setup, target: Target, laid_out) -> tuple[dict, int]:
    """(state, steps already done): the resume checkpoint's, resharded onto this run's mesh, or
    a fresh one. Called before the step compiles: a checkpoint that does not read costs none."""
    rules, optimizer = laid_out
    if setup.resume is None:
        return init_state(setup, rules, optimizer), 0
    abstract = program.abstract_state(setup.model, setup.run, rules, optimizer)
    state, meta = checkpoints.restore(setup.resume, abstract)
    return state, meta["step"]
