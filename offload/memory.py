"""Per-device memory of a training step, read from abstract values (nothing allocated).

Sizes come from the traced program: the sharded abstract train state, the tagged values and
what autodiff saves. The peak is an estimate: it misses NCCL scratch, cuDNN workspaces, XLA's
temporaries and fragmentation, which only a real run shows.
"""

import dataclasses

import jax
import numpy as np

from offload.addressing import Proof
from offload.trace import Residual, Tagged


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (or arrays)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding else leaf.shape
        total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    return total


@dataclasses.dataclass(frozen=True)
class TagLine:
    """One tag of the per-device, per-layer program, with its placement."""
    value: Tagged
    placement: str  # what the table asks: device, offload or remat
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
    layer_grads: int  # one layer's weight gradients, whole, before reduce-scatter (compute dtype)
    exchange: int  # expert parallelism's exchange blocks in one MoE layer (0 without)
    capacity: int  # device memory
    host_capacity: int  # host memory per device
    matrices: tuple[int, int] | None = None  # NVFP4 layer matrices: compute dtype, as NVFP4

    @property
    def device_activations(self) -> int:
        return sum(r.nbytes for r in self.residuals if not r.on_host)

    @property
    def host_activations(self) -> int:
        return sum(r.nbytes for r in self.residuals if r.on_host)

    @property
    def layer_working_set(self) -> int:
        """One layer's backward: every tagged value live at once (recomputed or fetched), the
        layer's gathered weights twice (in use and prefetched), its unreduced gradients and
        any expert exchange blocks; for the widest layer of each count."""
        by_scan: dict[str, int] = {}
        for t in self.tags:
            by_scan[t.value.scan] = by_scan.get(t.value.scan, 0) + t.value.nbytes
        return (max(by_scan.values(), default=0) + 2 * self.layer_weights + self.layer_grads
                + self.exchange)

    @property
    def peak_estimate(self) -> int:
        return (self.params + self.grads + self.optimizer + self.device_activations
                + self.layer_working_set)

    @property
    def fits(self) -> bool:
        return (self.peak_estimate <= self.capacity
                and self.host_activations <= self.host_capacity)


def per_device_residuals(residuals: list[Residual], param_shapes: set[tuple],
                         fsdp: int) -> list[Residual]:
    """Residuals of a per-device trace (batch already per device): the parameters themselves
    are dropped (counted as state), and casts of whole parameters are FSDP-sharded."""
    kept = []
    for r in residuals:
        if r.is_argument:
            continue
        if r.shape in param_shapes and r.shape[0] % fsdp == 0:
            r = dataclasses.replace(r, shape=(r.shape[0] // fsdp, *r.shape[1:]))
        kept.append(r)
    return kept


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """One device's memory in a compiled program, as XLA's `memory_analysis()` gives it."""
    arguments: int
    outputs: int
    aliased: int  # outputs written over donated arguments
    temporaries: int
    host: int  # temporaries in pinned host memory: the offloaded activations

    @classmethod
    def of(cls, compiled) -> "CompiledMemory":
        stats = compiled.memory_analysis()
        return cls(stats.argument_size_in_bytes, stats.output_size_in_bytes,
                   stats.alias_size_in_bytes, stats.temp_size_in_bytes,
                   stats.host_temp_size_in_bytes)

    @property
    def device(self) -> int:
        """What the program holds in device memory at once. (XLA's own peak figure counts the
        host buffers too.)"""
        return self.arguments + self.outputs - self.aliased + self.temporaries
