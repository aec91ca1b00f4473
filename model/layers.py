"""The layers both families are made of: RMSNorm, RoPE (Llama 3.1 and YaRN frequencies),
causal attention (XLA's or cuDNN's), SwiGLU, the LM head, an einsum that takes NVFP4-marked
weights, and the layer scan under a checkpoint policy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

from model import fp4, quant
from model.config import Llama3RopeScaling, YarnScaling
from model.params import ParamSpec

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as the reference computes it: statistics in fp32, back to x's dtype, then weight."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight.astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))


def rope_frequencies(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [H/2], with Llama-3.1 scaling: keep the high frequencies, divide the
    low ones by `factor`, and blend linearly in between (by wavelength)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return freqs.astype(np.float32)
    wavelength = 2 * np.pi / freqs
    context = scaling.original_max_position
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    blend = (context / wavelength - low) / (high - low)
    blended = (1 - blend) * freqs / scaling.factor + blend * freqs
    scaled = np.where(wavelength > context / low, freqs / scaling.factor, blended)
    scaled = np.where(wavelength < context / high, freqs, scaled)
    return scaled.astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(dim: int, theta: float, yarn: YarnScaling) -> np.ndarray:
    """YaRN inverse frequencies [dim/2]: the original ones up to the fast-rotation correction
    dimension, divided by `factor` past the slow one, a ramp linear in the index between."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    return (freqs / yarn.factor * ramp + freqs * (1 - ramp)).astype(np.float32)


def yarn_attention_factor(yarn: YarnScaling) -> float:
    """The reference's factor on cos and sin (1 for DeepSeek-V3, where mscale = mscale_all_dim)."""
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor)


def rope_tables(seq_len: int, freqs: np.ndarray, dtype, factor: float = 1.0):
    """cos and sin [T, H], the H/2 frequencies twice (rotate-half), times YaRN's `factor`."""
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * jnp.asarray(freqs)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return (jnp.cos(angles) * factor).astype(dtype), (jnp.sin(angles) * factor).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on [B, T, heads, H]: dimension i pairs with i + H/2 (the reference's)."""
    first, second = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float | None = None,
                     implementation: str = "xla"):
    """softmax(q k^T * scale) v, causal (scale 1/sqrt(H) by default); q [B,T,N,H], k [B,S,K,H],
    v [B,S,K,H'] with H' <= H. Query head n reads kv head n // (N/K), the reference's
    repeat-interleave GQA mapping; the softmax runs in fp32. `implementation="cudnn"` (GPUs,
    bf16) is cuDNN's fused flash kernel, which takes a narrower v as it is (docs/model.md);
    "xla" is XLA's path, which wants one head dim: a narrower v is padded with zero columns,
    whose outputs are zero and sliced off."""
    if implementation == "cudnn":
        # JAX 0.12's public dot_product_attention refuses H' != H before reaching this
        # kernel, which supports it (cuDNN >= 9.10 on Hopper and later).
        return cudnn_attention.dot_product_attention(
            q, k, v, scale=1 / math.sqrt(q.shape[-1]) if scale is None else scale,
            mask_type=cudnn_attention.MaskType.CAUSAL)
    pad = q.shape[-1] - v.shape[-1]
    if pad:
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                       implementation=implementation)
    return out[..., : out.shape[-1] - pad] if pad else out


def einsum(subscripts: str, x: jax.Array, w, flat: bool = False) -> jax.Array:
    """A layer matrix's product, x's trailing letters leading w ("btd,dnh->btnh",
    "btnh,nhd->btd"): as written, or as one 2-D [tokens, in] x [in, out] product, the same
    sums, where `flat` or w is NVFP4-marked (its blocks then run along the flattened
    contraction, within a head for "btnh,nhd->btd"). Flat, XLA's CPU backend gives the weight
    gradient's product its operands as they lie, as for `unembed`, where for the einsum it
    writes each activation gradient again, transposed (docs/runs.md: what a CPU step costs);
    on a GPU it moves the schedule, so only CPU programs ask for it."""
    nvfp4 = isinstance(w, quant.NVFP4Weight)
    if not (flat or nvfp4):
        return jnp.einsum(subscripts, x, w)
    inputs, out = subscripts.split("->")
    xs, ws = inputs.split(",")
    n = sum(letter in ws for letter in xs)  # the contraction: x's last n axes, w's first n
    if xs[len(xs) - n:] != ws[:n] or out != xs[:len(xs) - n] + ws[n:]:
        raise ValueError(f"{subscripts!r}: a layer matrix takes x's trailing letters as w's "
                         "leading ones, the output x's tokens then w's rest")
    value = w.value if nvfp4 else w
    k = math.prod(value.shape[:n])
    x2, w2 = x.reshape(-1, k), value.reshape(k, -1)
    if nvfp4:  # w in x's dtype (the compute dtype): its gradient comes back in it
        product = fp4.matmul(x2, w2.astype(x.dtype), w.key, w.quantization, w.gathered)
    else:
        product = jnp.dot(x2, w2)
    return product.reshape(*x.shape[:x.ndim - n], *value.shape[n:])


