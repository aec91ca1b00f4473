"""Read what a function tags, saves and offloads, from its jaxpr (nothing compiled or allocated).

Functions here take a function and (possibly abstract) arguments, never a model.
"""

import dataclasses
import re
from collections.abc import Iterator

import jax
import numpy as np
# saved_residuals is what the public jax.ad_checkpoint.print_saved_residuals prints from.
from jax._src import ad_checkpoint
from jax.extend import core as jex_core


@dataclasses.dataclass(frozen=True)
class Tagged:
    """One `checkpoint_name` site: its value's shape and dtype, and how often it runs."""
    tag: str
    shape: tuple[int, ...]
    dtype: np.dtype
    count: int  # the product of the enclosing scans' lengths: the layer count in a layer scan
    scan: str  # the named scope of the innermost enclosing scan ("" outside any scan)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def _sub_jaxprs(eqn) -> Iterator[jex_core.Jaxpr]:
    for param in eqn.params.values():
        for value in param if isinstance(param, (list, tuple)) else (param,):
            if isinstance(value, jex_core.ClosedJaxpr):
                yield value.jaxpr
            elif isinstance(value, jex_core.Jaxpr):
                yield value


def _scope(name_stack: str) -> str:
    """The innermost named scope, without autodiff's wrappers: "jvp(moe_layers)" -> "moe_layers"."""
    scope = name_stack.split("/")[-1]
    while (wrapped := re.fullmatch(r"\w+\((.*)\)", scope)) is not None:
        scope = wrapped.group(1)
    return scope


def _walk(jaxpr, count=1, scan="") -> Iterator[tuple[jex_core.JaxprEqn, int, str, dict]]:
    """Every equation with its run count, enclosing scan's scope, and the producers of its
    jaxpr's variables."""
    producers = {}
    for eqn in jaxpr.eqns:
        yield eqn, count, scan, producers
        producers.update({v: eqn for v in eqn.outvars})
        inner, inner_scan = count, scan
        if eqn.primitive.name == "scan":
            inner *= eqn.params["length"]
            inner_scan = _scope(str(eqn.source_info.name_stack))
        for sub in _sub_jaxprs(eqn):
            yield from _walk(sub, inner, inner_scan)


def tagged_values(fn, *args) -> dict[str, list[Tagged]]:
    """tag -> every `checkpoint_name` site with that tag, in trace order."""
    found: dict[str, list[Tagged]] = {}
    for eqn, count, scan, _ in _walk(jax.make_jaxpr(fn)(*args).jaxpr):
        if eqn.primitive.name == "name":
            aval, tag = eqn.invars[0].aval, eqn.params["name"]
            found.setdefault(tag, []).append(Tagged(tag, aval.shape, aval.dtype, count, scan))
    return found


def offloaded_tags(fn, *args) -> dict[str, list[Tagged]]:
    """tag -> the values moved to host memory straight from that tag, in the traced program.

    A checkpoint policy that offloads a name puts a `device_put` to host right after the
    name's equation; differentiate `fn` (e.g. a train step) to see them.
    """
    found: dict[str, list[Tagged]] = {}
    for eqn, count, scan, producers in _walk(jax.make_jaxpr(fn)(*args).jaxpr):
        if eqn.primitive.name != "device_put":
            continue
        if not any("host" in str(d).lower() for d in eqn.params["devices"]):
            continue
        source = producers.get(eqn.invars[0])
        if source is not None and source.primitive.name == "name":
            aval, tag = eqn.invars[0].aval, source.params["name"]
            found.setdefault(tag, []).append(Tagged(tag, aval.shape, aval.dtype, count, scan))
    return found


@dataclasses.dataclass(frozen=True)
class Residual:
    """A value autodiff keeps from the forward pass for the backward pass."""
    shape: tuple[int, ...]
    dtype: np.dtype
    on_host: bool
    source: str  # JAX's description: "from the argument ...", "output of scan from ...", ...

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

    @property
    def is_argument(self) -> bool:
        return self.source.startswith("from the argument")


def saved_residuals(fn, *args) -> list[Residual]:
    """What grad(fn) keeps between its forward and backward pass (inside a layer scan, stacked
    over the layers), and whether it waits in host memory."""
    return [Residual(aval.shape, aval.dtype, "host" in str(getattr(aval, "memory_space", "")
                                                            ).lower(), source)
            for aval, source in ad_checkpoint.saved_residuals(fn, *args)]
