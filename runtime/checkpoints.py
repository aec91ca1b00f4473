"""Training checkpoints with Orbax (docs/checkpoints.md): asynchronous sharded saves, exact
resumes, stops on request. A checkpoint is a step folder of a `CheckpointManager` directory:
`params`, `optimizer` (its state and the step counter) and `meta` (`run_meta`, JSON)."""

import dataclasses
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from configs import ConfigError, RunConfig, parse_overrides
from hf.config import from_hf, to_hf
from hf.save import DTYPES, write_checkpoint
from model import families
from model.params import abstract_params
from runtime.auto import Candidate, Choice

# Each process writes whole shards: Orbax's replica-parallel saving slices each replicated
# shard eagerly, one XLA program per slice shape (seconds per save on CPUs; off on GPUs).
_absl = logging.getLogger("absl")
_level = _absl.level
_absl.setLevel(logging.ERROR)  # Orbax warns of the override, in every process
ocp.type_handlers.register_type_handler(
    jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
_absl.setLevel(_level)

# Settings that change the trained numbers (declared resume="same", configs/__init__.py): a
# resume must match them; the rest may change between runs.
_SAME_ON_RESUME = [f.name for f in dataclasses.fields(RunConfig) if f.metadata["resume"] == "same"]


class CheckpointNotFound(ConfigError):
    """A resume or export target with no complete, readable checkpoint: exit status 2."""


def _read(step_dir: Path, **items) -> dict:
    """Items of one step folder (a reader: it never creates, writes or deletes anything)."""
    asyncio_log = logging.getLogger("asyncio")
    level = asyncio_log.level
    # A damaged file fails one read; Orbax's asyncio.run then logs each other pending read's
    # failure at its shutdown (thousands of lines), before the one line below says why.
    asyncio_log.setLevel(logging.CRITICAL)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
            return reader.restore(step_dir.absolute(), args=ocp.args.Composite(**items))
    except Exception as e:  # Orbax and TensorStore raise many types for damaged files
        raise CheckpointNotFound(f"checkpoint {step_dir} does not read back: "
                                 f"{_reason(e)}") from None
    finally:
        asyncio_log.setLevel(level)


def _reason(error: BaseException) -> str:
    """The first line of the error's first cause: TensorStore's says what is wrong with which
    file; Orbax's wrapper around it, only that a read failed (and a repr of the store)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).split(" See full TensorStore details")[0]
    return (text.splitlines() or [type(error).__name__])[0][:200]


def _plain(value) -> object:
    """JSON's view of a config value (tuples as lists, nested dataclasses as dicts)."""
    return json.loads(json.dumps(dataclasses.asdict(value) if dataclasses.is_dataclass(value)
                                 else value, default=str))


_META_KEYS = {"step", "global_batch", "model", "run", "hf_config"}


def run_meta(step: int, setup, batch_size: int) -> dict:
    return {"step": step, "experiment": setup.experiment.name, "scale": setup.scale,
            "fit": setup.fit.words if setup.fit else None,
            "auto": setup.choice.record() if setup.choice else None,
            "global_batch": batch_size, "model": _plain(setup.model), "run": _plain(setup.run),
            "hf_config": to_hf(setup.model, setup.run.param_dtype),
            "data_position": "batches are a function of (seed, step): the step is the position"}


def differences(meta: dict, model, run, batch_size: int) -> list[str]:
    """What in this run differs from the checkpoint in ways that change the numbers."""
    found = [f"model.{k}={meta['model'].get(k)} in the checkpoint, {getattr(model, k)} here"
             for k, v in _plain(model).items() if meta["model"].get(k) != v]
    run = _plain(run)
    found += [f"{k}={meta['run'][k]} in the checkpoint, {run[k]} here" for k in _SAME_ON_RESUME
              if meta["run"].get(k) != run[k]]
    if meta["global_batch"] != batch_size:
        found.append(f"global batch {meta['global_batch']} in the checkpoint, {batch_size} here "
                     "(set global_batch= to keep it on a different device count)")
    return found


@dataclasses.dataclass(frozen=True)
class Source:
    """A checkpoint directory and the steps to try, newest first (one when a step was named)."""
    directory: Path
    steps: tuple[int, ...]

    def meta(self, step: int) -> dict:
        where = self.directory / str(step)
        meta = _read(where, meta=ocp.args.JsonRestore())["meta"]
        if not isinstance(meta, dict) or (missing := _META_KEYS - meta.keys()):
            raise CheckpointNotFound(f"checkpoint {where}: not one of this trainer's (its "
                                     f"settings lack {sorted(missing or _META_KEYS)[0]!r})")
        return meta


def _complete_steps(directory: Path) -> list[int]:
    steps = ocp.path.step.checkpoint_steps(directory) if directory.is_dir() else []
    return sorted(steps, reverse=True)


def _run_order(run_dir: Path) -> tuple[str, int]:
    """A run folder's place in time: its stamp, then its same-second number (`-2` < `-10`)."""
    stamp = re.search(r"(\d{8}-\d{6})(?:-(\d+))?$", run_dir.name)
    return (stamp[1], int(stamp[2] or 0)) if stamp else ("", 0)


def find(target: str, out_dir: str, run_prefix: str, said: str = "resume=") -> Source:
    """The checkpoint `target` names (`said` is how the command line gave it): `latest` (the
    newest `run_prefix-*` folder under `out_dir` with a complete checkpoint), a run folder, a
    checkpoint directory or a step folder."""
    if target == "latest":
        runs = sorted(Path(out_dir).glob(f"{run_prefix}-*"), key=_run_order, reverse=True)
        for run_dir in runs:
            if steps := _complete_steps(run_dir / "checkpoints"):
                return Source(run_dir / "checkpoints", tuple(steps))
        raise CheckpointNotFound(f"{said}latest: no run folder {out_dir}/{run_prefix}-* holds a "
                                 "complete checkpoint")
    path = Path(target)
    if not path.exists():
        raise CheckpointNotFound(f"{said}{target}: no such file or directory")
    if path.name.isdigit() and (path / "_CHECKPOINT_METADATA").exists():
        return Source(path.parent, (int(path.name),))
    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if steps := _complete_steps(directory):
        return Source(directory, tuple(steps))
    partial = [p.name for p in directory.glob("*.orbax-checkpoint-tmp*")]
    why = f"only an unfinished save ({partial[0]})" if partial else "no complete checkpoint"
    raise CheckpointNotFound(f"{said}{target}: {why} in {directory}")


def check_folder(said: str, folder: str) -> None:
    """`folder`, or its nearest parent that exists, a writable folder (`said`: as given)."""
    existing = next(p for p in (Path(folder), *Path(folder).parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{said}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{said}: {existing} is not writable")


def recorded_fit(target: str, out_dir: str, run_prefix: str) -> dict[str, str]:
    """The fit words a fit scale run's checkpoint was trained with (what a resume takes)."""
    source = find(target, out_dir, run_prefix)
    words = source.meta(source.steps[0]).get("fit")
    if not isinstance(words, dict) or "model.n_layers" not in words:
        raise CheckpointNotFound(f"resume={target}: not a fit scale run's checkpoint (it "
                                 "records no fit); resume it at its own scale")
    return {str(k): str(v) for k, v in words.items()}


def recorded_choice(source: "Source") -> Choice | None:
    """The placement preset=auto chose for the run that wrote `source` (None: it chose none)."""
    record = source.meta(source.steps[0]).get("auto")
    if not record:
        return None
    return Choice(Candidate(record["preset"], tuple(record["changes"].items()),
                            record["placement"], tuple(record.get("state", {}).items())),
                  recorded=True)


def check_outputs(model, run, run_prefix: str, batch_size: int) -> Source | None:
    """The output folders and the resume checkpoint (`resume=latest`: the newest
    `run_prefix-*` run's), checked before anything is compiled."""
    for key, folder in (("out_dir", run.out_dir), ("checkpoint_dir", run.checkpoint_dir)):
        if folder:
            check_folder(f"{key}={folder}", folder)
    if run.checkpoint_dir and any(Path(run.checkpoint_dir).glob("*")):
        raise ConfigError(f"checkpoint_dir={run.checkpoint_dir} is not empty: resume="
                          f"{run.checkpoint_dir} continues from it; a new run needs a new folder")
    if run.resume:
        source = find(run.resume, run.out_dir, run_prefix)
        meta = source.meta(source.steps[0])
        if found := differences(meta, model, run, batch_size):
            raise ConfigError(f"resume={run.resume}: not this run's checkpoint: {found[0]}"
                              + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""))
        if meta["step"] >= run.steps:
            raise ConfigError(f"resume={run.resume}: the checkpoint is at step {meta['step']}, "
                              f"the run has {run.steps} steps: nothing left to train")
        return source
    return None


def restore(source: Source, abstract_state: dict) -> tuple[dict, dict]:
    """(state, meta) of `source`'s newest step that reads back, resharded onto `abstract_state`'s
    shardings; unless a step was named, an unreadable one is reported and the one before tried."""
    optimizer = {"opt_state": abstract_state["opt_state"], "step": abstract_state["step"]}
    for step in source.steps:
        where = source.directory / str(step)
        got, problem = None, f"checkpoint {where}: another process could not read its shards"
        try:
            got = _read(where, params=ocp.args.StandardRestore(abstract_state["params"]),
                        optimizer=ocp.args.StandardRestore(optimizer), meta=ocp.args.JsonRestore())
        except CheckpointNotFound as e:
            problem = str(e)
        read = got is not None
        if jax.process_count() > 1:  # each reads its own shards: all fall back or fail together
            read = bool(np.all(multihost_utils.process_allgather(np.array(read))))
        if read:
            return {"params": got["params"], **got["optimizer"]}, got["meta"]
        if step == source.steps[-1]:
            raise CheckpointNotFound(problem) from None
        if jax.process_index() == 0:
            print(f"warning: {problem}; trying the one before it", file=sys.stderr)


def read_params(source: Source, abstract_params) -> tuple[dict, dict]:
    """(params, meta) of the newest step, without the optimizer state."""
    got = _read(source.directory / str(source.steps[0]),
                params=ocp.args.StandardRestore(abstract_params), meta=ocp.args.JsonRestore())
    return got["params"], got["meta"]


def host_params(source: Source, meta: dict) -> tuple[object, dict]:
    """(model config, params) of the newest step (`meta` its settings), on one CPU device: a
    GPU would not hold a whole large model."""
    cfg = from_hf(meta["hf_config"])
    cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu),
                            abstract_params(families.of(cfg).param_specs(cfg),
                                            meta["run"]["param_dtype"]))
    return cfg, read_params(source, abstract)[0]


