"""Routed experts on one device's tokens: every expert densely, sorted grouped GEMMs, tiles
of sorted pairs, or split over the devices of one mesh axis (expert parallelism) with a
fixed-size block per expert, exchanged by all-to-alls inside that axis. Letters: docs/model.md
(S a device's tokens, P devices, C rows per block, l a device's own experts, g a tile, r rows)."""

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.ad_checkpoint import checkpoint_name


def _swiglu(rows, w, project_in, project_out):
    gate = checkpoint_name(project_in(rows, w["we_gate"]), "moe_mlpwi_0")
    up = checkpoint_name(project_in(rows, w["we_up"]), "moe_mlpwi_1")
    return checkpoint_name(project_out(jax.nn.silu(gate) * up, w["we_down"]), "moe_mlpwo")


def experts_dense(x, weights, experts, w, n_experts: int):
    """Every expert on every token, each output weighted by its routing weight (0 when not
    chosen): exact, at E/k times the routed work; the simplest reference. x [S, D]."""
    combine = jnp.einsum("ske,sk->se", jax.nn.one_hot(experts, n_experts, dtype=weights.dtype),
                         weights)
    out = _swiglu(x, w, partial(jnp.einsum, "sd,edf->sef"), partial(jnp.einsum, "sef,efd->sed"))
    return jnp.einsum("sed,se->sd", out.astype(jnp.float32), combine).astype(x.dtype)


def experts_sorted(x, weights, experts, w, n_experts: int):
    """Dropless grouped GEMMs: the S*k (token, expert) pairs sorted by expert, one
    `ragged_dot` per projection, outputs weighted and summed back per token. x [S, D]."""
    k = experts.shape[1]
    order = jnp.argsort(experts.reshape(-1))
    tokens = order // k
    sizes = jnp.bincount(experts.reshape(-1), length=n_experts).astype(jnp.int32)
    grouped = partial(jax.lax.ragged_dot, group_sizes=sizes)
    out = _swiglu(x[tokens], w, grouped, grouped)
    out = (out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]).astype(x.dtype)
    return jnp.zeros_like(x).at[tokens].add(out)


TILE = 64  # rows; docs/runs.md: the DeepSeek proxy's CPU step at 32, 64 and 128


def _by_expert(experts, n_experts: int):
    """The (token, expert) pairs (token * k + choice) by expert, in token order within one (a
    stable sort): (their order, their experts, each expert's count, each one's position in
    its expert's)."""
    pairs = experts.reshape(-1)
    order = jnp.argsort(pairs, stable=True).astype(jnp.int32)
    chosen = pairs[order]
    count = jnp.bincount(pairs, length=n_experts)
    return order, chosen, count, jnp.arange(pairs.size) - (jnp.cumsum(count) - count)[chosen]


