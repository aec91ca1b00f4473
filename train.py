"""Train a Llama or DeepSeek-V3 decoder with a per-tensor activation placement policy.

    python train.py EXPERIMENT [key=value ...]             run an experiment (see --list)
    python train.py EXPERIMENT --plan [key=value ...]      its full-scale memory plan
    python train.py EXPERIMENT --compile [key=value ...]   its full-scale step compiled for its
                                                           GPUs (device=...), without a GPU
    python train.py EXPERIMENT --search [key=value ...]    placements ranked by predicted memory
                                                           and step time (placement_search.py)
    python train.py --list                                 the experiments, one line each
    python train.py export CHECKPOINT hf_dir=DIR [dtype=bfloat16]
                                                           trained weights as a Hugging Face
                                                           checkpoint (config.json + safetensors)

Resolve (config, scale, policy, data: any mistake is one line and exit status 2) -> build
(mesh, the step compiled ahead of time for the target: this machine's devices or compile-only
GPUs) -> sharded init -> loop -> report.
"""

import backend  # first: it settles the platform and GPU memory before JAX starts

import dataclasses
import signal
import sys
import time

import jax
import jax.numpy as jnp

import checkpoints
import configs
import distributed
import placement_search
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
    resume: checkpoints.Source | None = None  # the checkpoint this run continues from
    args: tuple[str, ...] = ()  # the command line's key=value overrides, as given


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


def layout(setup: Setup, target: backend.Target) -> tuple[common.AxisRules, object]:
    """The run's mesh (in its axis rules) and optimizer: what its state is made for and its
    step compiled for; first, whether the target can run it at all."""
    run = setup.run
    if run.attention == "cudnn" and target.platform != "gpu":
        raise ConfigError(f"attention=cudnn needs a GPU; this backend is {target.platform}")
    mesh = common.make_mesh(run.mesh.shape(len(target.devices)), ("data", "fsdp"),
                            devices=target.devices)
    return training.axis_rules(run, mesh), training.make_optimizer(run.optimizer, run.steps)


def build(setup: Setup, target: backend.Target) -> Built:
    """The one path from settings to a compiled step: a run on this machine's devices and
    `--compile` on compile-only GPUs both come here. The full-scale plan is traced with kernels
    every backend has (it needs no device); on a GPU the run's placement list is checked on
    the compiled program's host buffers, elsewhere on the program exported for a GPU."""
    run = setup.run
    rules, optimizer = layout(setup, target)
    mesh, mesh_shape = rules.mesh, run.mesh.shape(len(target.devices))
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


def check_addressing(built: Built) -> None:
    """Before step 1 on GPUs: a step that reads offloaded activations back from the wrong
    bytes stops the run; one whose addressing cannot be verified runs, with a warning."""
    if refusal := plan.addressing_refusal(built.run_tags):
        raise ConfigError(refusal)
    if problems := plan.addressing_problems(built.run_tags):
        if jax.process_index() == 0:
            print(f"warning: {problems[0]}: the gradients of this run are unproven; "
                  "benchmarks/gpu_check.py checks them on a GPU", file=sys.stderr)


def start_state(setup: Setup, target: backend.Target) -> tuple[dict, int]:
    """(state, steps already done): restored from the resume checkpoint, resharded onto this
    run's mesh, or freshly initialized. Before the step is compiled: a checkpoint that does
    not read back costs no compile."""
    rules, optimizer = layout(setup, target)
    if setup.resume is None:
        return init_state(setup, rules, optimizer), 0
    abstract = training.abstract_state(setup.model, setup.run, rules, optimizer)
    state, meta = checkpoints.restore(setup.resume, abstract)
    return state, meta["step"]


def train(setup: Setup, target: backend.Target) -> dict | None:
    """Run the experiment; its summary (with `stopped_by` when a signal ended it early), or
    None when the loss stopped being finite."""
    with checkpoints.StopRequests() as stop:  # from the start: a signal while compiling counts
        state, done = start_state(setup, target)
        built = build(setup, target)
        check_addressing(built)
        run, n_devices = setup.run, len(target.devices)
        batch_size = run.batch(n_devices)
        batch = global_batch(setup, done, built.rules.sharding(("batch", None)), batch_size)
        flops = training.family(setup.model).training_flops(setup.model, batch_size / n_devices,
                                                            run.seq)
        log = report.RunLog(setup, built, batch_size, flops, first_step=done + 1)
        saver = checkpoints.Saver(log.checkpoint_dir, run.keep, run.checkpoint_every)
        try:
            last = _loop(setup, built, state, batch, done, log, saver, stop)
        finally:
            saver.close()
    if last is None:
        return None
    stopped = stop.signal if last < run.steps else None  # on the last step it stops nothing
    if saver.saved:
        log.say_checkpoint(saver.saved[-1], stopped)
    return {**log.summary(), **({"stopped_by": stopped.name} if stopped else {})}


