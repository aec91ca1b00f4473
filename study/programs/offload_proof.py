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

import re
from collections import Counter, defaultdict

from study.programs import addressing
from study.programs.addressing import Proof
from study.programs.jaxpr import Tagged, moves_in
from offload import optimizer_state
from runtime.own_program import DTYPE_NAMES, tagged_in

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
    the optimizer state's (optimizer_state=host), no more, no fewer. One trace serves both."""
    program = fn.trace(*args)
    traced = tagged_in(program.jaxpr.jaxpr, offloaded=True)
    tags = Counter((t.shape, str(t.dtype)) for sites in traced.values() for t in sites)
    state = moves_in(program.jaxpr.jaxpr, optimizer_state.SCOPE)
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
        match = next((p for p in left if _stacked(p) == stacked), None)
        if match is not None:
            left.remove(match)
            found[value.scan, value.tag] = match
    if stray := [p for p in left if _stacked(p) not in state]:
        shapes = Counter((p.buffer.shape.dims, p.buffer.shape.dtype) for p in stray)
        raise PlacementError(f"the compiled program keeps buffers in host memory that no "
                             f"offloaded tag accounts for: {dict(shapes)}")
    return found


def _stacked(proof: Proof) -> tuple[tuple[int, ...], str]:
    """(shape, dtype) of a proof's host buffer, the dtype named as numpy names it."""
    shape = proof.buffer.shape
    return shape.dims, DTYPE_NAMES.get(shape.dtype, shape.dtype)
