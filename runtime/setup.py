"""A run's settings, resolved and checked before anything is compiled (any mistake is one
line and exit status 2); what a run checks of this machine once its program exists; and its
first state, fresh or resumed."""

import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

import configs
from configs import ConfigError
from data.tokens import token_source
from hf.load import Checkpoint, open_checkpoint
from model import families
from offload import activations, optimizer_state
from runtime import checkpoints
from trainer.program import Program, quantization_problems


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
    if found := found or quantization_problems(model, run):
        raise ConfigError("; ".join(found))
    if run.attention == "cudnn" and not full and devices[0].platform != "gpu":
        raise ConfigError(f"attention=cudnn needs a GPU; this backend is {devices[0].platform}")
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
        return activations.resolve(run.preset, run.placement, families.of(model).SCANS)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def start_state(program: Program, setup: Setup) -> tuple[dict, int]:
    """(state, steps already done): the resume checkpoint's, resharded onto the program's
    mesh, or a fresh one. Before the step compiles: a checkpoint that does not read costs none."""
    if setup.resume is None:
        return program.init_state(setup.hf_params), 0
    state, meta = checkpoints.restore(setup.resume, program.state_shapes)
    return state, meta["step"]


def check_machine(program: Program, offloads: bool) -> None:
    """What this machine must have for the program, checked before step 1."""
    target = program.target
    if program.run.optimizer_state == "host":
        kinds = {m.kind for m in target.devices[0].addressable_memories()}
        if "pinned_host" not in kinds:
            raise ConfigError(f"optimizer_state=host: the {target.platform} backend has no "
                              f"pinned_host memory (it has {', '.join(sorted(kinds)) or 'none'})")
        moments = optimizer_state.moment_bytes(program.state_shapes["opt_state"])
        need = 2 * moments * len(jax.local_devices())
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > have:
            raise ConfigError(f"optimizer_state=host: the state and its new copy need "
                              f"{need / 2**30:.1f} GiB of host memory here, the host has "
                              f"{have / 2**30:.1f} GiB; keep it on the device or use more hosts")
    if target.platform == "gpu" and offloads and not host_reads_in_order():
        raise ConfigError("this jax reads offloaded activations back from the wrong layers on "
                          "this GPU (openxla/xla #46231; fixed in jax 0.11.1): the gradients "
                          "would be wrong; use the pinned jax or a placement without offload")


def _probe_gradient(policy, weights, x):
    def layer(x, w):
        y = checkpoint_name(jnp.sin(x * w), "probe")
        return x + jnp.cos(y) * w, None

    body = layer if policy is None else jax.checkpoint(layer, policy=policy, prevent_cse=False)
    return jax.grad(lambda w: jnp.sum(jnp.square(jax.lax.scan(body, x, w)[0])))(weights)


def host_reads_in_order(gradient=_probe_gradient, layers: int = 4) -> bool:
    """Whether a scan whose layers each offload one value has the gradient of one that keeps
    them on the device: jaxlib 0.10.2 and 0.11.0 read them back from the wrong layers on GPUs
    (openxla/xla #46231)."""
    offload = activations.checkpoint_policy({"probe": "offload"})
    keys = jax.random.split(jax.random.key(0), 2)
    weights = jax.random.normal(keys[0], (layers, 8, 128), jnp.float32)
    x = jax.random.normal(keys[1], (8, 128), jnp.float32)
    kept, offloaded = (np.asarray(jax.jit(gradient, static_argnums=0)(p, weights, x))
                       for p in (None, offload))
    return bool(np.allclose(offloaded, kept, rtol=1e-4, atol=1e-5))