def _loop(setup, built, state, batch, done, log, saver, stop) -> int | None:
    """Steps done+1.. until the last or a stop request; the last step, or None when the loss
    stopped being finite. Metrics are read one step late (the host runs ahead), except where a
    checkpoint is saved: a state is saved only once its loss is known to be finite."""
    run, batch_sharding = setup.run, built.rules.sharding(("batch", None))
    batch_size = batch.shape[0]
    pending = None  # (step, metrics) dispatched, not yet read
    for i in range(done + 1, run.steps + 1):
        log.maybe_start_profile(i)
        state, metrics = built.compiled(state, batch)
        stopping = stop.reached(i)
        if i < run.steps and not stopping:
            batch = global_batch(setup, i, batch_sharding, batch_size)
        if pending and not log.step_done(*pending):
            return None
        pending = (i, metrics)
        if stopping or saver.due(i, run.steps):
            if not log.step_done(*pending):
                return None
            pending = None
            saver.save(i, state, checkpoints.run_meta(i, setup, batch_size))
        if stopping:
            return i
    return i if pending is None or log.step_done(*pending) else None


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


def print_search(name: str, args: list[str]) -> None:
    """The experiment's placements ranked by predicted memory and step time on its `device`;
    `search.verify=N` compiles the best N for those GPUs through `build` (a minute each)."""
    args, options = placement_search.split_options(args)
    setup = resolve(name, args, full=True)
    result = placement_search.run_search(setup.experiment, options, time.perf_counter)
    print("\n".join(placement_search.report_lines(result, int(options["top"]))))
    if options["plot"] != "off" and jax.process_index() == 0:  # one picture per launch
        print(placement_search.write_plot(result, setup.run.out_dir))
    gpu, run = GPUS[setup.run.device], setup.run
    for prediction in result.ranked[:int(options["verify"])]:
        overrides = placement_search.run_overrides(prediction, setup.model)
        built = build(resolve(name, [*args, *overrides], full=True),
                      backend.compile_only(gpu, run.mesh.data * run.mesh.fsdp))
        print(placement_search.verified_line(prediction, built.compiled, overrides))


def exit_status(summary: dict | None) -> int:
    """0 done; 1 the loss stopped being finite; 128 + the signal's number when stopped by one
    (the shell's convention for a process a signal ended)."""
    if summary is None:
        return 1
    return 128 + signal.Signals[summary["stopped_by"]] if "stopped_by" in summary else 0


def compare(name: str, args: list[str], target: backend.Target) -> int:
    """Run each experiment of a comparison, then print one table of them."""
    for key in ("resume", "checkpoint_dir"):
        if any(a.startswith(key + "=") for a in args):
            raise ConfigError(f"{name} runs several experiments: {key}= is for one of them "
                              f"({', '.join(configs.COMPARISONS[name])})")
    setups = [resolve(experiment, args, target.devices)  # every row checked before any runs
              for experiment in configs.COMPARISONS[name]]
    rows = []
    for setup in setups:
        summary = train(setup, target)
        if status := exit_status(summary):
            return status
        rows.append((setup, summary))
    report.comparison(name, rows)
    return 0


def export(argv: list[str]) -> None:
    """`export CHECKPOINT hf_dir=DIR [dtype=float32|bfloat16]`: the checkpoint's weights as a
    Hugging Face checkpoint."""
    if not argv or "=" in argv[0]:
        raise ConfigError("usage: python train.py export CHECKPOINT hf_dir=DIR "
                          "[dtype=float32|bfloat16]")
    options = configs.parse_overrides(argv[1:])
    if unknown := options.keys() - {"hf_dir", "dtype"}:
        raise ConfigError(f"export: unknown key {sorted(unknown)[0]!r}; it takes hf_dir, dtype")
    written = checkpoints.export(argv[0], options.get("hf_dir", ""),
                                 options.get("dtype", "float32"))
    print(f"exported {argv[0]} to {written[0].parent}: config.json and {len(written)} "
          f"safetensors file(s)")


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
    name, args = argv[0], [a for a in argv[1:] if a not in ("--plan", "--compile", "--search")]
    try:
        distributed.initialize()  # before the backend starts: multi-host runs join here
        target = backend.this_machine()  # starts JAX's backend (quietly; see backend.py)
        if name == "export":
            export(argv[1:])
            return 0
        for flag, show in (("--plan", print_plan), ("--compile", print_compile),
                           ("--search", print_search)):
            if flag in argv:
                for member in configs.COMPARISONS.get(name, (name,)):
                    show(member, args)
                return 0
        if name in configs.COMPARISONS:
            return compare(name, args, target)
        return exit_status(train(resolve(name, args, target.devices), target))
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C: the checkpoint being written is not complete
        print("error: interrupted by a second Ctrl-C; a checkpoint still being written is "
              "incomplete and is never picked", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
