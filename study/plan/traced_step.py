"""One training step as abstract values, read by the memory plan, placement list and search.

A `TracedStep` is (model, run) at the run's micro batch on an abstract mesh of the given shape
(nothing allocated, no device needed): the sharded abstract state and batch, and one device's
share of the step traced alone, each view traced on first use and kept. MoE experts are traced
as a GPU computes them (target "any": grouped GEMMs, or one per local expert if expert-parallel).

The study's one trace cache is here: `traced_step()` keeps one TracedStep per model, run and mesh,
and each keeps its views per placement; every tool gets its steps from it (tests/test_study.py).
A `Pool` traces many views at once, in processes beside this one, into the same cache.
"""

import dataclasses
import functools
import gc
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from functools import partial
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from study.programs import jaxpr, offload_proof
from configs import MESH_AXES, RunConfig
from model import families, quant
from model.params import ParamSpec, abstract_params, param_count
from model.sharding import AxisRules
from runtime.own_program import tagged_in, walk
from trainer import program
from trainer.step import make_optimizer, train_step
from trainer.target import ANY


def freeze(placement: dict | None):
    """A placement (scan -> {tag: place}, or None) as a hashable key."""
    return None if placement is None else tuple(
        (s, tuple(sorted(t.items()))) for s, t in sorted(placement.items()))


def _key(name: str, placements: tuple) -> tuple:
    return (name, *map(freeze, placements))


def _traced_once(view):
    """A view of the step under a placement, traced on first use and kept (on the step: the
    cache of traced_step() below holds the steps)."""
    @functools.wraps(view)
    def kept(self, *placement: dict | None):
        key = _key(view.__name__, placement)
        if key not in self._traced:
            self._traced[key] = view(self, *placement)
        return self._traced[key]
    return kept


