"""Every GEMM of a layer matrix in NVFP4 (Transformer Engine's recipe, model/fp4.py's
`matmul`): stochastic rounding, the Hadamard transform, 16x16 tiles, and the layer's
output and gradients against float64 products of reference-quantized operands
(tests/nvfp4_reference.py, written from the format's description)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_reference as ref

from configs import RunConfig
from conftest import one_device_params, tokens
from model import fp4, layers, quant
from model.options import ForwardOptions
from model.config import LlamaConfig
from trainer.step import make_optimizer, train_step

FP4 = quant.Quantization("dequantize")  # every GEMM in FP4, 16x16 weight tiles
round_stochastic = jax.jit(quant.round_stochastic)
quantize = jax.jit(quant.quantize, static_argnums=(1, 2))


def as64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def test_stochastic_rounding_is_the_reference_bit_for_bit():
    """Given the bits, the rounding is a function: every grid point, every midpoint, random
    values, and bits on each side of each value's threshold (u = p rounds down, one less up)."""
    rng = np.random.default_rng(0)
    grid = ref.E2M1_GRID
    values = np.concatenate([grid, (grid[:-1] + grid[1:]) / 2, rng.uniform(0, 6, 4000)])
    values = np.concatenate([values, -values]).astype(np.float32)
    bits = rng.integers(0, 2**32, values.shape, dtype=np.uint64).astype(np.uint32)
    got = as64(round_stochastic(values, bits))
    np.testing.assert_array_equal(got, ref.round_stochastic(values, bits))
    # At the threshold: u = (bits >> 8) / 2**24 equal to p rounds towards zero, below it away.
    x = np.float32([0.625, 1.125, 2.25, 3.25, 4.5])  # p = 1/4 of each spacing
    threshold = np.uint32(2**22 << 8)  # u = 1/4
    for bits, expected in ((threshold, [0.5, 1.0, 2.0, 3.0, 4.0]),
                           (threshold - 256, [1.0, 1.5, 3.0, 4.0, 6.0])):
        bits = np.full(x.shape, bits, np.uint32)
        np.testing.assert_array_equal(as64(round_stochastic(x, bits)), expected)
        np.testing.assert_array_equal(ref.round_stochastic(x, bits), expected)


@pytest.mark.parametrize("value", [0.3, 0.75, 1.2, 1.75, 2.7, 3.5, 4.9, 5.99, -3.3, -0.1])
def test_stochastic_rounding_is_unbiased(value):
    """The mean of 2**16 roundings, with the backward's own random bits, is the value, within
    5 standard errors of the binomial between its two grid neighbours."""
    n = 2**16
    bits = fp4.random_bits(jax.random.key(1), (n, 1))[:, 0]
    draws = as64(round_stochastic(jnp.full((n,), value, jnp.float32), bits))
    magnitude = abs(np.float32(value))
    low = ref.E2M1_GRID[np.searchsorted(ref.E2M1_GRID, magnitude, side="right") - 1]
    high = ref.E2M1_GRID[np.searchsorted(ref.E2M1_GRID, magnitude, side="right")]
    p = (magnitude - low) / (high - low)
    standard_error = (high - low) * np.sqrt(p * (1 - p) / n)
    assert set(np.abs(draws)) == {low, high}
    assert abs(draws.mean() - np.float32(value)) <= 5 * standard_error


@pytest.mark.parametrize("axis, two_d", [(1, False), (0, False), (1, True)])
def test_quantize_with_bits_is_the_reference_encoder(axis, two_d):
    rng = np.random.default_rng(2)
    w = (rng.standard_t(3, (48, 64)) * 10.0 ** rng.uniform(-3, 3, (48, 1))).astype(np.float32)
    bits = rng.integers(0, 2**32, w.shape, dtype=np.uint64).astype(np.uint32)
    q = jax.jit(quant.quantize, static_argnums=(1, 2))(w, axis, two_d, bits)
    codes, scales, tensor_scale = ref.encode(w, axis, two_d, bits=bits)
    np.testing.assert_array_equal(as64(q.codes), codes)
    np.testing.assert_array_equal(as64(q.block_scales), scales)
    assert float(q.tensor_scale) == tensor_scale
    assert np.any(codes != ref.encode(w, axis, two_d)[0])  # it does not round to nearest


