"""NVFP4 numerics: bit-exact against an independent float64 encoder, the format's error bound,
the straight-through gradient, the einsum paths and the storage size."""

from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import nvfp4_reference as ref

from model import quant
import configs
from trainer import target as trainer_target

# Jitted: the encoder's numerics must hold under XLA's compilation, not just op by op.
quantize = jax.jit(quant.quantize, static_argnums=(1, 2))
dequantize = jax.jit(quant.dequantize, static_argnums=1)
fake_quantize = jax.jit(quant.fake_quantize, static_argnums=(1, 2))
einsum = jax.jit(quant.nvfp4_einsum, static_argnames=("subscripts", "axis", "two_d", "path"))


def as64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def sample(rng, shape, kind: str, magnitude: float = 1.0) -> np.ndarray:
    """float32 test weights: gaussian, heavy-tailed (Student-t, 2 dof), or magnitudes spread
    over 8 decades (block scales from E4M3 subnormals to 448)."""
    if kind == "gaussian":
        x = rng.standard_normal(shape)
    elif kind == "heavy":
        x = rng.standard_t(2, shape)
    else:
        x = rng.choice([-1.0, 1.0], shape) * 10.0 ** rng.uniform(-8, 0, shape)
    return (magnitude * x).astype(np.float32)


def assert_matches_reference(w, axis: int, two_d: bool):
    q = quantize(w, axis, two_d)
    codes, scales, tensor_scale = ref.encode(np.asarray(w, np.float64), axis, two_d)
    assert q.codes.dtype == jnp.float4_e2m1fn and q.block_scales.dtype == jnp.float8_e4m3fn
    # Signs too: on CPU a NaN casts to E2M1 -0, so -0 where the reference has +0 is a NaN.
    np.testing.assert_array_equal(as64(q.codes), codes)
    np.testing.assert_array_equal(np.signbit(as64(q.codes)), np.signbit(codes))
    np.testing.assert_array_equal(as64(q.block_scales), scales)
    assert float(q.tensor_scale) == tensor_scale


def test_reference_rounding_matches_ml_dtypes():
    rng = np.random.default_rng(0)
    # Every multiple of 1/8 in [-6.5, 6.5] holds each E2M1 tie, plus random values.
    e2m1 = np.concatenate([np.arange(-52, 53) / 8, rng.uniform(-6, 6, 1000)]).astype(np.float32)
    expected = e2m1.astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    np.testing.assert_array_equal(ref.to_e2m1(np.clip(e2m1, -6, 6)), expected)
    # E4M3 from the subnormal ties (2**-10 rounds to 0) to 448, with exact ties at every step.
    grid = np.abs(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))
    grid = np.unique(grid[np.isfinite(grid)])
    ties = (grid[:-1] + grid[1:]) / 2
    e4m3 = np.concatenate([grid, ties, 10.0 ** rng.uniform(-4, np.log10(448), 2000)])
    e4m3 = e4m3.astype(np.float32)
    expected = e4m3.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(ref.to_e4m3(e4m3), expected)


def test_e2m1_ties_round_to_even():
    # Transformer Engine's cast_to_fp4x2 table: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    # 3.5->4, 5->4.
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    np.testing.assert_array_equal(ref.to_e2m1(ties), [0, 1, 1, 2, 2, 4, 4])


@pytest.mark.parametrize("shape, axis, two_d", [
    ((64, 96), 0, False),
    ((64, 96), 0, True),  # tiles along axis 1
    ((48, 64), -1, False),
    ((48, 64), 1, True),  # tiles along axis 0
    ((32, 16, 48), 1, True),  # "nhd": blocks along h, tiles along d
    ((32, 4, 16), 0, True),  # "dnh": blocks along d, tiles along h
])
def test_matches_reference_bit_for_bit(shape, axis, two_d):
    rng = np.random.default_rng(1)
    for magnitude in (1e-4, 1e-2, 1.0, 1e2, 1e4):
        for kind in ("gaussian", "heavy", "decades"):
            assert_matches_reference(sample(rng, shape, kind, magnitude), axis, two_d)


# E4M3 ties (midpoints of neighbouring scales) from 1/8 to 15: where a block scale rounds one
# way or the other, so where FP32 rounding orders of the block scale can disagree.
E4M3_TIES = np.array([(1 + (2 * m + 1) / 16) * 2.0**e for e in range(-3, 4) for m in range(8)])


