"""optimizer_state=host: the AdamW moments live in pinned host memory between steps and pass
through the device one layer at a time for the update (`jax.device_put` to a memory space
inside the step; docs/optimizer_state.md). Clipping needs the global gradient norm, so it runs
first on the whole gradient; AdamW is elementwise, so updating layer by layer is the same
arithmetic, to the bit (tests/test_host_state.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device
SCOPE = "optimizer_state"  # the named scope of its moves, apart from the activations' tags


@jax.named_scope(SCOPE)
def host_update(grads, opt_state, params, clip, adamw, scans):
    """(params, opt_state) updated, for the state of `optax.chain(clip, adamw)` kept on host:
    the leaves outside the layer `scans` (embedding, final norm, LM head) at once, each scan's
    stacked leaves one layer at a time."""
    # Clipped as a whole (it needs the global norm); XLA writes it over the gradients.
    grads, _ = clip.update(grads, opt_state[0])
    state = opt_state[1]  # its moments in host memory (the state's shardings say so)
    rest = [k for k in params if k not in scans]
    updates, new = adamw.update(_keys(grads, rest),
                                _move(_cut(state, rest, params), DEVICE), _keys(params, rest))
    new_params = optax.apply_updates(_keys(params, rest), updates)
    pieces = [_move(new, HOST)]  # the first piece brings the new step counts
    for scan in (k for k in params if k in scans):
        done, piece = _by_layer(adamw, _keys(grads, [scan]),
                                _cut(state, [scan], params), _keys(params, [scan]))
        new_params |= done
        pieces.append(piece)
    return new_params, (opt_state[0], _join(state, pieces, params))


def _by_layer(adamw, grads, state, params):
    """One layer scan's update, a layer at a time: its moments read from host, updated on the
    device, written to a new host buffer (so a step holds the state twice in host memory). Each
    layer's update is written over its gradient, and added to the weights after the loop: no
    third copy of the weights on the device. The 0-d step counts are the same for every layer."""
    def at(tree, i):  # grads and params: every leaf of a layer scan is stacked
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)

    def layer(grads, xs):
        i, moments = xs
        layer_state = jax.tree.map(lambda x, m: m if x.ndim else x, state, moments)
        updates, new = adamw.update(at(grads, i), _move(layer_state, DEVICE), at(params, i))
        grads = jax.tree.map(lambda g, u: jax.lax.dynamic_update_index_in_dim(g, u, i, 0),
                             grads, updates)
        return grads, jax.tree.map(lambda x, m: m if x.ndim else None, state, _move(new, HOST))

    layers = jax.tree.leaves(params)[0].shape[0]
    moments = jax.tree.map(lambda x: x if x.ndim else None, state)
    updates, new = jax.lax.scan(layer, grads, (jnp.arange(layers), moments))
    return (optax.apply_updates(params, updates),
            jax.tree.map(lambda x, m: m if x.ndim else x, state, new))


def _move(tree, space):
    """The moments moved to `space`; 0-d leaves (the step counts) stay on the device."""
    return jax.tree.map(lambda x: jax.device_put(x, space) if x.ndim else x, tree)


def _keys(tree: dict, keys) -> dict:
    return {k: tree[k] for k in keys}


def _is_copy(params):
    """Whether a node of the optimizer state is a copy of the parameter tree (a moment)."""
    return lambda node: isinstance(node, dict) and node.keys() == params.keys()


def _cut(state, keys, params):
    """`state` with every copy of the parameter tree in it cut to its entries `keys`."""
    return jax.tree.map(lambda node: _keys(node, keys) if _is_copy(params)(node) else node,
                        state, is_leaf=_is_copy(params))


def _join(state, pieces, params):
    """The inverse of `_cut`: the moments of every piece in one tree; the other leaves (step
    counts) from the first piece."""
    return jax.tree.map(
        lambda node, *cut: ({k: v for piece in cut for k, v in piece.items()}
                            if _is_copy(params)(node) else cut[0]),
        state, *pieces, is_leaf=_is_copy(params))


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (or arrays)."""
    return sum(int(np.prod(leaf.sharding.shard_shape(leaf.shape) if leaf.sharding else leaf.shape))
               * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def moment_bytes(opt_state) -> int:
    """Per device, the optimizer state's moments (its leaves but the 0-d step counts): what
    optimizer_state=host keeps in host memory."""
    return per_device_bytes([x for x in jax.tree.leaves(opt_state) if x.ndim])