def test_the_hadamard_transform_is_orthogonal_and_inverted_exactly():
    """The matrix is TE's H16 diag(signs) / 4 (Sylvester's H16 from its closed form, TE's
    signs), orthogonal; integer data x 2**-k rotates exactly, and the transpose brings it
    back exactly; two operands rotated alike keep their product."""
    signs = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
    h = ref.hadamard16(signs)
    np.testing.assert_array_equal(fp4.hadamard_matrix().astype(np.float64), h)
    np.testing.assert_array_equal(h.T @ h, np.eye(16))
    rng = np.random.default_rng(3)
    x = (rng.integers(-512, 512, (64, 40)) / 8).astype(np.float32)
    rotate = jax.jit(fp4.hadamard, static_argnums=1)
    rotated = as64(rotate(x, 0))
    expected = np.einsum("gsr,hs->ghr", x.reshape(4, 16, 40).astype(np.float64), h)
    np.testing.assert_array_equal(rotated, expected.reshape(64, 40))
    back = np.einsum("ghr,hs->gsr", rotated.reshape(4, 16, 40), h).reshape(64, 40)
    np.testing.assert_array_equal(back, x)
    np.testing.assert_array_equal(as64(rotate(x.T, 1)), rotated.T)  # along either axis
    y = (rng.integers(-512, 512, (64, 24)) / 8).astype(np.float32)
    np.testing.assert_array_equal(rotated.T @ as64(rotate(y, 0)),
                                  x.T.astype(np.float64) @ y.astype(np.float64))


def test_16x16_tiles_make_w_and_its_transpose_quantize_alike():
    """W [K, N] quantized for the forward (blocks along K) and for the Dgrad (W^T: blocks
    along N) gives the same values with 16x16 tiles, and the forward's codes serve both
    (`tiled` either way, or transposed); with 1x16 blocks the two differ."""
    w = np.random.default_rng(4).standard_t(2, (64, 96)).astype(np.float32)

    def values(q):
        return as64(quant.dequantize(q))

    rows, cols = quantize(w, 0, True), quantize(w, 1, True)
    np.testing.assert_array_equal(values(rows), values(cols))
    scales = fp4.tiles(rows)
    for axis in (0, 1):
        again = fp4.tiled(rows.codes, scales, rows.tensor_scale, axis)
        np.testing.assert_array_equal(values(again), values(rows))
    transposed = fp4.tiled(rows.codes.T, scales.T, rows.tensor_scale, 1)
    np.testing.assert_array_equal(values(transposed), values(rows).T)
    assert np.any(values(quantize(w, 0, False)) != values(quantize(w, 1, False)))


def dyadic(rng, shape, spread: int = 6) -> np.ndarray:
    """Integers times powers of two, so every sum of 16 of them (the Hadamard transform) is
    exact in float32, while rows span 2**spread in magnitude (block scales differ)."""
    return (rng.integers(-255, 256, shape) * 2.0 ** rng.integers(-spread, 1, (shape[0], 1))
            / 64).astype(np.float32)


def reference_layer(x, w, dy, key):
    """The layer's output and gradients as float64 products of operands quantized by the
    reference encoder: x 1x16 along K; w 16x16 tiles; dy 1x16 along N with the backward's
    Dgrad bits; x and dy rotated along the tokens (float64) and quantized 1x16 along them,
    dy with the Wgrad bits."""
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    h = ref.hadamard16(fp4.HADAMARD_SIGNS)
    dgrad_bits, wgrad_bits = (np.asarray(b) for b in fp4.rounding_bits(key, dy.shape))

    def rotated(a):  # [M, C] rotated along M, 16 rows at a time
        return np.einsum("gsc,hs->ghc", a.reshape(-1, 16, a.shape[1]), h).reshape(a.shape)

    def deq(a, axis, two_d=False, bits=None):
        return ref.dequantize(*ref.encode(a, axis, two_d, bits=bits), axis)

    xq, wq = deq(x64, 1), deq(w.astype(np.float64), 0, True)
    dy_rows = deq(dy64, 1, bits=dgrad_bits)
    x_cols, dy_cols = deq(rotated(x64), 0), deq(rotated(dy64), 0, bits=wgrad_bits)
    operands = {"x": (xq, x64), "w": (wq, w.astype(np.float64)), "dy": (dy_rows, dy64)}
    return xq @ wq, dy_rows @ wq.T, x_cols.T @ dy_cols, operands