def order_sensitive_blocks(tensor_amax: float, other: str, ulps: int = 8) -> np.ndarray:
    """Block amaxes (float32, below `tensor_amax`) whose E4M3 scale under S_enc of
    `tensor_amax` is Transformer Engine's in one rounding order and another in `other`: the
    float32 values within `ulps` of each amax that lands a scale on an E4M3 tie."""
    s_enc = ref.encode_scale(tensor_amax)
    near = (E4M3_TIES * 6 / s_enc).astype(np.float32).view(np.int32)
    amax = (near[:, None] + np.arange(-ulps, ulps + 1)).view(np.float32).astype(np.float64)
    amax = amax.ravel()[amax.ravel() < tensor_amax]
    return amax[ref.block_scale(amax, s_enc) != ref.block_scale(amax, s_enc, other)]


# A block's other elements as fractions of its amax: every E2M1 code, both signs.
FRACTIONS = np.float32([1, -0.97, 0.9, -0.8, 0.71, -0.62, 0.55, -0.46, 0.4, -0.33, 0.29,
                        -0.2, 0.13, -0.11, 0.04, 0])


@pytest.mark.parametrize("other", ["amax x S_enc / 6", "amax / 6 x S_enc"])
def test_block_scales_round_in_transformer_engines_order(other):
    """The block scale is amax x (S_enc x 1/6) in FP32 (TE's kernel), which rounds unlike
    (amax x S_enc) / 6 or amax / 6 x S_enc on some blocks; random data rarely lands on one.
    Tensors of such blocks, found by search, after a block holding the tensor's amax (which
    sets S_enc): the encoder's scales and codes are TE's order's, and not the other's."""
    tensors = 0
    for tensor_amax in np.float32(1 + np.arange(16) * 2.0**-10):
        found = order_sensitive_blocks(float(tensor_amax), other)
        if not found.size:
            continue
        tensors += 1
        amaxes = np.concatenate([[tensor_amax], np.resize(found, 16)])  # one shape: one compile
        w = (amaxes[:, None] * FRACTIONS).astype(np.float32)
        assert_matches_reference(w, 1, False)
        codes, scales, _ = ref.encode(w, 1)
        other_codes, other_scales, _ = ref.encode(w, 1, order=other)
        assert np.all(scales[1:] != other_scales[1:])  # every block tells the orders apart
        assert np.any(codes != other_codes)
    assert tensors >= 8


def test_bfloat16_input_matches_reference():
    w = jnp.asarray(sample(np.random.default_rng(2), (32, 64), "heavy")).astype(jnp.bfloat16)
    assert_matches_reference(w, 1, True)


def test_zero_blocks_and_zero_tensor():
    w = sample(np.random.default_rng(3), (64, 32), "gaussian")
    w[16:32, :] = 0  # the second block of every column
    q = quantize(w, 0, False)
    assert np.all(as64(q.codes)[16:32] == 0) and np.all(as64(q.block_scales)[1] == 0)
    assert np.all(np.isfinite(as64(dequantize(q))))
    assert_matches_reference(w, 0, False)
    zero = quantize(np.zeros((32, 16), np.float32), 0, True)
    assert float(zero.tensor_scale) == 1.0
    assert np.all(as64(zero.codes) == 0) and np.all(as64(zero.block_scales) == 0)


def test_outlier_takes_the_block():
    w = np.ones((32, 16), np.float32)
    w[3, 5] = 1e4
    q = quantize(w, 0, False)
    codes = as64(q.codes)
    # The outlier's block scale is 448, so 1.0 encodes as 6 / 1e4, below the 0.25 tie: code 0.
    assert codes[3, 5] == 6 and np.count_nonzero(codes[:16, 5]) == 1
    assert np.all(codes[16:] == 6) and np.all(codes[:16, :5] == 6)
    dequantized = as64(dequantize(q))
    assert np.all(np.isfinite(dequantized))
    np.testing.assert_allclose(dequantized[3, 5], 1e4, rtol=1e-6)


@pytest.mark.parametrize("power", [-10, 0, 10])
def test_ties_after_scaling(power):
    # amax 2688 * 2**p gives S_enc = 2**-p exactly; a block of amax 6 * 2**p then has scale 1
    # and encodes x as x * 2**-p: the E2M1 ties land exactly on ties.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    block = np.array([6.0, *ties, *np.negative(ties), 5.5])
    w = np.concatenate([block, np.full(16, 2688.0)]).astype(np.float32) * np.float32(2.0**power)
    q = quantize(w, 0, False)
    assert float(q.tensor_scale) == 2.0**power
    np.testing.assert_array_equal(as64(q.block_scales), [1.0, 448.0])
    np.testing.assert_array_equal(as64(q.codes)[:16],
                                  [6, 0, 1, 1, 2, 2, 4, 4, 0, -1, -1, -2, -2, -4, -4, 6])


