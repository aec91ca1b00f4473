"""DeepSeek-V3 decoder (the reference `DeepseekV3ForCausalLM`'s numerics, docs/model.md): MLA
in every layer, a dense SwiGLU in the first `n_dense_layers`, routed + shared experts after;
the dense and the MoE layers are two scans, each with its own checkpoint policy. Letters as in
the README; tags use MaxText's names and positions."""

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from model.config import DeepSeekConfig
from model.experts import EXPERT_PATHS, ExpertParallel, experts_exchanged
from model.layers import (apply_rope, causal_attention, einsum, rms_norm, rope_tables,
                          scan_layers, swiglu, swiglu_specs, unembed, yarn_attention_factor,
                          yarn_frequencies, yarn_mscale)
from model.options import ForwardOptions
from model.params import ParamSpec, param_count, stack
from model.quant import layer_keys, layer_weights
from model.sharding import AxisRules, constrain

CONFIG = DeepSeekConfig
# The layer scans and their tags in layer order (the only lists, checked against the traced
# model); the MoE layer's shared expert is a SwiGLU (mlpwi_*), its routed experts moe_mlpwi_*.
_MLA_TAGS = ("decoder_layer_input", "query_wa_proj", "mla_q", "kv_wa_proj", "mla_kv",
             "query_proj", "key_proj", "value_proj", "attention_out", "out_proj")
SCANS = {"dense_layers": (*_MLA_TAGS, "mlpwi_0", "mlpwi_1", "mlpwo"),
         "moe_layers": (*_MLA_TAGS, "mlpwi_0", "mlpwi_1", "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1",
                        "moe_mlpwo")}
LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm ignore the config's eps


def _attention_specs(cfg: DeepSeekConfig) -> dict:
    D, N, R = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank
    qk = cfg.qk_nope_dim + cfg.qk_rope_dim
    if cfg.q_lora_rank is None:
        query = {"wq": ParamSpec((D, N, qk), ("embed", "heads", "head_dim"), D**-0.5)}
    else:
        Q = cfg.q_lora_rank
        query = {"wq_a": ParamSpec((D, Q), ("embed", "latent"), D**-0.5),
                 "q_norm": ParamSpec((Q,), ("latent",)),
                 "wq_b": ParamSpec((Q, N, qk), ("lora", "heads", "head_dim"), Q**-0.5)}
    return {"attn_norm": ParamSpec((D,), ("embed",)), **query,
            "wkv_a": ParamSpec((D, R + cfg.qk_rope_dim), ("embed", "latent"), D**-0.5),
            "kv_norm": ParamSpec((R,), ("latent",)),
            "wkv_b": ParamSpec((R, N, cfg.qk_nope_dim + cfg.v_head_dim),
                               ("lora", "heads", "head_dim"), R**-0.5),
            "wo": ParamSpec((N, cfg.v_head_dim, D), ("heads", "head_dim", "embed"),
                            (N * cfg.v_head_dim) ** -0.5),
            "mlp_norm": ParamSpec((D,), ("embed",))}


def param_specs(cfg: DeepSeekConfig) -> dict:
    D, V, E, F = cfg.d_model, cfg.vocab, cfg.n_experts, cfg.moe_d_ff
    dense = {**_attention_specs(cfg), **swiglu_specs(D, cfg.d_ff)}
    # The router is small and every device routes its own tokens: not sharded by expert.
    moe = {**_attention_specs(cfg),
           "router": ParamSpec((D, E), ("embed", None), D**-0.5),
           "router_bias": ParamSpec((E,), (None,), 0.0),  # selection only; no gradient
           "we_gate": ParamSpec((E, D, F), ("experts", "expert_embed", "mlp"), D**-0.5),
           "we_up": ParamSpec((E, D, F), ("experts", "expert_embed", "mlp"), D**-0.5),
           "we_down": ParamSpec((E, F, D), ("experts", "mlp", "expert_embed"), F**-0.5),
           **swiglu_specs(D, cfg.n_shared_experts * F)}  # the shared experts, as one SwiGLU
    return {"embed": ParamSpec((V, D), ("vocab", "embed"), 1.0),
            "dense_layers": {k: stack(s, cfg.n_dense_layers) for k, s in dense.items()},
            "moe_layers": {k: stack(s, cfg.n_moe_layers) for k, s in moe.items()},
            "final_norm": ParamSpec((D,), ("embed",)),
            "lm_head": ParamSpec((D, V), ("embed", "vocab"), D**-0.5)}