@pytest.mark.parametrize("m, k, n", [(64, 96, 48), (128, 32, 80)])
def test_the_fp4_layer_is_float64_on_reference_quantized_operands(m, k, n):
    """y, dx and dw of `fp4.matmul` (the dequantize path, f32) equal the float64 products of
    the reference-quantized operands to f32 accumulation; and their error against the exact
    float64 layer is the quantization's, within its bound: per element, what the operands'
    errors can add (|dq - d| |w| + |dq| |wq - w| for dx; the rotated operands for dw)."""
    rng = np.random.default_rng(m + k + n)
    x, w, dy = dyadic(rng, (m, k)), rng.standard_normal((k, n)).astype(np.float32), dyadic(
        rng, (m, n))
    key = jax.random.key(7)
    y, vjp = jax.vjp(lambda x, w: fp4.matmul(x, w, key, FP4), x, w)
    dx, dw = vjp(jnp.asarray(dy))
    want_y, want_dx, want_dw, operands = reference_layer(x, w, dy, key)
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(as64(got), want, rtol=0, atol=2e-6 * np.abs(want).max())
    (dyq, dy64), (wq, w64) = operands["dy"], operands["w"]
    exact = dy64 @ w64.T
    bound = np.abs(dyq - dy64) @ np.abs(w64).T + np.abs(dyq) @ np.abs(wq - w64).T
    assert np.all(np.abs(as64(dx) - exact) <= bound + 2e-6 * np.abs(exact).max())
    assert np.linalg.norm(as64(dx) - exact) > 1e-3 * np.linalg.norm(exact)  # it is FP4
    exact_dw = operands["x"][1].T @ dy64
    relative = np.linalg.norm(as64(dw) - exact_dw) / np.linalg.norm(exact_dw)
    assert 0.01 < relative < 0.5


def test_the_dgrad_is_unbiased_over_keys():
    """Stochastic rounding makes the mean Dgrad over independent keys converge to dy times
    the quantized weight: the error of the mean of 256 keys is about 1/16 of one key's,
    while rounding dy to nearest (a single biased value) would not shrink at all."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((32, 48)).astype(np.float32), rng.standard_normal((48, 64))
    dy = rng.standard_normal((32, 64)).astype(np.float32)
    wq = ref.dequantize(*ref.encode(w.astype(np.float32), 0, True), 0)
    expected = dy.astype(np.float64) @ wq.T

    @jax.jit
    def dgrad(key):
        return jax.vjp(lambda x: fp4.matmul(x, jnp.asarray(w, jnp.float32), key, FP4),
                       x)[1](jnp.asarray(dy))[0]

    grads = np.stack([as64(dgrad(k)) for k in jax.random.split(jax.random.key(8), 256)])
    one = np.linalg.norm(grads[0] - expected)
    mean = np.linalg.norm(grads.mean(0) - expected)
    assert mean < one / 8, (mean, one)


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (3, 5), (5, 3), (1, 4096), (4096, 1)],
                         ids=lambda shape: "x".join(map(str, shape)))
def test_every_element_of_a_matrix_draws_bits_of_its_own(shape):
    """Guards the class: element indices that collide for some shapes (fewer rows than
    columns, more, one row, one column), which keeps each draw unbiased. For one key the hash
    is a bijection of the index (xors, xorshifts, odd multiplies mod 2^32): distinct indices
    give distinct bits and colliding ones equal bits, so every element's bits must differ
    from every other's, exactly, with no statistics."""
    bits = np.asarray(fp4.random_bits(jax.random.key(7), shape))
    assert bits.shape == shape and np.unique(bits).size == bits.size


def test_each_step_layer_matrix_and_gemm_rounds_with_bits_of_its_own(monkeypatch):
    """Guards the class: stochastic rounding drawing the same bits twice (the step's key not
    folded with the step, a layer's or a matrix's key not its own, the Dgrad's and the
    Wgrad's alike), which keeps each draw unbiased. The bits the trainer's step (train_step,
    NVFP4 on a 2-layer Llama, 32 tokens) draws, recorded as drawn: 2 layers x 7 matrices x
    (Dgrad, Wgrad) a step, no two alike in steps 0 and 1 (told apart by their first row:
    one key gives every shape the same bits there); step 0 again draws step 0's bits (a
    resumed run's); each draw gives every element of its [32, outputs] its own bits (outputs
    16 to 48: fewer and more than the tokens)."""
    drawn, draw = [], fp4.random_bits

    def recorded(key, shape):
        bits = draw(key, shape)
        jax.debug.callback(lambda b: drawn.append(np.asarray(b)), bits)
        return bits

    monkeypatch.setattr(fp4, "random_bits", recorded)
    cfg = LlamaConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                      d_ff=48, rope_theta=1000.0)
    params = one_device_params(cfg)
    run = RunConfig(steps=2)
    optimizer = make_optimizer(run.optimizer, run.steps)
    step = jax.jit(partial(train_step, model=cfg, run=run,
                           options=ForwardOptions(quantization=FP4)))
    state, batch = {"params": params, "opt_state": optimizer.init(params)}, tokens(cfg, 2, 17)

    def bits_of(t: int) -> list[np.ndarray]:
        drawn.clear()
        jax.block_until_ready(step({**state, "step": jnp.int32(t)}, batch))
        jax.effects_barrier()
        return list(drawn)

    first, second, again = bits_of(0), bits_of(1), bits_of(0)
    assert len(first) == len(second) == 2 * 7 * 2
    assert {b.shape for b in first} == {(32, 16), (32, 32), (32, 48)}
    assert len({b[0, :16].tobytes() for b in first + second}) == 2 * len(first)
    assert sorted(b.tobytes() for b in again) == sorted(b.tobytes() for b in first)
    assert all(np.unique(b).size == b.size for b in first + second)


