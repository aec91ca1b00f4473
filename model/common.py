"""Machinery shared by the model families: logical sharding, abstract parameters, layers."""

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jax.ad_checkpoint import checkpoint_name
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

from model import fp4, quant
from model.config import Llama3RopeScaling, YarnScaling

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Logical axis name -> mesh axis (or axes, or None for replicated).

    Model code names what an axis *is* (batch, embed, heads); only this table says which mesh
    axis shards it, so a new parallelism is one edited default, not edits across the model.
    FSDP: weights are sharded along `embed`, activations along `batch`, over the same devices.
    Expert parallelism (`experts`, `exchange`): the routed experts split over `expert` and
    FSDP-sharded over `fsdp`; every other weight is sharded over both. A mesh may leave out an
    axis it does not split (a mesh of data x fsdp is expert parallelism of 1)."""
    batch: MeshAxes = ("data", "fsdp", "expert")
    seq: MeshAxes = None
    embed: MeshAxes = ("fsdp", "expert")
    vocab: MeshAxes = None
    heads: MeshAxes = None
    kv_heads: MeshAxes = None
    head_dim: MeshAxes = None
    mlp: MeshAxes = None
    latent: MeshAxes = None  # MLA's low-rank latents, as outputs
    lora: MeshAxes = ("fsdp", "expert")  # the same latents as the input of up-projections
    # The routed-expert weights' expert axis, at rest: the expert groups' share of the experts,
    # FSDP-sharded along the same axis (MaxText's shard_exp_on_fsdp). Gathered for a layer,
    # it is the major axis of the stack, so XLA needs no transposed copy of the stack to
    # concatenate it (sharded along their width, it keeps one: docs/placement.md).
    experts: MeshAxes = ("expert", "fsdp")
    expert_embed: MeshAxes = None  # their embed axis
    exchange: MeshAxes = "expert"  # the devices of one expert group, which exchange tokens
    layers: MeshAxes = None
    mesh: Mesh | AbstractMesh | None = None  # abstract when exporting without devices

    def sharding(self, logical: tuple[str | None, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical))

    def spec(self, logical: tuple[str | None, ...]) -> PartitionSpec:
        mapped = [self._present(getattr(self, name)) if name else None for name in logical]
        used = [a for m in mapped if m for a in ((m,) if isinstance(m, str) else m)]
        if len(used) != len(set(used)):
            raise ValueError(f"logical axes {logical} map a mesh axis twice: {mapped}")
        return PartitionSpec(*mapped)

    def _present(self, axes: MeshAxes) -> MeshAxes:
        """`axes` less those the mesh does not have (a mesh without an axis is it at size 1)."""
        if axes is None or self.mesh is None:
            return axes
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes)
                     if a in self.mesh.axis_names)
        return kept[0] if len(kept) == 1 else kept or None


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...], devices=None) -> Mesh:
    """The first prod(shape) `devices` (default all) in their order, axes Auto: XLA propagates
    our hints."""
    devices = np.asarray(jax.devices() if devices is None else devices, dtype=object)
    return Mesh(devices[:math.prod(shape)].reshape(shape), names,
                axis_types=(AxisType.Auto,) * len(names))


def constrain(x: jax.Array, rules: AxisRules | None, logical: tuple[str | None, ...]):
    return x if rules is None else jax.lax.with_sharding_constraint(x, rules.sharding(logical))


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter before it exists: shape, logical axes and how to initialise it."""
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    std: float | None = None  # normal(0, std), zeros for 0; None means ones (norm weights)


@dataclasses.dataclass(frozen=True)
class HfTensor:
    """Where a parameter lies in a Hugging Face checkpoint. `name` holds {layer} and {expert}
    for a stacked entry's indices (the HF layer number is `first_layer` + ours). A `linear`
    weight is stored [out, in]: ours is it transposed, its in axis split into our first `n_in`
    axes (after the stacked ones), its out axis into the rest. `fused` names the tensor holding
    every routed expert's weight at once, [experts, rows, in] (as transformers keeps them), and
    which of its equal row blocks is ours; `tied`, the tensor read when `name` is absent."""
    name: str
    linear: bool = False
    n_in: int = 1
    first_layer: int = 0
    fused: tuple[str, int, int] | None = None  # (name, block, blocks)
    tied: str = ""


def hf_layer(name: str, n_in: int = 0, first: int = 0, fused=None) -> HfTensor:
    """The stacked layer tensor `model.layers.{layer}.<name>.weight`, a linear one with `n_in`
    in axes (0: not linear); `fused` names its fused tensor under the same layer prefix."""
    return HfTensor(f"model.layers.{{layer}}.{name}.weight", bool(n_in), n_in or 1, first,
                    fused and (f"model.layers.{{layer}}.{fused[0]}", *fused[1:]))


def hf_swiglu(prefix: str, first: int = 0) -> dict:
    """`swiglu_specs`'s weights, HF's `<prefix>gate_proj` and so on."""
    return {f"w_{part}": hf_layer(f"{prefix}{part}_proj", 1, first)
            for part in ("gate", "up", "down")}