def softmax_scale(cfg: DeepSeekConfig) -> float:
    """d_qk^-1/2, times m(factor, mscale_all_dim)^2 under YaRN on every logit, as the reference."""
    scale = (cfg.qk_nope_dim + cfg.qk_rope_dim) ** -0.5
    yarn = cfg.rope_scaling
    if yarn is not None and yarn.mscale_all_dim:
        scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
    return scale


def _rope(x, cos, sin, interleave: bool):
    """RoPE on the last axis. Interleaved pairs (2i, 2i+1) are first gathered into the
    rotate-half layout [evens | odds], which is also the order the reference returns them in."""
    if interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, cos, sin)


def mla(x, w, cfg: DeepSeekConfig, cos, sin, options: ForwardOptions = ForwardOptions()):
    """Multi-head latent attention as the reference computes it: [B, T, D] -> [B, T, D]."""
    rules, flat = options.rules, options.flat_products
    if cfg.q_lora_rank is None:
        q = einsum("btd,dnh->btnh", x, w["wq"], flat)
    else:
        q_latent = checkpoint_name(einsum("btd,dr->btr", x, w["wq_a"], flat), "query_wa_proj")
        q_latent = checkpoint_name(rms_norm(q_latent, w["q_norm"], LATENT_NORM_EPS), "mla_q")
        q = einsum("btr,rnh->btnh", q_latent, w["wq_b"], flat)
    q_nope, q_rope = jnp.split(q, [cfg.qk_nope_dim], axis=-1)
    kv_a = checkpoint_name(einsum("btd,dr->btr", x, w["wkv_a"], flat), "kv_wa_proj")
    kv_latent, k_rope = jnp.split(kv_a, [cfg.kv_lora_rank], axis=-1)
    kv_latent = checkpoint_name(rms_norm(kv_latent, w["kv_norm"], LATENT_NORM_EPS), "mla_kv")
    k_nope, v = jnp.split(einsum("btr,rnh->btnh", kv_latent, w["wkv_b"], flat),
                          [cfg.qk_nope_dim], axis=-1)
    q_rope = _rope(q_rope, cos, sin, cfg.rope_interleave)
    k_rope = _rope(k_rope[:, :, None, :], cos, sin, cfg.rope_interleave)  # one head, shared
    q = checkpoint_name(jnp.concatenate([q_nope, q_rope], axis=-1), "query_proj")
    k_rope = jnp.broadcast_to(k_rope, (*k_nope.shape[:-1], cfg.qk_rope_dim))
    k = checkpoint_name(jnp.concatenate([k_nope, k_rope], axis=-1), "key_proj")
    v = checkpoint_name(v, "value_proj")
    q = constrain(q, rules, ("batch", "seq", "heads", "head_dim"))
    k = constrain(k, rules, ("batch", "seq", "heads", "head_dim"))
    attended = checkpoint_name(causal_attention(q, k, v, softmax_scale(cfg), options.attention),
                               "attention_out")
    return checkpoint_name(einsum("btnh,nhd->btd", attended, w["wo"], flat), "out_proj")


def route(x, router, bias, cfg: DeepSeekConfig):
    """The reference DeepSeek-V3 router (docs/model.md) on tokens x [S, D], in fp32 throughout:
    (weights [S, k] fp32, experts [S, k] int32, scores [S, E])."""
    scores = jax.nn.sigmoid(jnp.einsum("sd,de->se", x.astype(jnp.float32),
                                       router.astype(jnp.float32)))
    choice = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))[None, :]
    grouped = choice.reshape(choice.shape[0], cfg.n_groups, -1)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
    _, kept_groups = jax.lax.top_k(group_scores, cfg.topk_groups)
    kept = jax.nn.one_hot(kept_groups, cfg.n_groups, dtype=jnp.bool_).any(axis=1)
    choice = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(choice.shape)
    _, experts = jax.lax.top_k(choice, cfg.experts_per_token)
    weights = jnp.take_along_axis(scores, experts, axis=-1)  # [S, k]
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling, experts, scores


def balance_loss(scores, experts, batch: int, n_experts: int):
    """DeepSeek-V3's sequence-wise balance term, sum_e f_e P_e averaged over sequences: f_e is
    expert e's share of the sequence's routed slots (times E), P_e its mean normalised score."""
    scores = scores.reshape(batch, -1, n_experts)
    chosen = jax.nn.one_hot(experts, n_experts, dtype=scores.dtype).sum(axis=1)
    f = chosen.reshape(batch, -1, n_experts).mean(axis=1) * n_experts / experts.shape[1]
    p = (scores / scores.sum(axis=-1, keepdims=True)).mean(axis=1)
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * p, axis=-1))


