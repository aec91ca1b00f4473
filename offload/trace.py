"""Read the tagged intermediates of a function from its jaxpr (no compilation, no allocation)."""

import jax
from jax.extend import core as jex_core


def _sub_jaxprs(eqn):
    for param in eqn.params.values():
        for value in param if isinstance(param, (list, tuple)) else (param,):
            if isinstance(value, jex_core.ClosedJaxpr):
                yield value.jaxpr
            elif isinstance(value, jex_core.Jaxpr):
                yield value


def tagged_values(fn, *args) -> dict[str, list[jax.ShapeDtypeStruct]]:
    """tag -> the abstract value of every `checkpoint_name` site with that tag, in trace order.

    Inside a scanned layer the shapes are per layer. `args` may be ShapeDtypeStructs.
    """
    found: dict[str, list[jax.ShapeDtypeStruct]] = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                aval = eqn.invars[0].aval
                found.setdefault(eqn.params["name"], []).append(
                    jax.ShapeDtypeStruct(aval.shape, aval.dtype))
            for sub in _sub_jaxprs(eqn):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found