def stack(spec: ParamSpec, n: int) -> ParamSpec:
    return ParamSpec((n, *spec.shape), ("layers", *spec.axes), spec.std)


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_count(specs) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=_is_spec))


def abstract_params(specs, dtype=jnp.float32):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=_is_spec)


def param_shardings(specs, rules: AxisRules):
    return jax.tree.map(lambda s: rules.sharding(s.axes), specs, is_leaf=_is_spec)


def init_params(specs, rules: AxisRules, key: jax.Array, dtype=jnp.float32):
    """Random parameters, each created already sharded: no full tensor on one device."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)

    @partial(jax.jit, out_shardings=[rules.sharding(s.axes) for s in leaves])
    def make(key):
        keys = jax.random.split(key, len(leaves))
        return [jnp.ones(s.shape, dtype) if s.std is None
                else s.std * jax.random.normal(k, s.shape, dtype) for s, k in zip(leaves, keys)]

    return jax.tree.unflatten(treedef, make(key))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as Hugging Face computes it: statistics in fp32, back to x's dtype, then weight."""
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
    """Hugging Face's factor on cos and sin (1 for DeepSeek-V3, where mscale = mscale_all_dim)."""
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor)


def rope_tables(seq_len: int, freqs: np.ndarray, dtype, factor: float = 1.0):
    """cos and sin [T, H], the H/2 frequencies twice (rotate-half), times YaRN's `factor`."""
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * jnp.asarray(freqs)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return (jnp.cos(angles) * factor).astype(dtype), (jnp.sin(angles) * factor).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on [B, T, heads, H]: dimension i pairs with i + H/2 (HF's layout)."""
    first, second = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float | None = None,
                     implementation: str | None = None):
    """softmax(q k^T * scale) v, causal (scale 1/sqrt(H) by default); q [B,T,N,H], k [B,S,K,H],
    v [B,S,K,H'] with H' <= H. Query head n reads kv head n // (N/K), Hugging Face's
    repeat-interleave GQA mapping; the softmax runs in fp32. `implementation="cudnn"` (GPUs,
    bf16) is cuDNN's fused flash kernel, which never stores the [B, N, T, S] scores and takes a
    narrower v as it is (MLA: 192 for q and k, 128 for v). None is XLA's reference path (JAX
    0.12 does not pick cuDNN by itself), which wants one head dim: a narrower v is padded with
    zero columns, whose outputs are zero and sliced off."""
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


def quantizable(name: str, ndim: int, unquantized=()) -> bool:
    """Whether a layer weight (one layer's) is multiplied in NVFP4: a matrix not `unquantized`."""
    return ndim >= 2 and name not in unquantized


def layer_weights(w: dict, dtype, quantization: quant.Quantization | None, unquantized=(),
                  key: jax.Array | None = None, rules: AxisRules | None = None):
    """A layer's weights in the compute dtype, its `quantizable` matrices marked for NVFP4 under
    `quantization`, each with its own share of the layer's `key` (an FP4 backward's rounding
    bits) and, given `rules`, gathered whole (replicated) as FP4 codes."""
    gathered = None if rules is None else rules.sharding(())

    def prepare(index: int, name: str, a: jax.Array):
        a = a.astype(dtype)
        if quantization is None or not quantizable(name, a.ndim, unquantized):
            return a
        return quant.NVFP4Weight(a, None if key is None else jax.random.fold_in(key, index),
                                 quantization, gathered)
    return {name: prepare(i, name, a) for i, (name, a) in enumerate(sorted(w.items()))}


def layer_keys(key: jax.Array | None, quantization: quant.Quantization | None, layers: int):
    """One key per layer of a scan for an FP4 backward's stochastic rounding (None without
    NVFP4); a forward given no key (evaluation, tracing) uses key 0."""
    if quantization is None:
        return None
    return jax.random.split(jax.random.key(0) if key is None else key, layers)


def einsum(subscripts: str, x: jax.Array, w) -> jax.Array:
    if not isinstance(w, quant.NVFP4Weight):
        return jnp.einsum(subscripts, x, w)
    return fp4.einsum(subscripts, x, w.value, w.key, w.quantization, w.gathered)


def scan_layers(layer, x, stacked, policy, name: str):
    """Run `layer(x, w) -> (x, out)` over weights stacked on a leading layer axis, each layer
    under `jax.checkpoint(policy)` (none: no checkpointing), in a named scope that traces,
    profiles and placement reports use to tell the scans apart."""
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
    with jax.named_scope(name):
        return jax.lax.scan(layer, x, stacked)


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


def swiglu(h: jax.Array, w: dict) -> jax.Array:
    """The SwiGLU MLP down(silu(gate(h)) * up(h)), [B, T, D] -> [B, T, D], tagged."""
    gate = checkpoint_name(einsum("btd,df->btf", h, w["w_gate"]), "mlpwi_0")
    up = checkpoint_name(einsum("btd,df->btf", h, w["w_up"]), "mlpwi_1")
    return checkpoint_name(einsum("btf,fd->btd", jax.nn.silu(gate) * up, w["w_down"]),
                           "mlpwo")