def test_extremes_give_no_nan():
    w = np.tile(np.array([1e38, -1e38, 1e-30, 0, 3e-39, 1, -1, 65504], np.float32), (16, 2))
    for two_d in (False, True):
        q = quantize(w, 1, two_d)
        assert not np.any(np.isnan(as64(q.block_scales)))
        assert np.all(np.isfinite(as64(dequantize(q))))


def half_step(code_units: np.ndarray) -> np.ndarray:
    """Largest RNE error in E2M1 units: the grid step is 0.5 up to 2, 1 up to 4, 2 up to 6;
    above 6 (a scale rounded down by at most 1/16) the clip to 6 costs at most 0.4."""
    return np.where(code_units <= 2, 0.25, np.where(code_units <= 4, 0.5, 1.0))


@pytest.mark.parametrize("two_d", [False, True])
def test_round_trip_error_within_half_a_step(two_d):
    w = sample(np.random.default_rng(4), (64, 128), "heavy")
    q = quantize(w, 0, two_d)
    step = np.repeat(as64(q.block_scales), 16, axis=0) * float(q.tensor_scale)
    assert step.min() >= 2.0**-6 * float(q.tensor_scale)  # normal E4M3 scales: the bound holds
    code_units = np.abs(w / step)
    assert code_units.max() <= 6 * 16 / 15  # the amax's scale rounded down by at most 1/16
    error = np.abs(w - as64(dequantize(q)))
    assert np.all(error <= (half_step(code_units) + 1e-5) * step)


def relative_error(w, two_d: bool) -> float:
    dequantized = as64(fake_quantize(w, 0, two_d))
    return float(np.linalg.norm(w - dequantized) / np.linalg.norm(w))


def test_relative_error_on_a_gaussian():
    w = sample(np.random.default_rng(5), (256, 1024), "gaussian")
    blocks, tiles = relative_error(w, False), relative_error(w, True)
    assert 0.05 < blocks < 0.12 and 0.05 < tiles < 0.14
    assert blocks < tiles  # a 16x16 tile shares the amax of 16 blocks


@pytest.mark.parametrize("dtype, two_d", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_straight_through_gradient(dtype, two_d):
    rng = np.random.default_rng(6)
    w = jnp.asarray(sample(rng, (32, 48), "gaussian"), dtype)
    g = jnp.asarray(sample(rng, (32, 48), "heavy"), dtype)
    grad = jax.jit(jax.grad(lambda w: jnp.sum(quant.fake_quantize(w, 0, two_d) * g)))(w)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(g))
    assert grad.dtype == dtype
    fake = fake_quantize(w, 0, two_d)
    assert fake.dtype == dtype
    np.testing.assert_array_equal(fake, dequantize(quantize(w, 0, two_d), dtype))