class TracedStep:
    def __init__(self, model, run: RunConfig, mesh_shape: tuple[int, int, int]):
        self.model, self.run, self.family = model, run, families.of(model)
        self.scans = list(self.family.SCANS)
        self.mesh_shape = tuple(mesh_shape)
        self.devices, self.fsdp, self.expert = math.prod(mesh_shape), *mesh_shape[1:]
        self.shards = self.fsdp * self.expert  # the devices a weight is sharded over
        mesh = AbstractMesh(mesh_shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3)
        self.rules = AxisRules(mesh=mesh)
        self.optimizer = make_optimizer(run.optimizer, run.steps)
        self.state = program.abstract_state(model, run, self.rules, self.optimizer)
        self.batch = program.abstract_batch(run, self.rules, self.devices)
        # One device's share of the work, unsharded: its activations are what it stores. Under
        # expert parallelism it holds only its own experts.
        self.specs = jax.tree.map(self._own_experts, self.family.param_specs(model))
        self.local_params = abstract_params(self.specs, jnp.dtype(run.param_dtype))
        self.local_batch = jax.ShapeDtypeStruct(
            (run.batch(self.devices) // self.devices, run.seq + 1), jnp.int32)
        self.layers = {s: next(iter(self.specs[s].values())).shape[0] for s in self.scans}
        self.compute_bytes = jnp.dtype(run.compute_dtype).itemsize  # per element
        self._traced: dict = {}

    def split_by_expert(self, spec: ParamSpec) -> bool:
        """Under expert parallelism, routed-expert weights: each device has its own share."""
        return self.expert > 1 and "experts" in spec.axes

    def _own_experts(self, spec: ParamSpec) -> ParamSpec:
        if not self.split_by_expert(spec):
            return spec
        shape = list(spec.shape)
        shape[spec.axes.index("experts")] //= self.expert
        return dataclasses.replace(spec, shape=tuple(shape))

    def options(self, placement: dict | None, rules: AxisRules | None = None):
        """The forward under `placement` as a GPU runs it (target "any"): sharded, or one
        device's. One device's weights are plain abstract values, in no memory: it fetches
        none from host memory (parameters=host moves nothing that is traced alone: the
        weights, not the activations; the sharded step counts their moves, `state_moves`)."""
        options = program.forward_options(self.model, self.run, placement, rules, ANY)
        return options if rules else dataclasses.replace(options, weights_on_host=False)

    def loss(self, placement: dict | None, rules: AxisRules | None = None):
        """The loss under `placement` of (params, batch): the sharded step's, or one device's
        alone."""
        with_aux = program.make_loss(self.model, self.run, self.options(placement, rules))
        return lambda params, batch: with_aux(params, batch)[0]

    @property
    @_traced_once
    def sites(self) -> list[jaxpr.Tagged]:
        """Every `checkpoint_name` site, per device and per layer, in scan order."""
        found = jaxpr.tagged_values(self.loss(None), self.local_params, self.local_batch)
        return sorted((v for values in found.values() for v in values),
                      key=lambda v: self.scans.index(v.scan))

    @property
    @_traced_once
    def needed(self) -> set[tuple[str, str]]:
        """(scan, tag) of every tag the backward pass reads: what moves when all are offloaded."""
        everything = {s: {t: "offload" for t in tags} for s, tags in self.family.SCANS.items()}
        return {(v.scan, v.tag) for v in self.moved(everything)}

    @_traced_once
    def moved(self, placement: dict | None) -> list[jaxpr.Tagged]:
        """The values one device's step moves to host memory under `placement`."""
        grad = jax.make_jaxpr(jax.grad(self.loss(placement)))(self.local_params, self.local_batch)
        return [v for values in tagged_in(grad.jaxpr, offloaded=True).values() for v in values]

    @_traced_once
    def residuals(self, placement: dict | None) -> list[jaxpr.Residual]:
        """What one device's backward pass keeps from its forward pass under `placement`."""
        return jaxpr.saved_residuals(self.loss(placement), self.local_params, self.local_batch)

    def sharded_step(self, placement: dict | None):
        """The sharded step under `placement`, jitted as a run jits it."""
        return jax.jit(partial(train_step, model=self.model, run=self.run,
                               options=self.options(placement, self.rules)), donate_argnums=0)

    @_traced_once
    def exported(self, placement: dict | None) -> set[tuple[str, str]]:
        """(scan, tag) the sharded step exported for a GPU offloads under `placement` (verified)."""
        return offload_proof.verify_offloads(self.sharded_step(placement), self.state, self.batch)

    @_traced_once
    def state_moves(self, placement: dict | None) -> tuple[int, int]:
        """Per device, the bytes of the train state one step under `placement` moves over the
        host link, (host -> device, device -> host): every `device_put` between the memories
        of a state leaf, or of one layer of a stacked one, times the lengths of the scans
        around it, at that leaf's shard's bytes: whatever the step moves, so no count here is
        typed. parameters=host: each layer's weights fetched for its forward pass and again
        for its recompute, its gradient sent back (model/layers.py), read back with the
        weights for the update, which writes the new weights (offload/state.py);
        optimizer_state=host: each layer's moments read and written. Offloaded activations
        are not counted (no state leaf has their shapes: checked)."""
        traced = self.sharded_step(placement).trace(self.state, self.batch)
        activations = {(v.shape, str(v.dtype)) for sites in tagged_in(
            traced.jaxpr.jaxpr, offloaded=True).values() for v in sites}
        return _state_moves(traced.jaxpr.jaxpr, _per_device(self.state, self.scans),
                            activations)

    @_traced_once
    def work(self, placement: dict | None) -> jaxpr.Work:
        """Dot FLOPs and all-to-all bytes of the sharded gradient under `placement`, per device."""
        return jaxpr.work(jax.grad(self.loss(placement, self.rules)), self.state["params"],
                          self.batch, devices=self.devices)

    def gathered_layer_bytes(self, scan: str) -> int:
        """One layer's weights as FSDP all-gathers (and reduce-scatters) them, in the compute dtype;
        under expert parallelism a device's own experts (not gathered without an fsdp axis)."""
        return self.compute_bytes * sum(math.prod(s.shape[1:]) for s in self.specs[scan].values()
                                        if self.fsdp > 1 or not self.split_by_expert(s))

    def widest_layer_weights(self) -> int:
        """Parameters of the widest layer (of any scan), as one device's share holds them."""
        return max(param_count(self.specs[s]) // self.layers[s] for s in self.scans)

    def exchange_buffers(self) -> int:
        """Expert parallelism's blocks in one MoE layer: sent, received, their outputs and the
        outputs returned, each [devices x block rows, D] in the compute dtype."""
        parallel = self.options(None).expert_parallel
        if parallel is None:
            return 0
        tokens = self.local_batch.shape[0] * self.run.seq
        rows = self.model.n_experts * parallel.block_rows(tokens, self.model.experts_per_token,
                                                          self.model.n_experts)
        return 4 * rows * self.model.d_model * self.compute_bytes

    def quantizable_matrices(self) -> tuple[int, int]:
        """Per device, the layer matrices `quant=nvfp4` multiplies in NVFP4: (bytes in the
        compute dtype, bytes stored as NVFP4: E2M1 codes at 4 bits, E4M3 scales, FP32 scale)."""
        specs = self.family.param_specs(self.model)
        shapes = [spec.shape for scan in self.scans for name, spec in specs[scan].items()
                  if quant.quantizable(name, len(spec.shape) - 1, self.family.UNQUANTIZED)]
        plain = sum(math.prod(shape) for shape in shapes) * self.compute_bytes
        stored = sum(shape[0] * quant.nvfp4_bytes((math.prod(shape[1:]),), 0) for shape in shapes)
        return plain // self.shards, stored // self.shards


def _per_device(state, scans) -> dict[tuple, set[int]]:
    """(global shape, dtype) -> the bytes one device holds of a value of it, for every leaf of
    the train state and one layer of each stacked leaf (the layer scans' weights and moments)."""
    found: dict[tuple, set[int]] = {}

    def add(shape, shard, dtype):
        found.setdefault((tuple(shape), str(dtype)), set()).add(
            int(np.prod(shard)) * np.dtype(dtype).itemsize)

    for leaf in jax.tree.leaves(state):
        add(leaf.shape, leaf.sharding.shard_shape(leaf.shape), leaf.dtype)
    for scan in scans:
        for leaf in jax.tree.leaves(state["params"][scan]):
            add(leaf.shape[1:], leaf.sharding.shard_shape(leaf.shape)[1:], leaf.dtype)
    return found


def _state_moves(jaxpr, per_device: dict, activations: set) -> tuple[int, int]:
    """(host -> device, device -> host) bytes per device of the `device_put`s between two
    memories of values shaped as the state's (`per_device`: (shape, dtype) -> bytes a device
    holds), each times the lengths of the scans around it."""
    moved = {"device": 0, "host": 0}
    for eqn, count, _, _ in walk(jaxpr):
        if eqn.primitive.name != "device_put":
            continue
        for var, out in zip(eqn.invars, eqn.outvars):
            source, target = (str(getattr(v.aval, "memory_space", "")).lower() for v in (var, out))
            key = (tuple(var.aval.shape), str(var.aval.dtype))
            if source == target or key not in per_device:
                continue
            if len(per_device[key]) != 1 or key in activations:
                raise ValueError(f"a move of {key} cannot be told apart: the shape of state "
                                 f"leaves of {sorted(per_device[key])} bytes per device"
                                 + (" and of an offloaded activation" if key in activations
                                    else ""))
            moved["host" if "host" in target else "device"] += count * min(per_device[key])
    return moved["device"], moved["host"]


_STEPS: dict[tuple, TracedStep] = {}


def traced_step(model, run: RunConfig, mesh_shape: tuple[int, int, int]) -> TracedStep:
    """One TracedStep per model, run and mesh, its traces shared by every tool that asks (the
    rows and placements of one model differ in placement, each traced once per step)."""
    key = (model, repr(run), tuple(mesh_shape))
    if key not in _STEPS:
        _STEPS[key] = TracedStep(model, run, mesh_shape)
    return _STEPS[key]


# (step, view name, placements): one traced view, e.g. (step, "work", (None,)); a property's
# ("sites", "needed") has no placements.
View = tuple[TracedStep, str, tuple]


def _view(step: TracedStep, name: str, placements: tuple):
    value = getattr(step, name)
    return value(*placements) if placements else value


def _view_alone(model, run: RunConfig, mesh_shape: tuple, name: str, placements: tuple):
    """A pool worker's view, of its own traced_step(): what comes back is plain data."""
    return _view(traced_step(model, run, mesh_shape), name, placements)


def _worker_started():
    """A worker traces for any target on abstract values: its JAX on the CPU (on a GPU host it
    would open a GPU client of its own), its cyclic collector off as the search's is
    (study/search/placements.py)."""
    jax.config.update("jax_platforms", "cpu")
    gc.disable()


class Pool:
    """Traces many views at once: each traces alone, and tracing is Python, one core a process.
    `workers` processes beside this one (0: this one only) take views from the front of a list,
    this one from the back, until they meet; every view lands in its step's cache here."""

    def __init__(self, workers: int):
        # spawn, not fork: this process's JAX has threads.
        context = multiprocessing.get_context("spawn")
        self.executor = (ProcessPoolExecutor(workers, context, initializer=_worker_started)
                         if workers else None)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc):
        if self.executor:
            self.executor.shutdown(cancel_futures=True)

    def trace(self, views: list[View]) -> int:
        """Every view of `views` not yet traced, into its step's cache; how many workers traced."""
        todo = {}
        for step, name, placements in views:
            if _key(name, placements) not in step._traced:
                todo.setdefault((id(step), _key(name, placements)), (step, name, placements))
        todo = list(todo.values())
        futures = [self.executor.submit(_view_alone, step.model, step.run, step.mesh_shape, name,
                                        placements) if self.executor else None
                   for step, name, placements in todo]
        elsewhere = 0
        for (step, name, placements), future in reversed(list(zip(todo, futures))):
            # A view a worker has taken (or queued to take) cannot be cancelled: wait for it.
            here = future is None or future.cancel()
            elsewhere += not here
            step._traced[_key(name, placements)] = (_view(step, name, placements) if here
                                                    else future.result())
        return elsewhere


def workers_available() -> int:
    """The processes a Pool may add: one per CPU this process may use but its own, at most
    seven (each starts by importing JAX, and a search's traces are a few dozen)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(7, max(0, (cpus or 1) - 1))