EXPERT_WEIGHTS = ("we_gate", "we_up", "we_down")
UNQUANTIZED = ("router", *EXPERT_WEIGHTS)  # out of NVFP4, as MaxText's TE path leaves grouped GEMMs


def _routed(x, w, cfg: DeepSeekConfig, expert_path: str, parallel: ExpertParallel | None,
            axis: str | None):
    """The routed half of `moe` on x [B, T, D]: (output, load [E], balance, dropped [E])."""
    B, T, D = x.shape
    tokens = x.reshape(B * T, D)
    weights, experts, scores = route(tokens, w["router"], w["router_bias"], cfg)
    if parallel is None:
        routed = EXPERT_PATHS[expert_path](tokens, weights, experts, w, cfg.n_experts)
        dropped = jnp.zeros((cfg.n_experts,), jnp.int32)
    else:
        routed, dropped = experts_exchanged(tokens, weights, experts, w, cfg.n_experts,
                                            parallel, axis)
    return (routed.reshape(B, T, D), jnp.bincount(experts.reshape(-1), length=cfg.n_experts),
            balance_loss(scores, experts, B, cfg.n_experts), dropped)


def _per_device(routed, rules: AxisRules):
    """Run `routed` on each device's own tokens (without this, XLA gathers every token of the
    batch to route and sort them). Expert weights arrive gathered over their FSDP shards:
    every expert, or under expert parallelism the device's own."""
    batch = rules.spec(("batch", None, None))
    specs = {"router": PartitionSpec(), "router_bias": PartitionSpec(),
             **dict.fromkeys(EXPERT_WEIGHTS, rules.spec(("exchange", None, None)))}

    def local(x, w):
        out, load, balance, dropped = routed(x, w)
        return (out, jax.lax.psum(load, batch[0]), jax.lax.pmean(balance, batch[0]),
                jax.lax.psum(dropped, batch[0]))

    return jax.shard_map(local, mesh=rules.mesh, in_specs=(batch, specs),
                         out_specs=(batch,) + (PartitionSpec(),) * 3)


def moe(x, w, cfg: DeepSeekConfig, options: ForwardOptions = ForwardOptions()):
    """Routed experts (`options`' path and expert parallelism) + shared experts on [B, T, D];
    also each expert's token count [E], the balance term and each expert's (token, expert)
    pairs dropped for lack of room [E]."""
    rules, parallel = options.rules, options.expert_parallel
    axis = rules.spec(("exchange",))[0] if rules is not None else None
    if parallel is not None and rules is not None and not isinstance(axis, str):
        raise ValueError("expert parallelism needs the exchange axis on one mesh axis")
    routed = partial(_routed, cfg=cfg, expert_path=options.experts, parallel=parallel,
                     axis=axis)
    if rules is not None:
        routed = _per_device(routed, rules)
    experts = {k: w[k] for k in ("router", "router_bias", *EXPERT_WEIGHTS)}
    out, load, balance, dropped = routed(x, experts)
    shared = swiglu(x, w, options.flat_products)
    return out + shared, {"expert_load": load, "balance_loss": balance, "expert_dropped": dropped}


def attention_block(x, w, cfg: DeepSeekConfig, cos, sin, options: ForwardOptions):
    """A layer's first half, x [B, T, D] -> x + MLA(norm(x))."""
    x = checkpoint_name(x, "decoder_layer_input")
    with jax.named_scope("attention"):
        h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
        return constrain(x + mla(h, w, cfg, cos, sin, options), options.rules,
                         ("batch", "seq", None))


def dense_block(x, w, cfg: DeepSeekConfig, cos, sin, options: ForwardOptions = ForwardOptions()):
    """One dense layer, x [B, T, D] -> x': MLA, then a SwiGLU."""
    x = attention_block(x, w, cfg, cos, sin, options)
    with jax.named_scope("mlp"):
        h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
        return constrain(x + swiglu(h, w, options.flat_products), options.rules,
                         ("batch", "seq", None))


