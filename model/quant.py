"""NVFP4: E2M1 codes, one E4M3 scale per 16 elements, one FP32 scale per tensor (model/fp4.py
multiplies a layer's matrices in it).

The encoding is Transformer Engine's quantize kernel (`core_nvfp4.cuh`), in FP32:
  S_enc = 2688 / amax (448 * 6: the largest E4M3 scale times the largest E2M1 code),
  block scale = e4m3(min(block_amax * (S_enc * (1/6)), 448)), rounded to nearest even,
  code = e2m1(clip(x * min(1 / (block scale * S_dec), FLT_MAX), -6, 6)), S_dec = 1 / S_enc,
so x ~ code * block scale * S_dec. Blocks run along the contraction axis (`axis`), because a
block-scaled GEMM multiplies 16-element slices of K. TE's weight recipe takes one scale per 16x16
tile (`two_d`), so that W and W^T quantize alike. Rules and sources: docs/model.md."""

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = float(np.finfo(np.float32).max)


class QuantError(ValueError):
    """A weight NVFP4 cannot encode (a dimension that is not a multiple of 16)."""


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How a model's layer matrices are multiplied in NVFP4 (model/fp4.py). `backward` "fp4":
    all three GEMMs in NVFP4 (Transformer Engine's recipe; needs `two_d`, 16x16 weight
    tiles); "bf16": the forward only, the backward in the compute dtype. `path` "scaled":
    Blackwell's block-scaled GEMM (cuDNN); "dequantize": codes times scales, then an ordinary
    GEMM in the compute dtype (any backend, the same values)."""
    path: str = "dequantize"
    two_d: bool = True
    backward: str = "fp4"

    def describe(self) -> str:
        """What a step does with its layer matrices, for its header and plan."""
        gemms = "every GEMM" if self.backward == "fp4" else "the forward GEMMs (backward in bf16)"
        if self.path == "scaled":
            return f"NVFP4: {gemms} of the layer matrices on FP4 tensor cores"
        tiles = "16x16 tiles" if self.two_d else "1x16 blocks"
        return (f"NVFP4 values ({tiles}) for {gemms} of the layer matrices, multiplied in the "
                "compute dtype: the same numbers, no FP4 speed-up")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Weight:
    """A layer weight in the compute dtype, marked to be multiplied in NVFP4; `key`: the
    random bits of its gradients' stochastic rounding and `gathered`, the sharding its codes
    are gathered to (backward "fp4")."""
    value: jax.Array
    key: jax.Array | None
    quantization: Quantization = dataclasses.field(metadata={"static": True})
    gathered: object = dataclasses.field(default=None, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """A quantized weight; `dequantize` gives it back. `block_scales` has the weight's shape
    with `axis` divided by 16: one scale per 16-element block, also with 16x16 tiles, where the
    16 rows of a tile repeat its scale. That is the per-row layout a block-scaled GEMM reads,
    and dequantize needs no case for tiles."""
    codes: jax.Array  # float4_e2m1fn (or its values in a float dtype), the weight's shape
    block_scales: jax.Array  # float8_e4m3fn
    tensor_scale: jax.Array  # f32 scalar, S_dec ~ amax / 2688
    axis: int = dataclasses.field(metadata={"static": True})


def _tile_axis(ndim: int, axis: int) -> int:
    """The second axis of a 16x16 tile: the last axis that is not `axis`."""
    return ndim - 1 if axis != ndim - 1 else ndim - 2


def _checked_axis(shape: tuple[int, ...], axis: int, two_d: bool) -> int:
    """`axis` made non-negative, after checking that the blocks (or tiles) divide the shape."""
    if two_d and len(shape) < 2:
        raise QuantError(f"16x16 NVFP4 tiles need a 2-D or larger weight, got shape {shape}")
    axis = range(len(shape))[axis]
    for a in (axis, _tile_axis(len(shape), axis)) if two_d else (axis,):
        if shape[a] % BLOCK:
            raise QuantError(f"NVFP4 needs axis {a} of shape {shape} to be a multiple of {BLOCK}")
    return axis


def split_blocks(x: jax.Array, axis: int) -> jax.Array:
    """Split `axis` into (blocks, 16): the block's elements are then on axis + 1."""
    return x.reshape(x.shape[:axis] + (x.shape[axis] // BLOCK, BLOCK) + x.shape[axis + 1:])


def _block_amax(x: jax.Array, axis: int, two_d: bool) -> jax.Array:
    """Max |x| per 16-element block along `axis`; with `two_d`, per 16x16 tile, repeated."""
    amax = jnp.max(jnp.abs(split_blocks(x, axis)), axis=axis + 1)
    if not two_d:
        return amax
    rows = split_blocks(amax, _tile_axis(x.ndim, axis))
    tiles = jnp.max(rows, axis=_tile_axis(x.ndim, axis) + 1, keepdims=True)
    return jnp.broadcast_to(tiles, rows.shape).reshape(amax.shape)


def _e2m1_step(magnitude: jax.Array) -> jax.Array:
    """The spacing of E2M1 values around `magnitude`: 0.5 up to 2, 1 up to 4, 2 up to 6."""
    return jnp.where(magnitude < 2, 0.5, jnp.where(magnitude < 4, 1.0, 2.0))


def round_nearest(v: jax.Array) -> jax.Array:
    """v (f32, within [-6, 6]) onto the E2M1 grid, to nearest, ties to even (as a cast to
    E2M1 rounds), in f32 arithmetic: exact, as step is a power of two."""
    magnitude = jnp.abs(v)
    step = _e2m1_step(magnitude)
    return jnp.copysign(jnp.round(magnitude / step) * step, v)


def round_stochastic(v: jax.Array, bits: jax.Array) -> jax.Array:
    """v (f32, within [-6, 6]) onto the E2M1 grid, unbiased: between its neighbours
    lo <= |v| <= hi, away from zero with probability (|v| - lo) / (hi - lo), drawn from the top
    24 of the uint32 `bits` (PTX's cvt.rs distribution, not its use of the bits)."""
    magnitude = jnp.abs(v)
    step = _e2m1_step(magnitude)
    low = jnp.floor(magnitude / step) * step
    uniform = (bits >> 8).astype(jnp.float32) * 2.0**-24
    return jnp.copysign(jnp.where(uniform < (magnitude - low) / step, low + step, low), v)


def quantize(w: jax.Array, axis: int, two_d: bool = False, bits: jax.Array | None = None,
             codes_dtype=jnp.float4_e2m1fn) -> NVFP4Tensor:
    """NVFP4 encoding of `w` (any float dtype, computed in f32), 16-blocks along `axis`;
    codes rounded to nearest even, or stochastically with `bits` (uint32, w's shape), held
    as E2M1 or, for a GEMM of dequantized values, in `codes_dtype` (the same values: every
    E2M1 value is exact in bf16; a CPU converts to and from E2M1 in software)."""
    axis = _checked_axis(w.shape, axis, two_d)
    x = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x))
    # S_enc = 2688 / amax, at most FLT_MAX; 1 when amax is 0, inf or NaN.
    s_enc = jnp.minimum(E4M3_MAX * E2M1_MAX / amax, FLT_MAX)
    s_enc = jnp.where((amax == 0) | (s_enc == 0) | jnp.isnan(s_enc), 1.0, s_enc)
    s_dec = 1 / s_enc
    scale = _block_amax(x, axis, two_d) * (s_enc * (1 / E2M1_MAX))
    # E4M3 has no inf: anything above 464 would cast to NaN.
    scales = jnp.minimum(scale, E4M3_MAX).astype(jnp.float8_e4m3fn)
    # Codes use the rounded scale. Without the barrier XLA may drop the f32->f8->f32 round
    # trip (xla_allow_excess_precision) and encode with the unrounded one.
    rounded = jax.lax.optimization_barrier(scales).astype(jnp.float32)
    # A zero block has scale 0: 1/0 = inf would give 0 * inf = NaN, FLT_MAX gives 0.
    encode = jnp.minimum(1 / (rounded * s_dec), FLT_MAX)
    codes = jnp.clip(split_blocks(x, axis) * jnp.expand_dims(encode, axis + 1), -E2M1_MAX, E2M1_MAX)
    codes = codes.reshape(w.shape)
    if bits is not None:
        codes = round_stochastic(codes, bits)
    elif codes_dtype != jnp.float4_e2m1fn:
        codes = round_nearest(codes)  # what the cast to E2M1 does, which a CPU does slowly
    # (Cast straight from the scaled values, XLA's SPMD partitioner gathers the E2M1 codes of
    # a sharded weight; from round_nearest's f32 values it gathers those.)
    return NVFP4Tensor(codes.astype(codes_dtype), scales, s_dec, axis)


