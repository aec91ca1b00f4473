"""Llama-3.1 decoder (the reference `LlamaForCausalLM`'s numerics, docs/model.md), its layers
run under lax.scan. Letters as in the README; tags (`checkpoint_name`) use MaxText's names and
positions, so a checkpoint policy can keep, offload or recompute each tensor by name."""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from model.config import LlamaConfig
from model.layers import (apply_rope, causal_attention, einsum, rms_norm, rope_frequencies,
                          rope_tables, scan_layers, swiglu, swiglu_specs, unembed)
from model.options import ForwardOptions
from model.params import ParamSpec, param_count, stack
from model.quant import layer_keys, layer_weights
from model.sharding import constrain

CONFIG = LlamaConfig
# The layer scan (named as its parameter subtree and its named_scope) and its tags in layer
# order: the only list of them, checked against the traced model by the tests.
SCANS = {"layers": ("decoder_layer_input", "query_proj", "key_proj", "value_proj",
                    "attention_out", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")}
UNQUANTIZED = ()  # quant=nvfp4 multiplies every layer matrix in NVFP4


def param_specs(cfg: LlamaConfig) -> dict:
    D, N, K, H, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab
    layer = {"attn_norm": ParamSpec((D,), ("embed",)),
             "wq": ParamSpec((D, N, H), ("embed", "heads", "head_dim"), D**-0.5),
             "wk": ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim"), D**-0.5),
             "wv": ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim"), D**-0.5),
             "wo": ParamSpec((N, H, D), ("heads", "head_dim", "embed"), (N * H) ** -0.5),
             "mlp_norm": ParamSpec((D,), ("embed",)),
             **swiglu_specs(D, F)}
    return {"embed": ParamSpec((V, D), ("vocab", "embed"), 1.0),
            "layers": {name: stack(spec, cfg.n_layers) for name, spec in layer.items()},
            "final_norm": ParamSpec((D,), ("embed",)),
            "lm_head": ParamSpec((D, V), ("embed", "vocab"), D**-0.5)}


def block(x, w, cfg: LlamaConfig, cos, sin, options: ForwardOptions = ForwardOptions()):
    """One decoder layer: x [B, T, D] -> [B, T, D]. `w` holds this layer's weights; `options`
    give its axis rules, attention kernel and products."""
    rules, flat = options.rules, options.flat_products
    x = checkpoint_name(x, "decoder_layer_input")
    with jax.named_scope("attention"):
        h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
        q = einsum("btd,dnh->btnh", h, w["wq"], flat)
        k = einsum("btd,dkh->btkh", h, w["wk"], flat)
        v = einsum("btd,dkh->btkh", h, w["wv"], flat)
        q = checkpoint_name(apply_rope(q, cos, sin), "query_proj")
        k = checkpoint_name(apply_rope(k, cos, sin), "key_proj")
        v = checkpoint_name(v, "value_proj")
        q = constrain(q, rules, ("batch", "seq", "heads", "head_dim"))
        k = constrain(k, rules, ("batch", "seq", "kv_heads", "head_dim"))
        v = constrain(v, rules, ("batch", "seq", "kv_heads", "head_dim"))
        attended = checkpoint_name(causal_attention(q, k, v, implementation=options.attention),
                                   "attention_out")
        out = checkpoint_name(einsum("btnh,nhd->btd", attended, w["wo"], flat), "out_proj")
        x = constrain(x + out, rules, ("batch", "seq", None))
    with jax.named_scope("mlp"):
        h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
        return constrain(x + swiglu(h, w, flat), rules, ("batch", "seq", None))


def trunk(params, tokens, cfg: LlamaConfig, options: ForwardOptions, key=None):
    """The decoder trunk (embedding, then the layers): tokens [B, T] int -> (the last layer's
    output [B, T, D], before the final norm; {}). Each layer of the scan "layers" runs under
    its checkpoint policy in `options`, its weights cast to the compute dtype and, under
    NVFP4, its matrices multiplied in FP4, `key` drawing an FP4 backward's rounding bits."""
    dtype, rules, quantization = jnp.dtype(options.dtype), options.rules, options.quantization
    cos, sin = rope_tables(tokens.shape[1], rope_frequencies(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), dtype)
    x = jnp.take(params["embed"], tokens, axis=0).astype(dtype)
    x = constrain(x, rules, ("batch", "seq", None))

    def layer(x, inputs):
        w, layer_key = inputs
        w = layer_weights(w, dtype, quantization, key=layer_key, rules=rules)
        return block(x, w, cfg, cos, sin, options), None

    keys = layer_keys(key, quantization, cfg.n_layers)
    x, _ = scan_layers(layer, x, params["layers"], keys, options, "layers")
    return x, {}


def forward(params, tokens, cfg: LlamaConfig, options: ForwardOptions = ForwardOptions()):
    """tokens [B, T] int -> (logits [B, T, V] fp32, {}): `trunk`, the final norm, the LM head."""
    x, stats = trunk(params, tokens, cfg, options)
    return unembed(x, params["final_norm"], params["lm_head"], cfg.norm_eps), stats


def training_flops(cfg: LlamaConfig, batch: int, seq: int) -> float:
    """Model FLOPs of one training step (forward + backward), MaxText's definition: 6 per
    matmul weight per token (the embedding lookup free, the LM head counted), plus causal
    attention at half the square, 3 x (4 B T^2 N H) / 2 per layer; recomputation not counted."""
    specs = param_specs(cfg)
    matmuls = [s for s in specs["layers"].values() if len(s.shape) > 2] + [specs["lm_head"]]
    attention = 6 * cfg.n_layers * batch * seq**2 * cfg.n_heads * cfg.head_dim
    return 6 * batch * seq * param_count(matmuls) + attention