def moe_block(x, w, cfg: DeepSeekConfig, cos, sin, options: ForwardOptions = ForwardOptions()):
    """One MoE layer, x [B, T, D] -> (x', stats): MLA, then the routed and shared experts
    (`moe`: its statistics)."""
    x = attention_block(x, w, cfg, cos, sin, options)
    with jax.named_scope("moe"):
        h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
        out, stats = moe(h, w, cfg, options)
        return constrain(x + out, options.rules, ("batch", "seq", None)), stats


def rope_for(cfg: DeepSeekConfig, seq_len: int, dtype):
    yarn = cfg.rope_scaling
    if yarn is None:
        freqs = 1.0 / cfg.rope_theta ** (jnp.arange(0, cfg.qk_rope_dim, 2) / cfg.qk_rope_dim)
        return rope_tables(seq_len, freqs, dtype)
    freqs = yarn_frequencies(cfg.qk_rope_dim, cfg.rope_theta, yarn)
    return rope_tables(seq_len, freqs, dtype, yarn_attention_factor(yarn))


def trunk(params, tokens, cfg: DeepSeekConfig, options: ForwardOptions, key=None):
    """The decoder trunk, as `llama.trunk`: tokens [B, T] -> (the last layer's output [B, T, D],
    before the final norm; `moe`'s statistics of each MoE layer, stacked [L_moe, ...]), its two
    scans (SCANS) each under their checkpoint policy in `options`."""
    dtype, rules, quantization = jnp.dtype(options.dtype), options.rules, options.quantization
    cos, sin = rope_for(cfg, tokens.shape[1], dtype)
    x = constrain(jnp.take(params["embed"], tokens, axis=0).astype(dtype), rules,
                  ("batch", "seq", None))

    def dense_layer(x, inputs):
        w, layer_key = inputs
        w = layer_weights(w, dtype, quantization, key=layer_key, rules=rules)
        return dense_block(x, w, cfg, cos, sin, options), None

    def moe_layer(x, inputs):
        w, layer_key = inputs
        router = {k: w[k] for k in ("router", "router_bias")}  # fp32, as the reference routes
        w = {**layer_weights(w, dtype, quantization, UNQUANTIZED, layer_key, rules), **router}
        return moe_block(x, w, cfg, cos, sin, options)

    keys = layer_keys(key, quantization, cfg.n_layers)
    n_dense = cfg.n_dense_layers
    dense_keys, moe_keys = (None, None) if keys is None else (keys[:n_dense], keys[n_dense:])
    x, _ = scan_layers(dense_layer, x, params["dense_layers"], dense_keys, options,
                       "dense_layers")
    return scan_layers(moe_layer, x, params["moe_layers"], moe_keys, options, "moe_layers")


def forward(params, tokens, cfg: DeepSeekConfig, options: ForwardOptions = ForwardOptions()):
    """tokens [B, T] -> (logits [B, T, V] fp32, MoE statistics): `trunk`, final norm, LM head."""
    x, stats = trunk(params, tokens, cfg, options)
    return unembed(x, params["final_norm"], params["lm_head"], cfg.norm_eps), stats


def training_flops(cfg: DeepSeekConfig, batch: float, seq: int) -> float:
    """Model FLOPs of one training step, MaxText's definition: 6 per matmul weight a token uses
    (dropless: k experts + shared + router), the embedding lookup free, causal attention at
    half the square: 3 x B T^2 N (d_qk + d_v) per layer."""
    specs = param_specs(cfg)
    routed_share = cfg.experts_per_token / cfg.n_experts
    # Stacked matrices (norms and the router bias are [L, n]); k of the E routed experts.
    matmul_weights = sum(((routed_share if name.startswith("we_") else 1) * math.prod(s.shape)
                          for scan in SCANS for name, s in specs[scan].items()
                          if len(s.shape) > 2), 0.0) + math.prod(specs["lm_head"].shape)
    attention = 3 * cfg.n_layers * batch * seq**2 * cfg.n_heads * (
        cfg.qk_nope_dim + cfg.qk_rope_dim + cfg.v_head_dim)
    return 6 * batch * seq * matmul_weights + attention


def active_params_per_token(cfg: DeepSeekConfig) -> int:
    """Parameters one token uses: all but the routed experts it does not reach (the whole
    embedding table still counted, as DeepSeek's 37.55 B figure does)."""
    routed = {k: s for k, s in param_specs(cfg)["moe_layers"].items() if k.startswith("we_")}
    unused = 1 - cfg.experts_per_token / cfg.n_experts
    return param_count(param_specs(cfg)) - round(unused * param_count(routed))