class Saver:
    """The run's checkpoint directory, made at the first save. Saves are asynchronous (copied off
    the devices, then written while the next steps run); the newest `keep` are kept."""

    def __init__(self, directory: Path, keep: int, every: int):
        self.directory, self.keep, self.every = directory, keep, every
        self.manager = None
        self.saved: list[Path] = []

    def due(self, step: int, last_step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == last_step)

    def save(self, step: int, state: dict, meta: dict) -> None:
        if self.manager is None:
            self.manager = ocp.CheckpointManager(self.directory.absolute(), options=(
                ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True,
                                             enable_async_checkpointing=True)))
        self.manager.save(step, force=True, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            optimizer=ocp.args.StandardSave({"opt_state": state["opt_state"],
                                             "step": state["step"]}),
            meta=ocp.args.JsonSave(meta)))
        self.saved.append(self.directory / str(step))

    def close(self) -> None:
        if self.manager is not None:
            self.manager.wait_until_finished()
            self.manager.close()


class StopRequests:
    """While open, SIGTERM or Ctrl-C asks the run to stop at the next step boundary, after a
    final checkpoint; a second Ctrl-C stops at once. With several processes, JAX's preemption
    service (it handles SIGTERM itself) stops every process at the same step."""

    def __init__(self):
        self.signal, self.previous = None, {}
        self.multi = jax.process_count() > 1

    def __enter__(self) -> "StopRequests":
        # One process stopping alone would leave the others waiting in a collective.
        caught = () if self.multi else (signal.SIGINT, signal.SIGTERM)
        self.previous = {s: signal.signal(s, self._catch) for s in caught}
        return self

    def _catch(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum)

    def reached(self, step: int) -> bool:
        if self.multi and multihost_utils.reached_preemption_sync_point(step):
            self.signal = signal.SIGTERM
        return self.signal is not None

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def export(argv: list[str]) -> None:
    """`python train.py export CHECKPOINT hf_dir=DIR [dtype=...]`: the checkpoint's parameters
    written as a Hugging Face checkpoint."""
    if not argv or "=" in argv[0]:
        raise ConfigError("usage: python train.py export CHECKPOINT hf_dir=DIR "
                          "[dtype=float32|bfloat16]")
    options = parse_overrides(argv[1:])
    if unknown := options.keys() - {"hf_dir", "dtype"}:
        raise ConfigError(f"export: unknown key {sorted(unknown)[0]!r}; it takes hf_dir, dtype")
    target, hf_dir, dtype = argv[0], options.get("hf_dir", ""), options.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
    if not hf_dir:
        raise ConfigError("export needs hf_dir=DIR, a new or empty folder")
    out = Path(hf_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"hf_dir={hf_dir} exists and is not an empty folder: nothing is "
                          "overwritten")
    if target == "latest":
        raise ConfigError("export needs the checkpoint's path (a run folder, a checkpoint "
                          "directory or one step folder), not latest")
    source = find(target, "", "", "export ")
    cfg, params = host_params(source, source.meta(source.steps[0]))
    written = write_checkpoint(out, cfg, jax.tree.map(np.asarray, params), dtype)
    print(f"exported {target} to {written[0].parent}: config.json and {len(written)} "
          f"safetensors file(s)")
