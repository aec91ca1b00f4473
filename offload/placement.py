"""Proof of placement: export a step for a GPU (`jax.export`, platform "cuda") from abstract
inputs and read where XLA is told to put each offloaded value.

On a CPU, JAX drops memory placements when it lowers, so an offload policy there is only a
numerical no-op. The program exported for "cuda" still carries them: one
`annotate_device_placement` custom call with `_xla_buffer_placement = "pinned_host"` per
offloaded value in the forward loop body, and one with "device" where the backward pass
brings it back. This works for the full-scale model on a laptop: nothing is allocated.
"""

import re
from collections import Counter

from jax import export

from offload.trace import offloaded_tags

_ANNOTATION = re.compile(r'annotate_device_placement.*_xla_buffer_placement = "(\w+)".*'
                         r':\s*\(tensor<([0-9x]*)x?(\w+)>\)')
_MLIR_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64"}


class PlacementError(AssertionError):
    """The exported program does not place values as the traced program says."""


def exported_annotations(fn, *args) -> dict[str, Counter]:
    """placement ("pinned_host" or "device") -> Counter of (shape, dtype) annotated so."""
    module = export.export(fn, platforms=["cuda"])(*args).mlir_module()
    found: dict[str, Counter] = {}
    for placement, dims, dtype in _ANNOTATION.findall(module):
        shape = tuple(int(d) for d in dims.split("x") if d)
        found.setdefault(placement, Counter())[shape, _MLIR_DTYPES.get(dtype, dtype)] += 1
    return found


def verify_offloads(fn, *args) -> set[tuple[str, str]]:
    """(layer scan, tag) of every value the exported GPU program offloads to pinned host
    memory and brings back.

    The traced program names the tag behind each move to host; the exported module must
    hold exactly those moves (same shapes and dtypes, each out and back), no more, no fewer.
    """
    traced = offloaded_tags(fn, *args)
    expected = Counter((t.shape, str(t.dtype)) for sites in traced.values() for t in sites)
    exported = exported_annotations(fn, *args)
    for placement in ("pinned_host", "device"):
        if exported.get(placement, Counter()) != expected:
            raise PlacementError(
                f"exported program has {placement} annotations {dict(exported.get(placement, {}))}"
                f" but the traced program offloads {dict(expected)}")
    return {(t.scan, t.tag) for sites in traced.values() for t in sites}
