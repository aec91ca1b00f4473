"""Per-device memory of a training step, read from abstract values (nothing allocated): the
sharded abstract train state, the tagged values and what autodiff saves. The peak is an estimate:
it misses NCCL scratch, cuDNN workspaces, XLA's temporaries and fragmentation (a real run's)."""

import dataclasses

import jax
import numpy as np

from configs import PIPELINED, Experiment
from offload.state import in_host_memory, moment_bytes, per_device_bytes
from study.hardware.compile_only import pool_bytes
from study.hardware.gpus import Gpu
from study.plan.traced_step import TracedStep, traced_step
from study.programs import offload_proof
from study.programs.addressing import Proof
from study.programs.jaxpr import Residual, Tagged


@dataclasses.dataclass(frozen=True)
class TagLine:
    """One tag of the per-device, per-layer program, with its placement."""
    value: Tagged
    where: str  # what the placement asks for the tag: device, offload or remat
    needed: bool  # does the backward pass use it at all (else no placement changes anything)
    offloaded: bool  # what the exported GPU program asks (JAX's annotations)
    in_host_memory: bool | None = None  # what the compiled GPU program does; None: not compiled
    addressing: Proof | None = None  # whether it reads its host buffer back where it wrote it


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    params: int
    grads: int
    optimizer: int
    tags: list[TagLine]
    residuals: list[Residual]  # per device; arguments (the parameters) excluded
    layers: tuple[int, ...]  # the length of each layer scan
    layer_weights: int  # one layer's weights, whole (as all-gathered), in the compute dtype
    exchange: int  # expert parallelism's exchange blocks in one MoE layer (0 without)
    capacity: int  # device memory
    host_capacity: int  # host memory per device
    matrices: tuple[int, int] | None = None  # NVFP4 layer matrices: compute dtype, as NVFP4
    optimizer_on_host: bool = False  # optimizer_state=host (offload/state.py)
    host_params: int = 0  # parameters=host: the layer scans' weights in host memory (their
    # gradients go there too: the same bytes, model/layers.py's `to_device`)
    host_layer: int = 0  # parameters=host: a layer's weights and gradient, on the device while
    # its backward pass runs (`layer_from_host`)
    moments: int = 0  # the AdamW moments: the optimizer state but its 0-d step counts
    link: tuple[int, int] = (0, 0)  # the state's bytes per step over the host link, host ->
    # device and device -> host, traced (TracedStep.state_moves)
    transposed_weights: int = 0  # stacked weights XLA copies for the whole step (plan())
    pipelined: int = 0  # offloaded tensors pipelined host offloading holds a layer longer

    @property
    def device_activations(self) -> int:
        return sum(r.nbytes for r in self.residuals if not r.on_host)

    @property
    def host_activations(self) -> int:
        return sum(r.nbytes for r in self.residuals if r.on_host)

    @property
    def layer_working_set(self) -> int:
        """One layer's backward, each term at its widest layer: every tagged value live at once
        (recomputed or fetched), gathered weights, expert exchange blocks. The compiled loop
        gathers no layer ahead, freeing each gathered matrix for its gradient (test_plan_terms)."""
        return _widest_layer([t.value for t in self.tags]) + self.layer_weights + self.exchange

    @property
    def device_params(self) -> int:
        return self.params - self.host_params

    @property
    def device_grads(self) -> int:
        return self.grads - self.host_params

    @property
    def device_optimizer(self) -> int:
        return 0 if self.optimizer_on_host else self.optimizer

    @property
    def host_state(self) -> int:
        """The state a step keeps in host memory between steps: parameters=host the layer
        scans' weights, optimizer_state=host the moments (the 0-d step counts stay on the
        device)."""
        return self.host_params + (self.moments if self.optimizer_on_host else 0)

    @property
    def host_peak(self) -> int:
        """Host memory a step needs at once: the offloaded activations; with state on host, that
        state (the update writes it over itself, a layer at a time) and the layer scans'
        gradients (parameters=host: written as the backward pass reads the activations)."""
        return self.host_state + self.host_params + self.host_activations

    @property
    def link_params(self) -> tuple[int, int]:
        """The parameters' share of `link` (host -> device, device -> host): the weights and
        their gradients; the moments (optimizer_state=host) move once each way."""
        moments = self.moments if self.optimizer_on_host else 0
        return self.link[0] - moments, self.link[1] - moments

    @property
    def peak_estimate(self) -> int:
        return (self.device_params + self.device_grads + self.device_optimizer
                + self.device_activations + self.layer_working_set + self.host_layer
                + self.transposed_weights + self.pipelined)

    @property
    def fits(self) -> bool:
        return self.peak_estimate <= self.capacity and self.host_peak <= self.host_capacity


