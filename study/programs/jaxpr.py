"""Read what a function tags, saves and offloads, from its jaxpr (nothing compiled or allocated):
functions here take a function and (possibly abstract) arguments, never a model."""

import dataclasses
from collections import Counter

import jax
import numpy as np
# saved_residuals is what the public jax.ad_checkpoint.print_saved_residuals prints from.
from jax._src import ad_checkpoint

from runtime.own_program import Tagged, dot_flops, scope, sub_jaxprs, tagged_in


def tagged_values(fn, *args) -> dict[str, list[Tagged]]:
    """tag -> every `checkpoint_name` site with that tag, in trace order."""
    return tagged_in(jax.make_jaxpr(fn)(*args).jaxpr)


def moves_in(jaxpr, named: str, inside: bool = False) -> Counter:
    """(memory kind "pinned_host" or "device", shape, dtype) of every value a `device_put` inside
    named scope `named` moves. A sub-jaxpr's name stack starts afresh: it inherits being inside."""
    found = Counter()
    for eqn in jaxpr.eqns:
        here = inside or named in str(eqn.source_info.name_stack)
        if here and eqn.primitive.name == "device_put":
            for var, where in zip(eqn.invars, eqn.params["devices"]):
                kind = "pinned_host" if "host" in str(where).lower() else "device"
                found[kind, var.aval.shape, str(var.aval.dtype)] += 1
        for sub in sub_jaxprs(eqn):
            found += moves_in(sub, named, here)
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
        return int(np.prod(self.shape)) * self.dtype.itemsize  # also a PRNG key's

    @property
    def is_argument(self) -> bool:
        return self.source.startswith("from the argument")


def saved_residuals(fn, *args) -> list[Residual]:
    """What grad(fn) keeps for the backward pass (stacked over scan layers), and whether on host."""
    return [Residual(aval.shape, aval.dtype,
                     "host" in str(getattr(aval, "memory_space", "")).lower(), source)
            for aval, source in ad_checkpoint.saved_residuals(fn, *args)]


@dataclasses.dataclass(frozen=True)
class Work:
    """One device's work in a traced step (a gradient), per (scan, pass), and where its tags sit."""
    flops: dict  # (scan, "forward" | "backward") -> FLOPs; scan "" outside any layer scan
    exchanged: dict  # (scan, pass) -> bytes sent by all-to-alls
    positions: dict  # (scan, tag) -> share of one layer's forward dot FLOPs before the tag


def work(fn, *args, devices: int) -> Work:
    """Dot FLOPs and all-to-all bytes of `fn` (e.g. a gradient) traced on sharded abstract
    `args`, per device: a global shape's work is spread over the `devices`, a shard_map body's
    is one device's already. Autodiff names a layer scan's backward "transpose(jvp(scan))"."""
    flops, exchanged, layer_flops, positions = Counter(), Counter(), Counter(), {}

    def visit(jaxpr, count, scan, backward, share):
        key = (scan, "backward" if backward else "forward")
        for eqn in jaxpr.eqns:
            primitive = eqn.primitive.name
            done = dot_flops(eqn)
            flops[key] += count * share * done
            if scan and not backward:
                layer_flops[scan] += share * done
                if primitive == "name":
                    positions.setdefault((scan, eqn.params["name"]), layer_flops[scan])
            if primitive == "all_to_all":
                sent = eqn.invars[0].aval.size * eqn.invars[0].aval.dtype.itemsize
                exchanged[key] += count * share * sent
            inner = (count, scan, backward, 1.0 if primitive == "shard_map" else share)
            if primitive == "scan":
                stack = str(eqn.source_info.name_stack).split("/")[-1]
                inner = (count * eqn.params["length"], scope(stack) or scan,
                         backward or stack.startswith("transpose("), share)
            for sub in sub_jaxprs(eqn):
                visit(sub, *inner)

    visit(jax.make_jaxpr(fn)(*args).jaxpr, 1, "", False, 1.0 / devices)
    return Work(dict(flops), dict(exchanged),
                {k: v / layer_flops[k[0]] if layer_flops[k[0]] else 0.0
                 for k, v in positions.items()})
