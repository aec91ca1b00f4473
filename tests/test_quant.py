"""NVFP4 numerics: bit-exact against an independent float64 encoder, the format's error bound,
the storage size, the path each target takes, and which of a model's weights are quantized."""

from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import nvfp4_reference as ref

from model import quant
from model.options import ForwardOptions
from model.params import abstract_params
import configs
from trainer import target as trainer_target

# Jitted: the encoder's numerics must hold under XLA's compilation, not just op by op.
quantize = jax.jit(quant.quantize, static_argnums=(1, 2))
dequantize = jax.jit(quant.dequantize, static_argnums=1)


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
    dequantized = as64(dequantize(quantize(w, 0, two_d)))
    return float(np.linalg.norm(w - dequantized) / np.linalg.norm(w))


def test_relative_error_on_a_gaussian():
    w = sample(np.random.default_rng(5), (256, 1024), "gaussian")
    blocks, tiles = relative_error(w, False), relative_error(w, True)
    assert 0.05 < blocks < 0.12 and 0.05 < tiles < 0.14
    assert blocks < tiles  # a 16x16 tile shares the amax of 16 blocks


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


@pytest.mark.parametrize("capability, path", [
    ((10, 0), "scaled"), ((10, 3), "scaled"), ((9, 0), "dequantize"), ((12, 0), "dequantize"),
    (None, "dequantize")])
def test_the_fp4_path_only_on_blackwell(capability, path):
    """The target, not the machine the step is traced on, picks the NVFP4 path: a GB200
    target compiled on this CPU gets FP4 tensor cores, the CPU itself the same numbers."""
    for tiles, backward in (("16x16", "fp4"), ("1x16", "bf16"), ("16x16", "bf16")):
        run = configs.RunConfig(quant="nvfp4", quant_tiles=tiles, quant_backward=backward)
        target = trainer_target.Target("gpu" if capability else "cpu", capability)
        chosen = trainer_target.quantization(run, target)
        assert (chosen.path, chosen.two_d, chosen.backward) == (path, tiles == "16x16",
                                                                 backward)


# The model: every layer matrix multiplied in NVFP4, contracted as its einsum says; nothing else.
LLAMA_MATRICES = {"wq": "btd,dnh->btnh", "wk": "btd,dkh->btkh", "wv": "btd,dkh->btkh",
                  "wo": "btnh,nhd->btd", "w_gate": "btd,df->btf", "w_up": "btd,df->btf",
                  "w_down": "btf,fd->btd"}
DEEPSEEK_MATRICES = {"wq_a": "btd,dr->btr", "wq_b": "btr,rnh->btnh", "wkv_a": "btd,dr->btr",
                     "wkv_b": "btr,rnh->btnh", "wo": "btnh,nhd->btd", "w_gate": "btd,df->btf",
                     "w_up": "btd,df->btf", "w_down": "btf,fd->btd"}


def nvfp4_products(monkeypatch, family, cfg) -> list[tuple[str, tuple]]:
    """(subscripts, weight shape) of every product of an NVFP4-marked weight in one forward."""
    from model import layers
    calls = []
    original = layers.einsum

    def recording(subscripts, x, w, *args):
        if isinstance(w, quant.NVFP4Weight):
            calls.append((subscripts, w.value.shape))
        return original(subscripts, x, w, *args)

    for module in (layers, family):  # the family's blocks and layers.swiglu call it
        monkeypatch.setattr(module, "einsum", recording)
    specs = family.param_specs(cfg)
    params = abstract_params(specs)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    options = ForwardOptions(quantization=quant.Quantization(), experts="dense")
    jax.eval_shape(partial(family.forward, cfg=cfg, options=options), params, tokens)
    return calls, specs


def test_every_llama_layer_matrix_and_nothing_else_is_nvfp4(monkeypatch):
    from model import llama
    from model.config import LlamaConfig
    cfg = LlamaConfig(vocab=61, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                      d_ff=48, rope_theta=1000.0)
    calls, specs = nvfp4_products(monkeypatch, llama, cfg)
    expected = {(s, specs["layers"][name].shape[1:]) for name, s in LLAMA_MATRICES.items()}
    assert set(calls) == expected and len(calls) == len(LLAMA_MATRICES)  # one scan body


def test_deepseek_keeps_router_and_routed_experts_out_of_nvfp4(monkeypatch):
    from model import deepseek
    from model.config import DeepSeekConfig, YarnScaling
    cfg = DeepSeekConfig(vocab=61, d_model=32, n_layers=2, n_dense_layers=1, n_heads=2,
                         q_lora_rank=16, kv_lora_rank=16, qk_nope_dim=16, qk_rope_dim=16,
                         v_head_dim=16, d_ff=32, moe_d_ff=16, n_experts=8,
                         experts_per_token=2, n_shared_experts=1, n_groups=4, topk_groups=2,
                         routed_scaling=2.5,
                         rope_scaling=YarnScaling(factor=4.0, original_max_position=64))
    calls, specs = nvfp4_products(monkeypatch, deepseek, cfg)
    expected = {(s, specs[scan][name].shape[1:]) for scan in ("dense_layers", "moe_layers")
                for name, s in DEEPSEEK_MATRICES.items() if name in specs[scan]}
    assert set(calls) == expected  # the routed experts and the router never come here
    assert len(calls) == 5 + 3 + 5 + 3  # per scan body: MLA's 5, then the (shared) MLP's 3