def per_device_residuals(residuals: list[Residual], param_shapes: set[tuple],
                         shards: int) -> list[Residual]:
    """Residuals of a per-device trace less parameters (state), casts of whole ones FSDP-sharded."""
    return [dataclasses.replace(r, shape=(r.shape[0] // shards, *r.shape[1:]))
            if r.shape in param_shapes and r.shape[0] % shards == 0 else r
            for r in residuals if not r.is_argument]


def host_state_buffers(step: TracedStep) -> set[tuple]:
    """Per-device (shape, dtype) of the train state's stacked leaves that live in host memory
    (optimizer_state=host: the moments; parameters=host: the layer scans' weights, and so their
    gradients and new copies): the host buffers of a compiled program that are not offloaded
    activations."""
    return {(tuple(leaf.sharding.shard_shape(leaf.shape)), str(leaf.dtype))
            for leaf in jax.tree.leaves(step.state) if leaf.ndim > 1 and in_host_memory(leaf)}


def tag_lines(step: TracedStep, placement: dict | None,
              compiled_hlo: str | None = None) -> list[TagLine]:
    """Every tag of every layer scan as the exported GPU program places it (given its HLO, XLA)."""
    exported = step.exported(placement)
    in_host = None  # (scan, tag) -> the addressing proof of its host buffer
    if compiled_hlo is not None:
        in_host = offload_proof.compiled_host_buffers(compiled_hlo, step.moved(placement),
                                                  host_state_buffers(step))
    placement = placement or {}
    return [TagLine(s, placement.get(s.scan, {}).get(s.tag, "remat"),
                    (s.scan, s.tag) in step.needed,
                    (s.scan, s.tag) in exported,
                    None if in_host is None else (s.scan, s.tag) in in_host,
                    None if in_host is None else in_host.get((s.scan, s.tag)))
            for s in step.sites]


def full_scale(experiment: Experiment, gpu: Gpu, placement: dict | None,
               compiled_hlo: str | None = None) -> MemoryPlan:
    """The experiment's full-scale plan on `gpu`s under these placement (given compiled HLO,
    XLA's placement)."""
    run = experiment.run
    step = traced_step(experiment.model, run, run.mesh.shape(run.mesh.devices))
    return plan(step, placement, tag_lines(step, placement, compiled_hlo), pool_bytes(gpu),
                gpu.host_memory)


def plan(step: TracedStep, placement: dict | None, tags: list[TagLine], capacity: int,
         host_capacity: int, activations: TracedStep | None = None) -> MemoryPlan:
    """The static memory plan of `step` under `placement`, per device; what autodiff keeps
    traced on `activations` if given (the search's: the same per device at another
    expert-parallel degree, study/search/tracer.py)."""
    # Shapes of the FSDP-sharded parameters (a device's own experts are whole already).
    shapes = {spec.shape for spec in jax.tree.leaves(step.specs) if not step.split_by_expert(spec)}
    on_host = step.run.optimizer_state == "host" or step.run.parameters == "host"
    return MemoryPlan(
        params=per_device_bytes(step.state["params"]),
        grads=per_device_bytes(step.state["params"]),
        optimizer=per_device_bytes(step.state["opt_state"]),
        tags=tags,
        residuals=per_device_residuals((activations or step).residuals(placement), shapes,
                                       step.shards),
        layers=tuple(step.layers.values()),
        # The layer casts its weights to the compute dtype, so their gradients arrive (and are
        # reduce-scattered) in it; only a device's shard becomes param_dtype.
        layer_weights=step.widest_layer_weights() * step.compute_bytes,
        exchange=step.exchange_buffers(), capacity=capacity, host_capacity=host_capacity,
        matrices=step.quantizable_matrices() if step.run.quant != "none" else None,
        optimizer_on_host=step.run.optimizer_state == "host",
        host_params=per_device_bytes([x for x in jax.tree.leaves(step.state["params"])
                                      if in_host_memory(x)]),
        host_layer=layer_from_host(step), moments=moment_bytes(step.state["opt_state"]),
        link=step.state_moves(placement) if on_host else (0, 0),
        transposed_weights=transposed_weights(step), pipelined=pipelined(step, tags))


def layer_from_host(step: TracedStep) -> int:
    """parameters=host: per device, what the widest layer of a scan in host memory holds on the
    device while its backward pass runs: its weights (`to_device`, again for the recompute) and
    its gradient before it goes to host memory, each its FSDP shard in the parameters' dtype.
    (The update brings a layer's weights and gradient, and writes its new weights, after the
    backward pass has freed the activations.)"""
    params = step.state["params"]
    return 2 * max((per_device_bytes(params[s]) // step.layers[s] for s in step.scans
                    if any(map(in_host_memory, jax.tree.leaves(params[s])))), default=0)


def pipelined(step: TracedStep, tags: list[TagLine]) -> int:
    """Under pipelined host offloading (the XLA flag), one layer's offloaded tensors of the scan
    offloading most, fetched a layer early by the backward pass (an estimate: docs/placement.md)."""
    if step.run.xla_flags.get(PIPELINED, "false") != "true":
        return 0
    return _widest_layer([line.value for line in tags if line.offloaded])


def transposed_weights(step: TracedStep) -> int:
    """Per device, the layer scans' stacked weights XLA keeps a second, transposed copy of for the
    whole step: those FSDP shards on an axis after their first per-layer one (wo and w_down, on
    their output axis; not the routed experts, on their first). An all-gather concatenates its
    major axis, so XLA lays the stack out sharded axis first, once (a `wrapped_transpose` of the
    parameter's bytes exactly: tests/test_plan_terms.py). One device gathers and copies nothing;
    nor does a stack in host memory (parameters=host: the device holds a layer of it at a time,
    so no stacked copy: the compiled device total drops by it, tests/test_plan_terms.py)."""
    if step.shards == 1:
        return 0
    copied = []
    for scan in step.scans:
        for leaf in step.state["params"][scan].values():
            if in_host_memory(leaf):
                continue
            sharded = [i for i, axis in enumerate(leaf.sharding.spec) if i and axis is not None]
            if sharded and np.prod(leaf.shape[1:sharded[0]]) > 1:
                copied.append(leaf)
    return per_device_bytes(copied)


def _widest_layer(values: list[Tagged]) -> int:
    """The bytes of `values` in one layer of the scan that has most."""
    scans = {v.scan for v in values}
    return max((sum(v.nbytes for v in values if v.scan == s) for s in scans), default=0)
