"""The bf16 compute path against Hugging Face running in bf16: each fixture's checkpoint loaded
by transformers in bfloat16 (`logits_bfloat16` in expected.npz, made by tests/tools/), which
keeps RMSNorm statistics, RoPE angles, the attention softmax and the router in float32.

Errors are RMS over the logits, in units of bf16's unit roundoff u = 2^-8 times the float32
logits' largest magnitude. Where a DeepSeek routing choice is within rounding of a tie, two
bf16 computations can pick other experts for a token, which moves its logits by their own
scale (86 u or more here; rounding alone moves no logit by more than 22 u): positions with a
logit off by more than 64 u are left out, at most one in eight."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from hf.load import load_checkpoint
from model import deepseek, families, layers, llama
from model.options import ForwardOptions

U = 2.0**-8
FIXTURE_NAMES = ["llama_gqa", "llama_sharded", "deepseek_yarn", "deepseek_halfrot"]
CASES = [("llama_gqa", "sorted"), ("llama_sharded", "sorted")] + [
    (fixture, path) for fixture in ("deepseek_yarn", "deepseek_halfrot")
    for path in deepseek.EXPERT_PATHS]


def bf16_forward(fixture, expert_path="sorted"):
    """The project's bf16 logits for the fixture's tokens and HF's expected.npz."""
    cfg, params = load_checkpoint(FIXTURES / fixture)
    expected = np.load(FIXTURES / fixture / "expected.npz")
    logits, _ = families.of(cfg).forward(params, expected["tokens"], cfg,
                                         ForwardOptions("bfloat16", experts=expert_path))
    return np.asarray(logits), expected


def rms_error(got, want, scale: float) -> float:
    """RMS of got - want in u x scale, over the positions whose experts agree."""
    diff = (np.asarray(got, np.float64) - want) / (U * scale)
    agree = np.abs(diff).max(axis=-1) <= 64
    assert agree.mean() >= 7 / 8, f"{np.sum(~agree)} positions off by over 64 u"
    return float(np.sqrt(np.mean(diff[agree] ** 2)))


@pytest.mark.parametrize("fixture, expert_path", CASES)
def test_bf16_logits_are_within_bf16s_error_of_hugging_faces(fixture, expert_path):
    """The bf16 forward is no farther from HF's bf16 logits than bf16 moves HF's own logits
    (its bf16 against its float32 ones). That distance is bf16's precision as the network
    carries it: each rounding moves a value by up to u and the layers amplify it, to 1.6-2.3 u
    across the fixtures, so no one multiple of u would be tight for all of them. A forward
    that rounds where HF rounds, as finely, lands well inside it (0.67-0.76 of it); with its
    norm statistics in bf16 it is at 0.91-1.15 (the next test separates those everywhere)."""
    logits, expected = bf16_forward(fixture, expert_path)
    scale = np.abs(expected["logits"]).max()
    bf16s_own = rms_error(expected["logits_bfloat16"], expected["logits"], scale)
    assert bf16s_own <= 4  # a few u: the reference differs from float32 by rounding only
    error = rms_error(logits, expected["logits_bfloat16"], scale)
    assert error <= bf16s_own, f"{error:.2f} u from HF's bf16 logits, bf16's own {bf16s_own:.2f} u"


def bf16_statistics_rms_norm(x, weight, eps):
    """layers.rms_norm with its statistics in bf16: x^2, their mean, + eps and rsqrt each
    rounded to bf16 (the mean accumulated in float32, as jnp.mean does for bf16). Rounded
    explicitly: as bf16 ops, XLA's CPU backend computes them in float32 and, allowed excess
    precision, drops some of the roundings in between."""
    to_bf16 = partial(jax.lax.reduce_precision, exponent_bits=8, mantissa_bits=7)
    x32 = x.astype(jnp.float32)
    mean = to_bf16(jnp.mean(to_bf16(x32 * x32), axis=-1, keepdims=True))
    normed = x32 * to_bf16(jax.lax.rsqrt(to_bf16(mean + eps)))
    return normed.astype(x.dtype) * weight.astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_float32_norm_statistics_are_what_brings_bf16_logits_to_hugging_faces(fixture,
                                                                              monkeypatch):
    """HF computes RMSNorm statistics in float32 inside a bf16 model; so does the project,
    and its bf16 logits are at least 10% closer to HF's than those of the same forward with
    the statistics in bf16 (19-41% measured). 10% is beyond what rounding in other places as
    finely moves the distance: model/layers.py's norm with its statistics in bf16, which XLA
    rounds in fewer places than this variant, lands within 4% of the variant's distance.
    Against HF's float32 logits the statistics' roundings are lost among bf16's others at
    these widths (0.88-0.98 of the variant's error): nothing to assert there."""
    logits, expected = bf16_forward(fixture)
    for module in (layers, llama, deepseek):  # each looks rms_norm up in its own namespace
        monkeypatch.setattr(module, "rms_norm", bf16_statistics_rms_norm)
    bf16_statistics, _ = bf16_forward(fixture)
    scale = np.abs(expected["logits"]).max()
    assert np.abs(bf16_statistics - logits).max() > U * scale  # the roundings reach the logits
    error = rms_error(logits, expected["logits_bfloat16"], scale)
    bf16_error = rms_error(bf16_statistics, expected["logits_bfloat16"], scale)
    assert error <= 0.9 * bf16_error, f"{error:.2f} u against {bf16_error:.2f} u"
