"""Proof of placement, at two depths.

What JAX asks: lower a step for a GPU (platform "cuda", from any machine) from abstract inputs
and read where XLA is told to put each offloaded value (the "exported" program). On a CPU, JAX
drops memory placements when it lowers, so an offloaded tag there is only a numerical no-op; the
program lowered for "cuda" still carries them: one `annotate_device_placement` custom call with
`_xla_buffer_placement = "pinned_host"` per offloaded value in the forward loop body, and one
with "device" where the backward pass brings it back. Nothing is allocated.

What XLA does: in a program compiled for a GPU (a GPU run, or compile-only devices), each value
offloaded inside a layer scan becomes one buffer stacked over the layers, `bf16[L, ...]{...:S(5)}`
(memory space 5: pinned host), made by an `AllocateBuffer` custom call, written in the forward
loop and read in the backward loop. XLA's host-offload passes could still keep a device copy,
drop a move or address the buffer wrongly (study/programs/addressing.py): only the compiled
program shows it.
"""

import dataclasses
import math
import re
from collections import Counter, defaultdict

import numpy as np

from study.programs import addressing
from study.programs.addressing import UNVERIFIED, CannotVerify, HostBuffer, Proof
from study.programs.hlo import Shape
from study.programs.jaxpr import Tagged, moves_in
from model.layers import WEIGHTS_SCOPE
from offload import state as host_state
from runtime.own_program import DTYPE_NAMES, tagged_in

# The named scopes of the training state's moves (the update's, a layer's weights'): any other
# move to host memory no tag asked for is an error.
STATE_SCOPES = (host_state.SCOPE, WEIGHTS_SCOPE)
_ANNOTATION = re.compile(r'annotate_device_placement.*_xla_buffer_placement = "(\w+)".*'
                         r':\s*\(tensor<([0-9x]*)x?(\w+)>\)')


class PlacementError(AssertionError):
    """The exported program does not place values as the traced program says."""


def annotations(module: str) -> dict[str, Counter]:
    """placement -> Counter of (shape, dtype) so annotated, in a StableHLO module for a GPU."""
    found = defaultdict(Counter)
    for placement, dims, dtype in _ANNOTATION.findall(module):
        shape = tuple(int(d) for d in dims.split("x") if d)
        found[placement][shape, DTYPE_NAMES.get(dtype, dtype)] += 1
    return found


def verify_offloads(fn, *args) -> set[tuple[str, str]]:
    """(layer scan, tag) of every value the jitted `fn`, lowered for a GPU, offloads to pinned
    host memory and brings back. The traced program names the tag behind each move to host; the
    lowered module must hold exactly those moves (same shapes and dtypes, each out and back) and
    the training state's, in their named scopes (optimizer_state=host and parameters=host: the
    update's; parameters=host: each layer's weights and gradient), no more, no fewer. One trace
    serves both."""
    program = fn.trace(*args)
    traced = tagged_in(program.jaxpr.jaxpr, offloaded=True)
    tags = Counter((t.shape, str(t.dtype)) for sites in traced.values() for t in sites)
    state = sum((moves_in(program.jaxpr.jaxpr, scope) for scope in STATE_SCOPES), Counter())
    exported = annotations(program.lower(lowering_platforms=("cuda",)).as_text())
    for placement in ("pinned_host", "device"):
        expected = tags + Counter({(shape, dtype): n for (kind, shape, dtype), n
                                   in state.items() if kind == placement})
        if exported[placement] != expected:
            raise PlacementError(f"exported program has {placement} annotations "
                                 f"{dict(exported[placement])} but the traced program moves "
                                 f"{dict(expected)}")
    return {(t.scan, t.tag) for sites in traced.values() for t in sites}


def compiled_host_buffers(hlo: str, offloaded: list[Tagged],
                          state: set[tuple] = frozenset()) -> dict[tuple[str, str], Proof]:
    """(layer scan, tag) of every `offloaded` value (per device, per layer, as traced) whose stack
    over its layers, [count, *shape], the compiled program keeps in host memory, with the proof it
    reads that buffer back from where it wrote it (study/programs/addressing.py). Any other host
    buffer is an error (a move no table asked for), but for the optimizer state's stacked
    moments (`state`: per-device (shape, dtype), optimizer_state=host), which are not
    activations."""
    left = addressing.prove(hlo)
    found = {}
    for value in offloaded:
        stacked = ((value.count, *value.shape), str(value.dtype))
        match = next((p for p in left if _stacked(p.buffer) == stacked), None)
        if match is not None:
            left.remove(match)
            found[value.scan, value.tag] = match
    if stray := [p for p in left if _stacked(p.buffer) not in state]:
        shapes = Counter((p.buffer.shape.dims, p.buffer.shape.dtype) for p in stray)
        raise PlacementError(f"the compiled program keeps buffers in host memory that no "
                             f"offloaded tag accounts for: {dict(shapes)}")
    return found