def experts_tiled(x, weights, experts, w, n_experts: int, tile: int = TILE):
    """Dropless batched GEMMs: the S*k (token, expert) pairs sorted by expert, each expert's
    padded to whole tiles of `tile` rows, each tile one GEMM with its expert's weights
    (gathered per tile), outputs weighted and summed back per token. About k/E of `dense`'s
    work plus the padding: on a CPU faster than `dense` and than `ragged_dot`. x [S, D]."""
    S, k = experts.shape
    order, chosen, count, position = _by_expert(experts, n_experts)
    padded = -(-count // tile) * tile
    ends = jnp.cumsum(padded)  # each expert's tiles end here, its pairs first, then padding
    row = (ends - padded)[chosen] + position
    n_tiles = (S * k + n_experts * (tile - 1)) // tile  # the most tiles any routing takes
    token = jnp.full((n_tiles * tile,), S, jnp.int32).at[row].set(order // k)
    weight = jnp.zeros((n_tiles * tile,), weights.dtype).at[row].set(weights.reshape(-1)[order])
    # A tile's expert: how many experts' tiles end at or before it starts (a comparison, not
    # searchsorted's loop, which a CPU program would not unroll); past the last: padding.
    starts = jnp.arange(n_tiles)[:, None] * tile
    tile_expert = jnp.minimum((ends[None, :] <= starts).sum(axis=1), n_experts - 1)

    def project(subscripts, rows, m):
        return jnp.einsum(subscripts, rows, m[tile_expert])

    rows = rearrange(_rows(x, token), "(g r) d -> g r d", r=tile)  # token S: padding, zeros
    out = _swiglu(rows, w, partial(project, "grd,gdf->grf"), partial(project, "grf,gfd->grd"))
    out = rearrange(out, "g r d -> (g r) d").astype(jnp.float32) * weight[:, None]
    return jnp.zeros((S + 1, x.shape[1]), jnp.float32).at[token].add(out)[:S].astype(x.dtype)


EXPERT_PATHS = {"dense": experts_dense, "sorted": experts_sorted, "tiled": experts_tiled}


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Routed experts split over `devices` devices, E/devices each. Every device sends its
    (token, expert) pairs, a fixed-size block per expert, to the devices holding those experts
    and gets the outputs back (two all-to-alls); each expert is one dense GEMM over its blocks.
    `capacity` sizes a block as a multiple of the balanced share
    S*k/E of a device's S tokens; 0 sizes it for the worst case, S rows (every token choosing
    that expert): dropless whatever the routing, at E/k times the memory."""
    devices: int
    capacity: float = 0.0

    def describe(self) -> str:
        room = (f"blocks {self.capacity:g}x the balanced share" if self.capacity
                else "blocks sized for the worst case: dropless")
        if self.devices == 1:
            return f"experts in blocks on each device, no expert axis ({room}; one GEMM per expert)"
        return (f"experts split over the {self.devices} devices of each expert group ({room}; "
                "one GEMM per expert)")

    def block_rows(self, tokens: int, k: int, n_experts: int) -> int:
        """Rows of one expert's block from one device."""
        share = self.capacity * tokens * k / n_experts
        return tokens if not self.capacity or share >= tokens else math.ceil(share)


def _rows(table, index):
    """table[index] along the first axis; an index past the end reads a row of zeros."""
    return jnp.take(table, index, axis=0, mode="fill", fill_value=0)


# Dispatch (token rows into expert blocks) and combine (weighted expert outputs back into
# tokens) are each other's transposes. Written as gathers both ways: autodiff would transpose
# a gather into a scatter-add, which XLA's GPU backend runs on 32-bit atomics (a u32 copy of
# every bf16 block) instead of reading each row once.
@jax.custom_vjp
def _dispatch(x, slot_pairs, pair_slots):
    """x [S, D] -> blocks [slots, D]: slot i holds the token of pair slot_pairs[i] (pairs are
    token * k + choice; past the end: an empty slot, zeros)."""
    return _rows(x, slot_pairs // pair_slots.shape[1])


def _dispatch_fwd(x, *indices):
    return _dispatch(x, *indices), indices


def _dispatch_bwd(residuals, grad):
    _, pair_slots = residuals  # dx[s] = sum over s's pairs of their slots' gradients
    dx = _rows(grad, pair_slots).astype(jnp.float32).sum(axis=1).astype(grad.dtype)
    return dx, None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _combine(blocks, weights, slot_pairs, pair_slots):
    """Expert outputs [slots, D] -> tokens [S, D]: sum_j weights[s, j] x the row of pair
    (s, j)'s slot (pair_slots; past the end: dropped, zeros), accumulated in f32."""
    rows = _rows(blocks, pair_slots).astype(jnp.float32)
    return (rows * weights[..., None]).sum(axis=1).astype(blocks.dtype)


def _combine_fwd(*args):
    return _combine(*args), args


def _combine_bwd(residuals, grad):
    blocks, weights, slot_pairs, pair_slots = residuals
    k = pair_slots.shape[1]
    slot_weights = _rows(weights.reshape(-1), slot_pairs)
    d_blocks = _rows(grad, slot_pairs // k).astype(jnp.float32) * slot_weights[:, None]
    d_weights = jnp.einsum("skd,sd->sk", _rows(blocks, pair_slots).astype(jnp.float32),
                           grad.astype(jnp.float32))
    return d_blocks.astype(blocks.dtype), d_weights, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def experts_exchanged(x, weights, experts, w, n_experts: int, parallel: ExpertParallel,
                      axis: str | None):
    """Expert parallelism on one device: x [S, D] its tokens, w its E/P experts. Returns the
    routed output [S, D] and, per expert [E], how many of this device's (token, expert) pairs
    found their block full (dropped). Without `axis` (one device's share traced alone, as the
    memory plan does) the exchange is the identity: the same shapes, no communication."""
    P, local = parallel.devices, n_experts // parallel.devices
    S, k = experts.shape
    C = parallel.block_rows(S, k, n_experts)
    # A full block drops its expert's last tokens' pairs. Slot e * C + position holds expert
    # e's pair at that position.
    order, chosen, _, position = _by_expert(experts, n_experts)
    kept = position < C
    slot = jnp.where(kept, chosen * C + position, n_experts * C).astype(jnp.int32)
    slot_pairs = jnp.full((n_experts * C,), S * k, jnp.int32).at[slot].set(order, mode="drop")
    pair_slots = jnp.zeros((S * k,), jnp.int32).at[order].set(slot).reshape(S, k)
    exchange = (lambda t: t) if axis is None else partial(
        jax.lax.all_to_all, axis_name=axis, split_axis=0, concat_axis=0)
    send = _dispatch(x, slot_pairs, pair_slots)
    received = exchange(rearrange(send, "(p lc) d -> p lc d", p=P))
    rows = rearrange(received, "p (l c) d -> l (p c) d", l=local)  # per local expert
    out = _swiglu(rows, w, partial(jnp.einsum, "lrd,ldf->lrf"), partial(jnp.einsum, "lrf,lfd->lrd"))
    back = exchange(rearrange(out, "l (p c) d -> p (l c) d", p=P))
    dropped = jnp.zeros((n_experts,), jnp.int32).at[chosen].add((~kept).astype(jnp.int32))
    return (_combine(rearrange(back, "p lc d -> (p lc) d"), weights, slot_pairs, pair_slots),
            dropped)
