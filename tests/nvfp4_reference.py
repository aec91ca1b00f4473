"""An NVFP4 encoder written from the format description alone, to check model/quant.py against.

Float64 numpy, no JAX. The format is defined in FP32 arithmetic (Transformer Engine's kernel),
so every arithmetic step is rounded to float32 (`f32`): float64 has more than twice float32's
precision, so one float64 operation rounded to float32 equals the float32 operation. Rounding
to E2M1 and E4M3 is done here on their grids; a test checks it against ml_dtypes.
"""

import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)


def f32(x):
    """Round float64 values to float32 and back (overflow gives inf, as in float32)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def round_to_format(x, mantissa_bits: int, min_exponent: int):
    """Round to nearest, ties to even, onto a binary float format with `mantissa_bits` stored
    bits and normal exponents from `min_exponent` (subnormals below). No overflow handling."""
    magnitude = np.abs(x)
    _, exponent = np.frexp(magnitude)  # magnitude = m * 2**exponent, m in [0.5, 1)
    quantum = np.ldexp(1.0, np.maximum(exponent - 1, min_exponent) - mantissa_bits)
    # magnitude / quantum is exact (a power of two); rint breaks ties to the even integer,
    # which is the value whose last mantissa bit is 0.
    return np.sign(x) * np.rint(magnitude / quantum) * quantum


def to_e2m1(x):
    """E2M1: 1 mantissa bit, exponents from 0 (0.5 is the subnormal): 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    return round_to_format(x, mantissa_bits=1, min_exponent=0)


E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def round_stochastic(x, bits):
    """Stochastic rounding onto the E2M1 grid, from its definition: between the grid points
    lo <= |x| <= hi, away from zero with probability (|x| - lo) / (hi - lo), taken as
    u < p for u = (bits >> 8) / 2**24 (the top 24 of each uint32), the sign kept."""
    magnitude = np.abs(np.asarray(x, np.float64))
    index = np.clip(np.searchsorted(E2M1_GRID, magnitude, side="right") - 1, 0, 6)
    low, high = E2M1_GRID[index], E2M1_GRID[index + 1]
    p = (magnitude - low) / (high - low)
    u = (np.asarray(bits, np.uint64) >> 8).astype(np.float64) / 2.0**24
    rounded = np.where(u < p, high, low)
    return np.where(np.signbit(x), -rounded, rounded)


def hadamard16(signs) -> np.ndarray:
    """H16 diag(signs) / 4, Sylvester's H16 written entry by entry: (-1)^popcount(i & j)."""
    i, j = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    parity = np.vectorize(lambda n: bin(n).count("1") % 2)(i & j)
    return np.where(parity, -1.0, 1.0) * np.asarray(signs, np.float64)[None, :] / 4


def to_e4m3(x):
    """E4M3 (fn): 3 mantissa bits, exponents from -6, subnormal steps of 2**-9, max 448."""
    return round_to_format(x, mantissa_bits=3, min_exponent=-6)


def encode_scale(amax: float) -> float:
    """S_enc = 2688 / amax, at most FLT_MAX; 1 when amax is 0 (or S_enc underflows)."""
    with np.errstate(divide="ignore"):
        s_enc = min(float(f32(2688.0 / amax)), FLT_MAX)
    return 1.0 if amax == 0 or s_enc == 0 else s_enc


# The block scale's three roundings of block_amax x S_enc / 6 in FP32. Transformer Engine's
# kernel multiplies S_enc by the FP32 constant 1/6 first, then the block's amax; the others
# are what the formula reads as, and each differs from it on some blocks.
ORDERS = {
    "te": lambda amax, s_enc: f32(amax * f32(s_enc * f32(1 / 6))),
    "amax x S_enc / 6": lambda amax, s_enc: f32(f32(amax * s_enc) / 6),
    "amax / 6 x S_enc": lambda amax, s_enc: f32(f32(amax / 6) * s_enc),
}


def block_scale(block_amax, s_enc: float, order: str = "te"):
    """The E4M3 block scales of blocks with amax `block_amax`, at most 448."""
    return to_e4m3(np.minimum(ORDERS[order](block_amax, s_enc), 448.0))


def tile_axis(ndim: int, axis: int) -> int:
    return max(a for a in range(ndim) if a != axis)


def encode(w, axis: int, two_d: bool = False, order: str = "te", bits=None):
    """NVFP4 of `w` -> (codes, block_scales, tensor_scale), all float64 values; `order`: the
    block scale's rounding order (`block_scale`), Transformer Engine's unless asked; codes
    rounded stochastically with `bits` (uint32, w's shape), else to nearest even.

    codes have w's shape; block_scales have w's shape with `axis` divided by 16 (one per
    16 elements along `axis`; with `two_d`, one per 16x16 tile, repeated over its rows).
    """
    x = f32(w)
    axis %= x.ndim
    s_enc = encode_scale(np.max(np.abs(x)))
    s_dec = f32(1.0 / s_enc)

    axes = [tile_axis(x.ndim, axis), axis] if two_d else [axis]
    moved = np.moveaxis(x, axes, list(range(-len(axes), 0)))  # [..., (tile rows,) K]
    blocks = moved.reshape(moved.shape[:-1] + (-1, 16))
    block_amax = np.max(np.abs(blocks), axis=-1)
    if two_d:
        rows = block_amax.reshape(block_amax.shape[:-2] + (-1, 16, block_amax.shape[-1]))
        tile_amax = np.max(rows, axis=-2, keepdims=True)
        block_amax = np.broadcast_to(tile_amax, rows.shape).reshape(block_amax.shape)

    scales = block_scale(block_amax, s_enc, order)
    with np.errstate(divide="ignore"):
        inverse = np.minimum(f32(1.0 / f32(scales * s_dec)), FLT_MAX)
    scaled = np.clip(f32(blocks * inverse[..., None]), -6.0, 6.0)
    if bits is None:
        codes = to_e2m1(scaled)
    else:
        moved_bits = np.moveaxis(np.asarray(bits), axes, list(range(-len(axes), 0)))
        codes = round_stochastic(scaled, moved_bits.reshape(scaled.shape))

    codes = np.moveaxis(codes.reshape(moved.shape), list(range(-len(axes), 0)), axes)
    scales = np.moveaxis(scales, list(range(-len(axes), 0)), axes)
    return codes, scales, s_dec


def dequantize(codes, scales, tensor_scale, axis: int):
    """codes * block scale * tensor scale in float64."""
    return codes * np.repeat(scales, 16, axis=axis) * tensor_scale