def scan_layers(layer, x, weights, keys, options, name: str):
    """Run `layer(x, (w, key)) -> (x, out)` over `weights` (and the per-layer `keys`, or None)
    stacked on a leading layer axis, each layer under `jax.checkpoint` with the scan's policy
    in `options` (none: no checkpointing), unrolled where they say, in a named scope that
    traces, profiles and placement reports use to tell the scans apart. Weights in host memory
    (`options.weights_on_host`) come to the device inside the checkpointed layer: in the
    forward pass and again when its backward pass recomputes it, so the device holds one
    layer's; autodiff sends each layer's gradient back to host memory as it is made."""
    policy = options.policy(name)
    if options.weights_on_host:
        body = layer

        def layer(x, inputs):
            w, key = inputs
            w = dict(w)
            probe = w.pop(NORM_PROBE, jnp.zeros((), jnp.float32))
            return body(x, (to_device(w, probe), key))
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
    with jax.named_scope(name):
        return jax.lax.scan(layer, x, (weights, keys), unroll=options.unrolled)


WEIGHTS_SCOPE = "weights_from_host"  # the named scope of a layer's weights' moves
# A per-layer zero a train step may add to a scan's weights (parameters=host): its gradient
# is the sum of the squares of the layer's weight gradients, taken as they are made.
NORM_PROBE = "norm_probe"


@jax.custom_vjp
def to_device(w, probe):
    """A layer's weights moved from host memory to the device; in the backward pass its
    gradient goes back to host memory, and `probe`'s gradient is the sum of its squares (the
    gradient norm's share of this layer, without reading the gradient back from host). Not
    `jax.device_put` alone also for a weight without a gradient, DeepSeek's router bias: JAX
    0.12 makes its zero cotangent on the device, not in host memory, and refuses the step."""
    del probe
    with jax.named_scope(WEIGHTS_SCOPE):
        return jax.device_put(w, jax.memory.Space.Device)


def _to_device_forward(w, probe):
    return to_device(w, probe), None


def _to_device_backward(_, grads):
    squares = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
    with jax.named_scope(WEIGHTS_SCOPE):
        return jax.device_put(grads, jax.memory.Space.Host), squares


to_device.defvjp(_to_device_forward, _to_device_backward)


def unembed(x: jax.Array, norm: jax.Array, lm_head: jax.Array, eps: float):
    """Final RMSNorm and LM head (in x's dtype): [B, T, D] -> logits [B, T, V] fp32. One 2-D
    [B*T, D] x [D, V] dot, the same math as "btd,dv->btv": XLA's CPU backend then keeps the
    backward dots row-major instead of transposing a [V, B*T] copy of dlogits."""
    x = rms_norm(x, norm, eps)
    batch, seq, width = x.shape
    logits = jnp.dot(x.reshape(batch * seq, width), lm_head.astype(x.dtype),
                     preferred_element_type=jnp.float32)
    return logits.reshape(batch, seq, lm_head.shape[-1])


def swiglu_specs(d_model: int, d_ff: int) -> dict:
    return {"w_gate": ParamSpec((d_model, d_ff), ("embed", "mlp"), d_model**-0.5),
            "w_up": ParamSpec((d_model, d_ff), ("embed", "mlp"), d_model**-0.5),
            "w_down": ParamSpec((d_ff, d_model), ("mlp", "embed"), d_ff**-0.5)}


def swiglu(h: jax.Array, w: dict, flat: bool = False) -> jax.Array:
    """The SwiGLU MLP down(silu(gate(h)) * up(h)), [B, T, D] -> [B, T, D], tagged; `flat`:
    `einsum`'s."""
    gate = checkpoint_name(einsum("btd,df->btf", h, w["w_gate"], flat), "mlpwi_0")
    up = checkpoint_name(einsum("btd,df->btf", h, w["w_up"], flat), "mlpwi_1")
    return checkpoint_name(einsum("btf,fd->btd", jax.nn.silu(gate) * up, w["w_down"], flat),
                           "mlpwo")