def dequantize(q: NVFP4Tensor, dtype=jnp.float32) -> jax.Array:
    codes = split_blocks(q.codes.astype(jnp.float32), q.axis)
    scales = jnp.expand_dims(q.block_scales.astype(jnp.float32), q.axis + 1)
    return (codes * scales * q.tensor_scale).reshape(q.codes.shape).astype(dtype)


def nvfp4_bytes(shape: tuple[int, ...], axis: int, two_d: bool = False) -> int:
    """Bytes of `quantize`'s arrays as XLA stores them: E2M1 packed two per byte (which
    `Array.nbytes` reports as one byte each), one byte per block scale, 4 for the tensor scale."""
    q = jax.eval_shape(partial(quantize, axis=axis, two_d=two_d),
                       jax.ShapeDtypeStruct(tuple(shape), jnp.float32))
    return sum(math.prod(a.shape) * jax.dtypes.itemsize_bits(a.dtype) // 8
               for a in jax.tree.leaves(q))


def quantizable(name: str, ndim: int, unquantized=()) -> bool:
    """Whether a layer weight (one layer's) is multiplied in NVFP4: a matrix not `unquantized`."""
    return ndim >= 2 and name not in unquantized


def layer_weights(w: dict, dtype, quantization: Quantization | None, unquantized=(),
                  key: jax.Array | None = None, rules=None):
    """A layer's weights in the compute dtype, its `quantizable` matrices marked for NVFP4 under
    `quantization`, each with its own share of the layer's `key` (an FP4 backward's rounding
    bits) and, given `rules`, gathered whole (replicated) as FP4 codes."""
    gathered = None if rules is None else rules.sharding(())

    def prepare(index: int, name: str, a: jax.Array):
        a = a.astype(dtype)
        if quantization is None or not quantizable(name, a.ndim, unquantized):
            return a
        return NVFP4Weight(a, None if key is None else jax.random.fold_in(key, index),
                                 quantization, gathered)
    return {name: prepare(i, name, a) for i, (name, a) in enumerate(sorted(w.items()))}


def layer_keys(key: jax.Array | None, quantization: Quantization | None, layers: int):
    """One key per layer of a scan for an FP4 backward's stochastic rounding (None without
    NVFP4); a forward given no key (evaluation, tracing) uses key 0."""
    if quantization is None:
        return None
    return jax.random.split(jax.random.key(0) if key is None else key, layers)
