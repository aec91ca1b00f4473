"""A run's settings, resolved and checked before anything is compiled (any mistake is one
line and exit status 2); what a run checks of this machine once its program exists; and its
first state, fresh or resumed."""

import dataclasses
import importlib.util
import time

import jax

import configs
from configs import ConfigError
from data.tokens import TokenSource, token_source
from hf.load import Checkpoint, open_checkpoint
from model import families
from offload import activations
from offload import state as host_state
from runtime import auto, backend, checkpoints, fit as fits, report
from runtime.own_program import CompiledMemory, size_words
from trainer.program import Program, quantization_problems, sharding_problems
from trainer.target import Target


@dataclasses.dataclass(frozen=True)
class Setup:
    """A run's settings, resolved and checked: complete when made."""
    experiment: configs.Experiment
    scale: str
    scale_reason: str
    model: configs.ModelConfig
    run: configs.RunConfig
    placement: dict | None  # scan -> {tag: device|offload|remat}; None: checkpointing off
    data: TokenSource
    hf_params: Checkpoint | None  # init_from, not read yet: each process reads its share
    resume: checkpoints.Source | None  # the checkpoint this run continues from
    args: tuple[str, ...]  # the command line's key=value overrides, as given
    fit: fits.Fit | None  # at fit scale: what it reduced and measured (a resume: recorded)
    # preset=auto: what it chose (None until program_for; a resume: the checkpoint's). Until
    # then the placement is the experiment's own preset's, the one a fit is found for.
    choice: auto.Choice | None = None


def choose_scale(name: str, model, run: configs.RunConfig, requested: str, devices: tuple):
    """(scale, why). Full scale needs exactly the accelerators of the full-scale run's mesh;
    GPUs that do not cover it run its layers at fit scale, a CPU its proxy (or, asked for, a
    fit within fit_memory)."""
    if bad := [line for line in configs.out_of_range(model, run) if line.startswith("mesh.")]:
        raise ConfigError("; ".join(bad))  # the count of devices below needs the mesh sound
    mesh, platform = run.mesh, devices[0].platform
    need = mesh.devices if mesh.fsdp > 0 else None  # fsdp=-1: any multiple of data x expert
    have = f"{len(devices)} {platform} device(s)"
    enough = platform != "cpu" and (
        len(devices) == need if need else len(devices) % (mesh.data * mesh.expert) == 0)
    count = need or f"a multiple of {mesh.data * mesh.expert}"
    if requested == "full" and not enough:
        raise ConfigError(f"{name} at full scale needs {count} accelerator(s) (mesh "
                          f"data={mesh.data} x fsdp={mesh.fsdp} x expert={mesh.expert}); this "
                          f"machine has {have}")
    if requested == "fit" and platform != "gpu" and not run.fit_memory:
        raise ConfigError(f"scale=fit on {have} needs fit_memory=GiB, what a device's program "
                          "may hold (on a GPU: XLA's pool)")
    if requested in ("fit", "proxy"):
        return requested, f"asked for; this machine has {have}"
    if enough:
        return "full", f"{have} cover the experiment's mesh"
    why = f"full scale needs {count} accelerator(s); this machine has {have}"
    return ("fit", why + ": its layers, as many as fit") if platform == "gpu" else ("proxy", why)