@pytest.mark.parametrize("subscripts, x_shape, w_shape, axis, two_d", [
    ("btd,dnh->btnh", (2, 3, 64), (64, 4, 16), 0, False),
    ("btnh,nhd->btd", (2, 3, 4, 32), (4, 32, 48), 1, True),
    ("btf,fd->btd", (2, 3, 96), (96, 32), 0, True),
])
def test_dequantize_einsum_matches_reference(subscripts, x_shape, w_shape, axis, two_d):
    rng = np.random.default_rng(7)
    x, w = sample(rng, x_shape, "gaussian"), sample(rng, w_shape, "heavy")
    out = einsum(subscripts, jnp.asarray(x), jnp.asarray(w), axis, two_d)
    expected = np.einsum(subscripts, x.astype(np.float64),
                         ref.dequantize(*ref.encode(w, axis, two_d), axis))
    np.testing.assert_allclose(as64(out), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def fake_scaled_dot_general(lhs, rhs, dimension_numbers, preferred_element_type, configs):
    """scaled_dot_general without the quantization (it has no CPU lowering): the operands
    arrive divided by their tensor scales, with unit global scales in the configs."""
    for config in configs:
        assert config.mode == "nvfp4" and config.global_scale.shape == ()
        assert config.global_scale == 1
    return jax.lax.dot_general(lhs, rhs, dimension_numbers,
                               preferred_element_type=preferred_element_type)


@pytest.mark.parametrize("subscripts, x_shape, w_shape", [
    ("btd,dnh->btnh", (2, 3, 32), (32, 4, 8)),
    ("btnh,nhd->btd", (2, 3, 4, 8), (4, 8, 5)),
    ("btd,dnh->bnth", (2, 3, 32), (32, 4, 8)),
    ("bnth,bnsh->bnts", (2, 4, 3, 16), (2, 4, 5, 16)),
    ("bnts,bnsh->bthn", (2, 4, 3, 16), (2, 4, 16, 8)),
])
def test_scaled_einsum_translates_subscripts(monkeypatch, subscripts, x_shape, w_shape):
    monkeypatch.setattr(jax.nn, "scaled_dot_general", fake_scaled_dot_general)
    rng = np.random.default_rng(8)
    x, w = sample(rng, x_shape, "gaussian"), sample(rng, w_shape, "gaussian")
    out = einsum(subscripts, jnp.asarray(x), jnp.asarray(w), 0, path="scaled")
    expected = np.einsum(subscripts, x.astype(np.float64), w.astype(np.float64))
    np.testing.assert_allclose(as64(out), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    bf16 = jax.ShapeDtypeStruct(x_shape, jnp.bfloat16)
    assert jax.eval_shape(partial(einsum, subscripts, w=jnp.asarray(w), axis=0, path="scaled"),
                          bf16).dtype == jnp.bfloat16


@pytest.fixture
def block_scaled_matmul_on_cpu(monkeypatch):
    """JAX's block-scaled matmul custom call (no CPU lowering) replaced by its arithmetic: each
    operand's E2M1 codes times its E4M3 block scales, then a matmul in f32. All around it
    (JAX's quantization, global scales, straight-through backward) is JAX's own."""
    # Reaching inside: the custom call's Python wrapper, looked up by name in this module.
    from jax._src.cudnn import scaled_matmul_stablehlo

    def matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
        def values(codes, scales):  # [B, M, K], [B, M, K / 16]
            blocks = codes.astype(jnp.float32).reshape(*scales.shape, -1)
            return (blocks * scales.astype(jnp.float32)[..., None]).reshape(codes.shape)
        return jnp.einsum("bmk,bnk->bmn", values(lhs, lhs_scales),
                          values(rhs, rhs_scales)).astype(preferred_element_type)

    monkeypatch.setattr(scaled_matmul_stablehlo, "scaled_matmul_wrapper", matmul)


def global_scale_einsum(x, w):
    """The FP4 product as JAX documents it: each operand's tensor scale in its config."""
    configs = [jax.nn.get_scaled_dot_general_config(
        "nvfp4", global_scale=jax.lax.stop_gradient(quant.tensor_scale(a))) for a in (x, w)]
    configs.append(jax.nn.get_scaled_dot_general_config("nvfp4"))
    return jax.nn.scaled_dot_general(x, w, (((2,), (0,)), ((), ())),
                                     preferred_element_type=x.dtype, configs=configs)


def test_the_fp4_path_trains_under_scan_and_checkpoint(block_scaled_matmul_on_cpu):
    """Layers run under scan and jax.checkpoint. JAX keeps a config's global scale as a
    constant of the traced function, so scales computed from the data cannot go there (the
    documented call fails under both); the FP4 path scales the operands itself instead, and
    gives the documented call's loss and gradients, computed outside scan and checkpoint.
    Every operand's largest magnitude is a power of two times 2688 (6 x 448), so both
    formulations compute their tensor scales and the scaled operands exactly."""
    rng = np.random.default_rng(9)
    x = np.clip(rng.standard_normal((2, 8, 64)), -5, 5)
    x[:, 0, 0] = 5.25  # 2688 / 512
    w = rng.standard_normal((3, 64, 64))
    w = w / np.abs(w).max(axis=(1, 2), keepdims=True) * 0.65625  # 2688 / 4096 per layer
    x, weights = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)

    def layer(product, h, w):  # |tanh| < 1: the pinned element is the next input's amax
        return jnp.tanh(product(h, w)).at[:, 0, 0].set(5.25)

    def scanned(product, x, weights):
        body = jax.checkpoint(lambda h, w: (layer(product, h, w), None))
        return jnp.sum(jnp.square(jax.lax.scan(body, x, weights)[0]))

    def unrolled(x, weights):
        for w in weights:
            x = layer(global_scale_einsum, x, w)
        return jnp.sum(jnp.square(x))

    fp4 = partial(quant.nvfp4_einsum, "btd,de->bte", axis=0, path="scaled")
    loss, grads = jax.jit(jax.value_and_grad(partial(scanned, fp4), argnums=(0, 1)))(x, weights)
    expected_loss, expected = jax.jit(jax.value_and_grad(unrolled, argnums=(0, 1)))(x, weights)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6 * np.abs(e).max())
    with pytest.raises(jax.errors.UnexpectedTracerError):  # the scale escapes its trace
        jax.jit(jax.grad(partial(scanned, global_scale_einsum)))(x, weights)


