"""The training state in host memory. optimizer_state=host keeps the AdamW moments there;
parameters=host the layer scans' FP32 weights, and so their gradients, which autodiff sends
back where the weights came from (model/layers.scan_layers fetches a layer's weights to the
device inside the scan). Between steps they live in pinned host memory; the update passes
them through the device one layer at a time (`jax.device_put` to a memory space inside the
step; docs/host_offloading.md). Clipping needs the global norm first: every run sums it a
layer at a time (with the weights on host, as the backward pass makes each layer's gradient),
so that the placements agree to the bit; AdamW is elementwise, so a layer at a time is the
same arithmetic as the whole state at once (tests/test_host_state.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from model.layers import NORM_PROBE

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device
SCOPE = "optimizer_state"  # the named scope of the update's moves, apart from the activations'


def global_norm(grads: dict, scans, layer_squares: dict | None = None) -> jax.Array:
    """The gradients' global L2 norm (clipping's, and the reported grad_norm): the leaves
    outside the layer `scans` squared and summed whole, each scan's a layer at a time on the
    device: from `layer_squares` (scan -> [L], each layer's sum taken in the backward pass as
    its gradient was made: parameters=host), or read here."""
    def layer(_, grads):
        return None, sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))

    squares = [jnp.sum(jnp.square(g)) for k in grads if k not in scans
               for g in jax.tree.leaves(grads[k])]
    squares += [jnp.sum(layer_squares[k] if layer_squares else
                        jax.lax.scan(layer, None, grads[k])[1]) for k in grads if k in scans]
    return jnp.sqrt(sum(squares))


def with_norm_probes(params: dict, scans) -> dict:
    """`params` with a zero per layer in each layer scan (`NORM_PROBE`): its gradient is the
    sum of the squares of that layer's weight gradients, taken in the backward pass as they are
    made, before they leave for host memory (model/layers.to_device)."""
    return {k: {**v, NORM_PROBE: jnp.zeros(jax.tree.leaves(v)[0].shape[0], jnp.float32)}
            if k in scans else v for k, v in params.items()}


def norm_probes(grads: dict, scans) -> tuple[dict, dict | None]:
    """(the gradients without the probes, scan -> its layers' sums of squares), or (the
    gradients, None) where the step added no probes."""
    if not any(NORM_PROBE in grads[k] for k in scans):
        return grads, None
    return ({k: {n: g for n, g in v.items() if n != NORM_PROBE} if k in scans else v
             for k, v in grads.items()}, {k: grads[k][NORM_PROBE] for k in scans})


def clip(grads, norm: jax.Array, max_norm: float):
    """optax.clip_by_global_norm's arithmetic, given the norm: a tree whole or a layer of it."""
    return jax.tree.map(
        lambda g: jax.lax.select(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm), grads)


@jax.named_scope(SCOPE)
def update(grads, opt_state, params, norm, max_norm, adamw, scans, *, params_on_host: bool,
           moments_on_host: bool):
    """(params, opt_state) after clipping to `max_norm` and AdamW, for the state of
    `optax.chain(clip_by_global_norm, adamw)`: with nothing on host, at once; else the leaves
    outside the layer `scans` (embedding, final norm, LM head: on the device) at once, each
    scan's stacked leaves one layer at a time."""
    state = opt_state[1]
    if not (params_on_host or moments_on_host):
        updates, new = adamw.update(clip(grads, norm, max_norm), state, params)
        return optax.apply_updates(params, updates), (opt_state[0], new)
    rest = [k for k in params if k not in scans]
    updates, new = adamw.update(clip(_keys(grads, rest), norm, max_norm),
                                _move(_cut(state, rest, params), DEVICE), _keys(params, rest))
    new_params = optax.apply_updates(_keys(params, rest), updates)
    pieces = [_move(new, HOST) if moments_on_host else new]  # the first brings the step counts
    for scan in (k for k in params if k in scans):
        done, piece = _by_layer(adamw, _keys(grads, [scan]), _cut(state, [scan], params),
                                _keys(params, [scan]), lambda g: clip(g, norm, max_norm),
                                params_on_host, moments_on_host)
        new_params |= done
        pieces.append(piece)
    return new_params, (opt_state[0], _join(state, pieces, params))


def _by_layer(adamw, grads, state, params, clipped, params_on_host, moments_on_host):
    """One layer scan's update, a layer at a time, each stacked buffer read and written in
    place (the scan's carry): a layer's moments, and its weights where they lie in host
    memory, are read from their buffer, moved to the device, updated there and written back
    over the layer read, so that no second copy of the state is made in either memory (the
    step donates it). Device weights' updates are written over their gradients and added after
    the loop: no third copy of them on the device. The 0-d step counts are the same for every
    layer."""
    def at(tree, i):
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)

    def put(tree, i, layer):
        return jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, i, 0),
                            tree, layer)

    counts = jax.tree.map(lambda x: None if x.ndim else x, state)
    moments = jax.tree.map(lambda x: x if x.ndim else None, state)

    def layer(carry, _):
        i = carry["layer"]  # (counted in the carry: the study's addressing proof reads it)
        weights = _move(at(carry["params"] if params_on_host else params, i), DEVICE)
        layer_grads = _move(at(grads if params_on_host else carry["grads"], i), DEVICE)
        updates, new = adamw.update(clipped(layer_grads), _merge(counts, _move(
            at(carry["moments"], i), DEVICE)), weights)
        new = jax.tree.map(lambda x, c: x if c is None else None, new, counts)  # moments only
        carry["moments"] = put(carry["moments"], i, _move(new, HOST) if moments_on_host else new)
        if params_on_host:
            new_weights = _move(optax.apply_updates(weights, updates), HOST)
            carry["params"] = put(carry["params"], i, new_weights)
        else:
            carry["grads"] = put(carry["grads"], i, updates)
        return {**carry, "layer": i + 1}, None

    layers = jax.tree.leaves(params)[0].shape[0]
    carry = {"layer": jnp.zeros((), jnp.int32), "moments": moments,
             **({"params": params} if params_on_host else {"grads": grads})}
    carry, _ = jax.lax.scan(layer, carry, length=layers)
    new_params = (carry["params"] if params_on_host
                  else optax.apply_updates(params, carry["grads"]))
    return new_params, _merge(counts, carry["moments"])


def _merge(counts, moments):
    """The optimizer state of `moments` (None at the 0-d leaves) with the step `counts`."""
    return jax.tree.map(lambda c, m: m if c is None else c, counts, moments,
                        is_leaf=lambda x: x is None)


def _move(tree, space):
    """The tree's arrays moved to `space` (those there already as they are); 0-d leaves (the
    step counts) stay on the device."""
    return jax.tree.map(lambda x: jax.device_put(x, space)
                        if x.ndim and jax.typeof(x).memory_space != space else x, tree)


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


def in_host_memory(leaf) -> bool:
    """Whether a sharded ShapeDtypeStruct of the train state lies in pinned host memory."""
    return leaf.sharding.memory_kind == "pinned_host"


def host_need(state) -> int:
    """Per device, the host memory a train state (sharded ShapeDtypeStructs) takes during a
    step: what its shardings place in pinned host memory (updated in place) and the gradients
    of the weights there."""
    on_host = [x for x in jax.tree.leaves(state) if in_host_memory(x)]
    weights = [x for x in jax.tree.leaves(state["params"]) if in_host_memory(x)]
    return per_device_bytes(on_host) + per_device_bytes(weights)