def test_a_layer_matrix_product_flattened_is_the_einsum():
    """The model's layer einsums as one [M, K] x [K, N] product: flat, the float64 einsum's
    values to f32 rounding; NVFP4-marked, the same output as `fp4.matmul` of the flattened
    operands, bit for bit."""
    rng = np.random.default_rng(6)
    key = jax.random.key(0)
    cases = [("btd,dnh->btnh", (2, 8, 32), (32, 4, 16)), ("btnh,nhd->btd", (2, 8, 4, 16),
                                                          (4, 16, 48))]
    for subscripts, x_shape, w_shape in cases:
        x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
        flat = layers.einsum(subscripts, jnp.asarray(x, jnp.float32),
                             jnp.asarray(w, jnp.float32), flat=True)
        # each output sums K = 32 or 64 f32 products of unit normals: ~1e-6 of an output's ~6
        np.testing.assert_allclose(flat, np.einsum(subscripts, x, w), rtol=0, atol=2e-5)
        x, w = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
        got = layers.einsum(subscripts, x, quant.NVFP4Weight(w, key, FP4))
        k = int(np.prod(w_shape[:len(subscripts.split(",")[0]) - 2]))
        np.testing.assert_array_equal(got.reshape(16, -1),
                                      fp4.matmul(x.reshape(16, k), w.reshape(k, -1), key, FP4))
    with pytest.raises(ValueError, match="trailing letters"):
        layers.einsum("btd,nd->btn", jnp.ones((2, 8, 32)), jnp.ones((4, 32)), flat=True)
    with pytest.raises(quant.QuantError, match="blocks of 16"):
        fp4.matmul(jnp.ones((24, 32)), jnp.ones((32, 16)), key, FP4)


def test_the_scaled_path_is_the_dequantize_path_on_cpu():
    """JAX's block-scaled matmul (lowered on CPU to its arithmetic) and the dequantize path
    give the same layer, forward and backward, in float32."""
    rng = np.random.default_rng(9)
    x, w = rng.standard_normal((64, 96)), rng.standard_normal((96, 48))
    x, w = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
    outs = []
    for path in ("scaled", "dequantize"):
        y, vjp = jax.vjp(partial(fp4.matmul, key=jax.random.key(3),
                                 recipe=quant.Quantization(path)), x, w)
        outs.append((y, *vjp(dy)))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.abs(b).max()))


@pytest.mark.parametrize("two_d", [False, True])
def test_a_bf16_backward_is_the_plain_gradient_of_the_unquantized_operands(two_d):
    """quant_backward=bf16 (JAX's own NVFP4 recipe): the forward on quantized x and w, the
    gradients those of x w in full, as if nothing were quantized (straight through)."""
    rng = np.random.default_rng(10)
    x, w = dyadic(rng, (64, 96)), rng.standard_normal((96, 48)).astype(np.float32)
    dy = rng.standard_normal((64, 48)).astype(np.float32)
    recipe = quant.Quantization("dequantize", two_d, "bf16")
    y, vjp = jax.vjp(partial(fp4.matmul, key=jax.random.key(0), recipe=recipe), x, w)
    dx, dw = vjp(jnp.asarray(dy))
    xq = ref.dequantize(*ref.encode(x.astype(np.float64), 1), 1)
    wq = ref.dequantize(*ref.encode(w.astype(np.float64), 0, two_d), 0)
    np.testing.assert_allclose(as64(y), xq @ wq, rtol=0, atol=2e-6 * np.abs(xq @ wq).max())
    for got, want in ((dx, dy @ w.T.astype(np.float64)), (dw, x.T.astype(np.float64) @ dy)):
        np.testing.assert_allclose(as64(got), want, rtol=0, atol=2e-6 * np.abs(want).max())