def test_the_fp4_path_never_zeroes_the_gradient_of_the_largest_element(
        block_scaled_matmul_on_cpu):
    """With the tensor scale taken from the amax, the quantization clips nothing, so JAX's
    straight-through rule (zero gradient past 2688 after scaling) must pass every element.
    This amax is one where a x float32(2688 / a) rounds above 2688 (XLA computes
    a / (1 / S_enc) that way): the largest element's gradient must survive it."""
    amax = next(a for a in np.float32(1 + np.arange(1, 10**5) * 1e-5)
                if np.float32(a * np.float32(2688 / a)) > 2688)
    rng = np.random.default_rng(3)
    x = rng.uniform(-0.9, 0.9, (4, 64)).astype(np.float32) * amax
    x[1, 7] = amax
    w = jnp.asarray(rng.standard_normal((64, 32)) / 8, jnp.float32)
    probe = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)

    def loss(product, x):
        return jnp.sum(product(x, w) * probe)

    fp4 = partial(quant.nvfp4_einsum, "bd,de->be", axis=0, path="scaled")
    got = jax.jit(jax.grad(partial(loss, fp4)))(jnp.asarray(x))
    want = jax.grad(partial(loss, partial(jnp.einsum, "bd,de->be")))(jnp.asarray(x))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_scaled_path_exports_for_cuda():
    x = jax.ShapeDtypeStruct((2, 8, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64, 4, 32), jnp.bfloat16)

    def forward(x, w):
        return quant.nvfp4_einsum("btd,dnh->btnh", x, w, 0, path="scaled")

    def loss(x, w):
        return jnp.sum(jnp.square(forward(x, w).astype(jnp.float32)))

    checks = [jax.export.DisabledSafetyCheck.custom_call("__op$block_scaled_dot")]
    for f in (forward, jax.value_and_grad(loss, argnums=(0, 1))):
        try:
            exported = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(
                x, w)
        except NotImplementedError as error:
            pytest.skip(f"this jaxlib cannot lower the block-scaled dot for cuda: {error}")
        assert "__op$block_scaled_dot" in exported.mlir_module()
    assert [a.shape for a in exported.out_avals] == [(), x.shape, w.shape]


def test_nvfp4_bytes():
    # Codes at 4 bits, one E4M3 byte per 16 elements (tiles repeat theirs per row), 4 bytes.
    n = 4096 * 4096
    assert quant.nvfp4_bytes((4096, 4096), 0) == n // 2 + n // 16 + 4
    assert quant.nvfp4_bytes((4096, 4096), 1, two_d=True) == n // 2 + n // 16 + 4
    assert quant.nvfp4_bytes((8, 64, 32), 1) == 8 * 64 * 32 // 2 + 8 * 4 * 32 + 4