def fit_mesh(model, mesh: configs.MeshConfig, devices: int) -> configs.MeshConfig:
    """A fit's mesh: FSDP over the machine's devices, the routed experts split over the
    experiment's expert degree where it divides them, else the largest one that does (and
    divides the experts)."""
    experts = getattr(model, "n_experts", 1)
    expert = max(e for e in range(1, min(mesh.expert, devices) + 1)
                 if devices % e == 0 and experts % e == 0)
    return configs.MeshConfig(data=1, fsdp=devices // expert, expert=expert)


def at_scale(experiment: configs.Experiment, scale: str, overrides: dict, devices: int):
    """(model, run) of `experiment` at `scale` (not full: resolve has it) with the overrides;
    a fit's on this machine's mesh, its micro batch per device kept (global_batch follows the
    device count)."""
    model, run = experiment.at_scale(scale)
    if scale == "fit":
        run = dataclasses.replace(run, mesh=fit_mesh(model, run.mesh, devices), global_batch=0)
    return configs.apply_overrides(model, run, overrides)


def resolve(name: str, args: list[str], devices: tuple = (), full: bool = False) -> Setup:
    """The run's settings, checked: at the scale these `devices` can run, or at full scale
    for the experiment's own mesh (`full`: a plan or a compile without its GPUs). At fit scale
    the layers are the experiment's full count, or a resumed run's recorded fit: the fit
    itself needs compiled programs (runtime/fit.py)."""
    experiment = configs.get(name)
    overrides = configs.parse_overrides(args)
    requested = overrides.get("scale", experiment.run.scale)
    if requested not in configs.SCALES:
        raise ConfigError(f"scale={requested!r}: choose one of {', '.join(configs.SCALES)}")
    # The full-scale settings decide the scale (their mesh); another scale has its own base.
    model, run = configs.apply_overrides(*experiment.at_scale("full"), overrides)
    scale, why = (("full", "asked for its GPUs") if full
                  else choose_scale(name, model, run, requested, devices))
    if scale != "full":
        model, run = at_scale(experiment, scale, overrides, len(devices))
    if run.fit_memory and scale != "fit" and run.preset != activations.AUTO:
        raise ConfigError(f"fit_memory={run.fit_memory:g} is the budget of the fit scale and "
                          f"of preset=auto; this run is at {scale} scale ({why}) with "
                          f"preset={run.preset}")
    recorded = None
    if scale == "fit" and run.resume:  # the fit the checkpoint was trained at, not searched
        recorded = fits.Fit(checkpoints.recorded_fit(run.resume, run.out_dir, f"{name}-fit"),
                            model, recorded=True)
        model, run = configs.apply_overrides(model, run, {
            k: v for k, v in recorded.words.items() if k not in overrides})
    if scale == "fit" and (problem := fits.layer_problem(model, set(overrides))):
        raise ConfigError(problem)
    if scale == "fit" and run.init_from:
        raise ConfigError("init_from at fit scale: the fit trains fewer layers than the "
                          "checkpoint holds (scale=full, or a model of its size)")
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
    n_devices = run.mesh.devices if full else len(devices)
    found = configs.problems(model, run, n_devices)
    if found := (found or sharding_problems(model, run, n_devices)
                 or quantization_problems(model, run)):
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
    resume = None if full else checkpoints.check_outputs(model, run, f"{name}-{scale}",
                                                         run.batch(len(devices)))
    placement = resolve_placement(model, run, experiment.run.preset)
    choice = None
    if run.preset == activations.AUTO and resume is not None:  # its choice, not measured again
        choice = checkpoints.recorded_choice(resume)
        placement = choice.chosen.placement if choice else placement
        run = with_state(run, choice.chosen) if choice else run
    return Setup(experiment, scale, why, model, run, placement, data, hf_params, resume,
                 tuple(args), recorded, choice)


def resolve_placement(model, run: configs.RunConfig, own: str = "") -> dict | None:
    """The run's placement; at preset=auto, the experiment's `own` preset's until the choice
    (runtime/auto.py), with the run's tag changes (fixed in every candidate)."""
    if run.preset == activations.AUTO:
        run = dataclasses.replace(run, preset=own)
    if run.preset == activations.NO_CHECKPOINT:
        if run.tag_changes:
            raise ConfigError("placement.<tag> overrides need a preset, not preset=none")
        if run.parameters == "host":  # (model/layers.scan_layers: fetched inside the policy)
            raise ConfigError("parameters=host needs a preset: without checkpointing the "
                              "backward pass keeps every layer's weights on the device")
        return None
    try:
        return activations.resolve(run.preset, run.tag_changes, families.of(model).SCANS)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def machine_budget(run, target: Target) -> fits.Budget:
    """This machine's budget: XLA's pool per GPU (or fit_memory), and the pinned host memory
    this process may hold (runtime/backend.py), shared by its devices."""
    return fits.budget(run.fit_memory, target.pool_bytes(), backend.host_limit(),
                       len(jax.local_devices()))


def with_fit(setup: Setup, fit: fits.Fit) -> Setup:
    """`setup` with the fit's words applied (a vocabulary it reduced draws synthetic tokens
    from the new one: a tokenizer's is never reduced)."""
    model, run = configs.apply_overrides(setup.model, setup.run, fit.words)
    data = setup.data if model.vocab == setup.model.vocab else token_source(
        run.data.path, run.data.dtype, model.vocab, run.seed, run.seq)
    return dataclasses.replace(setup, model=model, run=run, data=data, fit=fit)


def fitted(setup: Setup, target: Target, most: int | None = None) -> tuple[Setup, Program]:
    """The fit of a run at fit scale on this machine and its program, compiled: searched (at
    most `most` layers), or (a resume) the checkpoint's fit, checked. A layer count set on the
    command line that does not fit is one line naming how many do."""
    budget_ = machine_budget(setup.run, target)
    fixed = {k for k in (w.partition("=")[0] for w in setup.args) if k != "scale"}

    def measure(words: dict) -> tuple[CompiledMemory, Program]:
        model, run = configs.apply_overrides(setup.model, setup.run, words)
        program = Program(model, run, setup.placement, target)  # a fit's words keep the scans
        return CompiledMemory.of(program.compile_run()), program

    if setup.fit is not None:  # recorded: the words are applied already
        started = time.perf_counter()
        memory, program = measure({})
        if not budget_.fits(memory):
            raise fits.FitError(f"resume={setup.run.resume}: the checkpoint's fit "
                                f"({' '.join(setup.fit.word_list())}) needs "
                                f"{size_words(memory.device)} per device here, of "
                                f"{budget_.device_words}")
        fit = dataclasses.replace(setup.fit, memory=memory, budget=budget_, compiles=1,
                                  seconds=time.perf_counter() - started)
        return dataclasses.replace(setup, fit=fit), program
    data, fsdp, expert = setup.run.mesh.shape(len(target.devices))
    full = min(setup.experiment.model.n_layers, most or fits.UNBOUNDED)
    fit, program = fits.search(setup.model, setup.run, budget_, measure, fixed, fsdp * expert,
                               target.platform == "gpu", full)
    return with_fit(setup, fit), program


def program_for(setup: Setup, target: Target) -> tuple[Setup, Program]:
    """The run's program for this machine's devices: at fit scale the fit, searched; at
    preset=auto the placement, chosen (at the fit's layer count)."""
    if setup.scale == "fit":
        setup, program = fitted(setup, target)
    else:
        program = Program(setup.model, setup.run, setup.placement, target)
        check_state_placement(program)  # before anything is compiled
    if setup.run.preset != activations.AUTO or setup.choice is not None:
        return setup, program
    choice, program = choose_placement(setup, program, target)
    return dataclasses.replace(setup, run=with_state(setup.run, choice.chosen),
                               placement=choice.chosen.placement, choice=choice), program


def with_state(run: configs.RunConfig, candidate: auto.Candidate) -> configs.RunConfig:
    """`run` with the state where preset=auto's `candidate` keeps it."""
    return dataclasses.replace(run, **dict(candidate.state))


def choose_placement(setup: Setup, first: Program, target: Target) -> tuple[auto.Choice, Program]:
    """preset=auto's choice on this machine, each candidate compiled (`first`, the program of
    the experiment's own preset, reused) and those within the budget timed on its devices."""
    def measure(candidate: auto.Candidate) -> tuple[CompiledMemory, Program]:
        run = with_state(setup.run, candidate)
        program = first if (candidate.placement, run) == (setup.placement, setup.run) else (
            Program(setup.model, run, candidate.placement, target))
        return CompiledMemory.of(program.compile_run()), program

    tokens = setup.data.batch(0, first.batch_size, setup.run.seq)
    return auto.choose(setup, machine_budget(setup.run, target), measure,
                       lambda programs: auto.step_seconds(programs, tokens, setup.run.auto_steps),
                       report.say)


def start_state(program: Program, setup: Setup) -> tuple[dict, int]:
    """(state, steps already done): the resume checkpoint's, resharded onto the program's
    mesh, or a fresh one."""
    if setup.resume is None:
        return program.init_state(setup.hf_params), 0
    state, meta = checkpoints.restore(setup.resume, program.state_shapes)
    return state, meta["step"]


def check_state_placement(program: Program) -> None:
    """The state's parts in host memory (parameters=host, optimizer_state=host) on a machine
    that has it: checked before anything is compiled."""
    if "host" not in (program.run.parameters, program.run.optimizer_state):
        return
    kinds = {m.kind for m in program.target.devices[0].addressable_memories()}
    need = host_state.host_need(program.state_shapes) * len(jax.local_devices())
    if problem := state_problem(program.run, program.target.platform, kinds, need,
                                backend.host_memory()):
        raise ConfigError(problem)


def state_problem(run, platform: str, kinds: set[str], need: int, have: int) -> str | None:
    """Why `run`'s state cannot lie where it asks on a `platform` backend with memory `kinds`
    whose host has `have` bytes (the state's host part needs `need`); None: it can."""
    placed = " ".join(f"{k}=host" for k in ("parameters", "optimizer_state")
                      if getattr(run, k) == "host")
    if not placed:
        return None
    if "pinned_host" not in kinds:
        return (f"{placed}: the {platform} backend has no pinned_host memory (it has "
                f"{', '.join(sorted(kinds)) or 'none'})")
    if need > have:
        return (f"{placed}: the state in host memory needs {need / 2**30:.1f} GiB here (with "
                f"the weights' gradients), the host has {have / 2**30:.1f} GiB; keep it on the "
                "device or use more hosts")
    return None


def check_machine(program: Program, offloads: bool) -> None:
    """What this machine must have for the program, checked before step 1."""
    target = program.target
    check_state_placement(program)
    if target.platform == "gpu" and offloads and not backend.host_reads_in_order():
        raise ConfigError("this jax reads offloaded activations back from the wrong layers on "
                          "this GPU (openxla/xla #46231; fixed in jax 0.11.1): the gradients "
                          "would be wrong; use the pinned jax or a placement without offload")