def _stacked(buffer: HostBuffer) -> tuple[tuple[int, ...], str]:
    """(shape, dtype) of a host buffer, the dtype named as numpy names it."""
    shape = buffer.shape
    return shape.dims, DTYPE_NAMES.get(shape.dtype, shape.dtype)


@dataclasses.dataclass(frozen=True)
class LayerWeight:
    """parameters=host: one stacked weight of a layer scan, per device, with the proofs of the
    compiled program's host buffers of it and of its gradient (None: not in host memory)."""
    scan: str
    name: str
    shape: tuple[int, ...]  # per device, stacked over the scan's layers
    dtype: str
    weights: Proof | None
    gradient: Proof | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _walk(count: int, gradient: bool) -> tuple[list, str]:
    """The accesses a layer scan's stacked weights (or their gradient) must see, in order, as
    (write, layer), and in words. Weights: read by the forward pass layer 0 first, by the
    backward pass layer L-1 first; then read and written over by the update, layer 0 first. A
    gradient: written by the backward pass, layer L-1 first."""
    layers = list(range(count))
    if gradient:
        return ([(True, n) for n in layers[::-1]],
                f"the backward pass writes layer {count - 1} first")
    update = [access for n in layers for access in ((False, n), (True, n))]
    return ([(False, n) for n in layers + layers[::-1]] + update,
            f"the forward pass reads layer 0 first, the backward pass layer {count - 1} first, "
            "the update reads and writes each over, layer 0 first")


def compiled_layer_weights(hlo: str, stacked: dict[str, dict[str, tuple]]) -> list[LayerWeight]:
    """Each weight of `stacked` (layer scan -> weight -> per-device (shape, dtype), numpy's
    dtype names; the scans in forward order) with the host buffers of an optimized GPU program
    that hold it and its gradient. Op names do not say (XLA drops many), so the accesses do: a
    buffer the step reads three times a layer holds weights (the forward pass, its recompute,
    the update), one it writes a layer at a time and then reads a gradient (written by the
    backward pass, read by the update). The weights are matched in the order the forward pass
    reads them, the gradients in the order the backward pass writes them (the last scan
    first); weights of one shape are told apart by nothing else (any match proves the same).
    Proved (study/programs/addressing.py), each from the bytes the program means: the walks
    of `_walk`, and every later access a read."""
    try:
        accesses = addressing.accesses(hlo)
    except CannotVerify as e:
        return [LayerWeight(scan, name, shape, dtype, *[Proof(
                    HostBuffer("", Shape(dtype, shape)), UNVERIFIED, str(e))] * 2)
                for scan, weights in stacked.items() for name, (shape, dtype) in weights.items()]
    by_buffer = defaultdict(list)  # (in the order of their first accesses)
    for access in accesses:
        by_buffer[access.buffer].append(access)
    found = defaultdict(list)  # (gradient?, shape, dtype) -> buffers
    for buffer, done in by_buffer.items():
        layers, writes = buffer.shape.dims[0], [a.write for a in done]
        if writes.count(False) == 3 * layers:  # weights: forward, recompute, update
            found[(False, *_stacked(buffer))].append(buffer)
        elif writes == [True] * layers + [False] * layers:  # a gradient: made, then read
            found[(True, *_stacked(buffer))].append(buffer)
    proofs = {}
    for gradient, scans in ((False, list(stacked)), (True, list(stacked)[::-1])):
        for scan in scans:
            for name, (shape, dtype) in stacked[scan].items():
                buffers = found[gradient, shape, dtype]
                buffer = buffers.pop(0) if buffers else None
                proofs[scan, name, gradient] = (addressing.prove_walk(
                    buffer, by_buffer[buffer], *_walk(shape[0], gradient)) if buffer else None)
    return [LayerWeight(scan, name, shape, dtype, proofs[scan, name, False],
                        proofs[scan, name, True])
            for scan, weights in stacked.items() for name, (shape, dtype) in weights.items()]