def test_shape_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        quant.quantize(jnp.ones((40, 32)), 0)
    with pytest.raises(ValueError, match="multiple of 16"):
        quant.quantize(jnp.ones((32, 40)), 0, two_d=True)
    with pytest.raises(ValueError, match="2-D"):
        quant.quantize(jnp.ones((32,)), 0, two_d=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        quant.nvfp4_einsum("bd,dn->bn", jnp.ones((2, 40)), jnp.ones((40, 8)), 0, path="scaled")
    with pytest.raises(ValueError, match="unknown NVFP4 einsum path"):
        quant.nvfp4_einsum("bd,dn->bn", jnp.ones((2, 32)), jnp.ones((32, 8)), 0, path="fp4")


@pytest.mark.parametrize("capability, tiles, backward, path", [
    ((10, 0), "16x16", "fp4", "scaled"), ((10, 3), "16x16", "fp4", "scaled"),
    ((9, 0), "16x16", "fp4", "dequantize"), (None, "16x16", "fp4", "dequantize"),
    ((10, 0), "1x16", "bf16", "scaled"), ((10, 3), "1x16", "bf16", "scaled"),
    ((10, 0), "16x16", "bf16", "dequantize"), ((9, 0), "1x16", "bf16", "dequantize"),
    ((12, 0), "1x16", "bf16", "dequantize"), (None, "1x16", "bf16", "dequantize")])
def test_the_fp4_path_only_on_blackwell(capability, tiles, backward, path):
    """The target, not the machine the step is traced on, picks the NVFP4 path: a GB200
    target compiled on this CPU gets FP4 tensor cores, the CPU itself the accuracy path;
    JAX's forward-only FP4 product takes 1x16 weight blocks only."""
    run = configs.RunConfig(quant="nvfp4", quant_tiles=tiles, quant_backward=backward)
    target = trainer_target.Target("gpu" if capability else "cpu", capability)
    chosen = trainer_target.quantization(run, target)
    assert (chosen.path, chosen.two_d, chosen.backward) == (path, tiles == "16x16", backward)


# The model: every layer matrix quantized along the axis its einsum contracts, nothing else.
LLAMA_CONTRACTED = {"wq": 0, "wk": 0, "wv": 0, "wo": 1, "w_gate": 0, "w_up": 0, "w_down": 0}
DEEPSEEK_CONTRACTED = {"wq_a": 0, "wq_b": 0, "wkv_a": 0, "wkv_b": 0, "wo": 1, "w_gate": 0,
                       "w_up": 0, "w_down": 0}


def _reference_quantized(params, contracted: dict, two_d: bool):
    """The parameters with each listed layer matrix replaced, layer by layer, by its float64
    reference NVFP4 round trip; everything else (embeddings, head, norms, router, routed
    experts) untouched."""
    out = dict(params)
    for scan in ("layers", "dense_layers", "moe_layers"):
        if scan not in params:
            continue
        layers = dict(params[scan])
        for name, axis in contracted.items():
            stacked = np.asarray(layers[name], np.float64)
            layers[name] = np.stack([ref.dequantize(
                *ref.encode(w, axis, two_d), axis) for w in stacked]).astype(np.float32)
        out[scan] = layers
    return out


def _init(specs, seed=0):
    from model import common
    mesh = common.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
    return common.init_params(specs, common.AxisRules(batch="fsdp", mesh=mesh),
                              jax.random.key(seed))


@pytest.mark.parametrize("two_d", [False, True])
def test_quantized_llama_is_llama_with_reference_quantized_matrices(two_d):
    from model import llama
    from model.config import LlamaConfig
    cfg = LlamaConfig(vocab=61, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                      d_ff=48, rope_theta=1000.0)
    params = _init(llama.param_specs(cfg))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab)
    got, _ = llama.forward(params, tokens, cfg, dtype=jnp.float32,
                           quantization=quant.Quantization("dequantize", two_d, "bf16"))
    want, _ = llama.forward(_reference_quantized(params, LLAMA_CONTRACTED, two_d), tokens, cfg,
                            dtype=jnp.float32)
    plain, _ = llama.forward(params, tokens, cfg, dtype=jnp.float32)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got, want, atol=1e-5 * scale)
    assert float(jnp.max(jnp.abs(plain - want))) > 1e-3 * scale  # quantization is visible


def test_quantized_deepseek_keeps_router_and_routed_experts_unquantized():
    from model import deepseek
    from model.config import DeepSeekConfig, YarnScaling
    cfg = DeepSeekConfig(vocab=61, d_model=32, n_layers=2, n_dense_layers=1, n_heads=2,
                         q_lora_rank=16, kv_lora_rank=16, qk_nope_dim=16, qk_rope_dim=16,
                         v_head_dim=16, d_ff=32, moe_d_ff=16, n_experts=8,
                         experts_per_token=2, n_shared_experts=1, n_groups=4, topk_groups=2,
                         routed_scaling=2.5,
                         rope_scaling=YarnScaling(factor=4.0, original_max_position=64))
    params = _init(deepseek.param_specs(cfg))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab)
    forward = partial(deepseek.forward, cfg=cfg, dtype=jnp.float32, expert_path="dense")
    got, _ = forward(params, tokens, quantization=quant.Quantization(two_d=False,
                                                                      backward="bf16"))
    want, _ = forward(_reference_quantized(params, DEEPSEEK_CONTRACTED, False), tokens)
    np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.max(jnp.abs(want))))
