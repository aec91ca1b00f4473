"""A layer matrix's GEMMs in NVFP4 on model/quant.py's encoding: Transformer Engine's training
recipe (`NVFP4BlockScaling`, see `matmul`) or its forward alone; rules, sources: docs/model.md."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from model.quant import BLOCK, NVFP4Tensor, Quantization, QuantError, quantize, split_blocks


# Transformer Engine's sign vector for the weight gradient's Hadamard transform: fixed, the
# same for every layer and step (TE `get_wgrad_sign_vector`, docs/model.md).
HADAMARD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard_matrix(signs=HADAMARD_SIGNS) -> np.ndarray:
    """The 16-point random Hadamard transform, H16 diag(signs) / 4 (Sylvester's H16):
    orthogonal, so H^T H = I and two operands rotated by it keep their product."""
    h = np.ones((1, 1))
    while h.shape[0] < BLOCK:
        h = np.block([[h, h], [h, -h]])
    return (h * np.asarray(signs, np.float64)[None, :] / 4).astype(np.float32)


def hadamard(x: jax.Array, axis: int) -> jax.Array:
    """x rotated by `hadamard_matrix` along `axis`, 16 elements at a time, accumulated in f32,
    in x's dtype (what the quantization then reads: XLA keeps no f32 copy of it)."""
    rotated = jnp.einsum("...s,hs->...h", jnp.moveaxis(split_blocks(x, axis), axis + 1, -1),
                         jnp.asarray(hadamard_matrix(), x.dtype),
                         preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    return jnp.moveaxis(rotated.astype(x.dtype), -1, axis + 1).reshape(x.shape)


def transposed(q: NVFP4Tensor) -> NVFP4Tensor:
    return dataclasses.replace(q, codes=q.codes.T, block_scales=q.block_scales.T, axis=1 - q.axis)


def tiles(q: NVFP4Tensor) -> jax.Array:
    """The scales of a 2-D matrix of 16x16 tiles, one per tile: [R/16, C/16]."""
    return jnp.take(q.block_scales, np.arange(0, q.codes.shape[1 - q.axis], BLOCK), axis=1 - q.axis)


def tiled(codes: jax.Array, tile_scales: jax.Array, tensor_scale: jax.Array,
          axis: int) -> NVFP4Tensor:
    """A 2-D matrix of 16x16 tiles (codes [R, C], scales [R/16, C/16]) with its blocks along
    `axis`: a tile's scale serves both ways, so the codes transposed multiply as its transpose."""
    return NVFP4Tensor(codes, jnp.repeat(tile_scales, BLOCK, axis=1 - axis), tensor_scale, axis)


def block_scaled_matmul(a: NVFP4Tensor, b: NVFP4Tensor, path: str, dtype) -> jax.Array:
    """a [R, K] times b [C, K] transposed -> [R, C] in `dtype`, both 16-blocks along K, by
    `path` (`Quantization`; dequantizing is exact: an E2M1 code times an E4M3 scale has at most
    6 significant bits). Both accumulate in f32 and round to `dtype` (never an f32 [R, C]),
    then the tensor scales multiply, in f32 (XLA fuses that into the consumer)."""
    if a.axis != 1 or b.axis != 1:
        raise ValueError("block_scaled_matmul takes operands blocked along their last axis")
    if path == "scaled":
        out = jax.nn.scaled_matmul(a.codes[None], b.codes[None], a.block_scales[None],
                                   b.block_scales[None], preferred_element_type=dtype)[0]
    elif path == "dequantize":
        def values(q):
            return (split_blocks(q.codes.astype(dtype), 1) * q.block_scales.astype(dtype)[..., None]
                    ).reshape(q.codes.shape)
        out = jax.lax.dot_general(values(a), values(b), (((1,), (1,)), ((), ())),
                                  preferred_element_type=dtype)
    else:
        raise ValueError(f"unknown NVFP4 GEMM path {path!r}: 'scaled' or 'dequantize'")
    return (out * (a.tensor_scale * b.tensor_scale)).astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def matmul(x: jax.Array, w: jax.Array, key: jax.Array, recipe: Quantization, gathered=None):
    """x [M, K] times w [K, N] -> [M, N] in x's dtype, the forward GEMM in NVFP4: x in 1x16
    blocks along K, w in 16x16 tiles (`recipe.two_d`, else 1x16 blocks), both rounded to
    nearest. The backward (`recipe.backward`): "fp4", Transformer Engine's recipe (each GEMM's
    operands and rounding: docs/model.md); "bf16", both GEMMs in x's dtype on the unquantized
    x and w (JAX's own NVFP4 recipe). Gradients pass the quantization straight through; `key`
    draws the rounding bits. With `gathered` (a sharding), w is quantized where it lies and its
    codes and scales are gathered to it once, for the forward and the backward."""
    return _forward(x, w, key, recipe, gathered)[0]


def _forward(x, w, key, recipe, gathered):
    if x.shape[0] % BLOCK:
        raise QuantError(f"NVFP4 needs the tokens ({x.shape[0]}) in blocks of {BLOCK}: batch "
                         f"x seq a multiple of {BLOCK}")
    codes_dtype = _codes_dtype(recipe.path, x.dtype)
    with jax.named_scope("fp4_fprop"):
        weight = quantize(w, 0, recipe.two_d, codes_dtype=codes_dtype)
        # 16x16 tiles: one scale per tile, gathered and repeated either way after.
        codes, scales = weight.codes, tiles(weight) if recipe.two_d else weight.block_scales
        if gathered is not None:
            codes, scales = jax.lax.with_sharding_constraint((codes, scales), gathered)
        w_rows = (tiled(codes.T, scales.T, weight.tensor_scale, axis=1) if recipe.two_d else
                  transposed(dataclasses.replace(weight, codes=codes, block_scales=scales)))
        out = block_scaled_matmul(quantize(x, 1, codes_dtype=codes_dtype), w_rows,
                                  recipe.path, x.dtype)
    saved = w if recipe.backward == "bf16" else (codes, scales, weight.tensor_scale)
    return out, (x, saved, key)


def random_bits(key: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """uint32 bits for stochastic rounding, a keyed hash of each element's index (two rounds
    of the "lowbias32" integer mixer), which XLA fuses into the quantization, unlike threefry."""
    seed = jax.random.key_data(key).astype(jnp.uint32).reshape(-1)

    def mix(v):
        v = (v ^ (v >> 16)) * jnp.uint32(0x7FEB352D)
        v = (v ^ (v >> 15)) * jnp.uint32(0x846CA68B)
        return v ^ (v >> 16)

    index = (jax.lax.broadcasted_iota(jnp.uint32, shape, 0) * jnp.uint32(shape[1])
             + jax.lax.broadcasted_iota(jnp.uint32, shape, 1))
    return mix(mix(index ^ seed[0]) + seed[-1])


def _codes_dtype(path: str, dtype):
    """E2M1 for the block-scaled GEMM; the same values in the compute dtype to dequantize."""
    return jnp.float4_e2m1fn if path == "scaled" else dtype


def rounding_bits(key: jax.Array, dy_shape: tuple[int, int]):
    """The stochastic rounding's random bits of one backward, each dy's shape: for Dgrad (dy
    along its rows) and Wgrad (dy along its tokens, after the Hadamard transform)."""
    return (random_bits(jax.random.fold_in(key, 0), dy_shape),
            random_bits(jax.random.fold_in(key, 1), dy_shape))


def _backward(recipe, gathered, residuals, dy):
    x, weight, key = residuals
    if recipe.backward == "bf16":
        return dy @ weight.T.astype(dy.dtype), (x.T @ dy).astype(weight.dtype), None
    codes, scales, tensor_scale = weight
    dgrad_bits, wgrad_bits = rounding_bits(key, dy.shape)
    encode = partial(quantize, axis=1, codes_dtype=_codes_dtype(recipe.path, x.dtype))
    with jax.named_scope("fp4_dgrad"):
        w = tiled(codes, scales, tensor_scale, axis=1)
        dx = block_scaled_matmul(encode(dy, bits=dgrad_bits), w, recipe.path, x.dtype)
    with jax.named_scope("fp4_wgrad"):
        # Quantized along the tokens as they lie, then the codes transposed: no bf16 copy.
        x_cols = transposed(encode(hadamard(x, 0), axis=0))
        dy_cols = transposed(encode(hadamard(dy, 0), axis=0, bits=wgrad_bits))
        dw = block_scaled_matmul(x_cols, dy_cols, recipe.path, x.dtype)
    return dx, dw, None


matmul.defvjp(_forward, _backward)
