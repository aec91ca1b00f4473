"""Parameters before they exist: a spec per tensor (shape, logical axes, initialisation),
stacked over layers; their count, abstract values and shardings without allocating anything,
and their initialisation, each created already sharded."""

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp

from model.sharding import AxisRules

@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    std: float | None = None  # normal(0, std), zeros for 0; None means ones (norm weights)


def stack(spec: ParamSpec, n: int) -> ParamSpec:
    return ParamSpec((n, *spec.shape), ("layers", *spec.axes), spec.std)


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_count(specs) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=_is_spec))


def abstract_params(specs, dtype=jnp.float32):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=_is_spec)


def param_shardings(specs, rules: AxisRules):
    return jax.tree.map(lambda s: rules.sharding(s.axes), specs, is_leaf=_is_spec)


def indivisible(specs, rules: AxisRules) -> str | None:
    """The first weight an axis of which its mesh axes do not divide (JAX refuses to shard it
    so), in words; None where every one divides."""
    sizes = dict(rules.mesh.shape)
    for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=_is_spec):
        for size, logical, axes in zip(spec.shape, spec.axes, rules.spec(spec.axes)):
            axes = (axes,) if isinstance(axes, str) else axes or ()
            if size % (devices := math.prod(sizes[a] for a in axes)):
                name = jax.tree_util.keystr(path, simple=True, separator="/")
                return (f"{name}: its {logical} axis of {size} does not divide over "
                        f"{' x '.join(axes)} = {devices} devices")
    return None


def init_params(specs, rules: AxisRules, key: jax.Array, dtype=jnp.float32):
    """Random parameters, each created already sharded: no full tensor on one device."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)

    @partial(jax.jit, out_shardings=[rules.sharding(s.axes) for s in leaves])
    def make(key):
        keys = jax.random.split(key, len(leaves))
        return [jnp.ones(s.shape, dtype) if s.std is None
                else s.std * jax.random.normal(k, s.shape, dtype) for s, k in zip(leaves, keys)]

    return jax.tree.unflatten(treedef, make(key))
