"""config.json <-> our model configs, as transformers 5 writes it (rope settings in
`rope_parameters`) and as the released checkpoints do (`rope_theta` + `rope_scaling`)."""

from model.config import DeepSeekConfig, Llama3RopeScaling, LlamaConfig, YarnScaling
from hf.safetensors import CheckpointError


def _rope(hf: dict) -> tuple[float, dict, str]:
    """(theta, scaling dict, rope type), from either layout."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    return theta, rope, rope.get("rope_type", rope.get("type", "default"))


def _common(hf: dict, theta: float, max_position: int) -> dict:
    """The fields both families read alike (a missing optional key: HF's default)."""
    return dict(vocab=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
                n_layers=int(hf["num_hidden_layers"]), n_heads=int(hf["num_attention_heads"]),
                d_ff=int(hf["intermediate_size"]), rope_theta=theta,
                max_position=int(hf.get("max_position_embeddings", max_position)),
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)))


def _llama(hf: dict) -> LlamaConfig:
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise CheckpointError("checkpoints with attention or MLP biases are not supported")
    theta, rope, kind = _rope(hf)
    if kind not in ("default", "llama3"):
        raise CheckpointError(f"rope_type {kind!r} is not supported for Llama")
    scaling = None if kind == "default" else Llama3RopeScaling(
        factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position=int(rope.get("original_max_position_embeddings",
                                           hf.get("max_position_embeddings", 8192))))
    common = _common(hf, theta, 2048)
    heads = common["n_heads"]
    return LlamaConfig(**common, n_kv_heads=int(hf.get("num_key_value_heads") or heads),
                       head_dim=int(hf.get("head_dim") or common["d_model"] // heads),
                       rope_scaling=scaling)


def _yarn(hf: dict, rope: dict, kind: str) -> YarnScaling | None:
    if kind == "default":
        return None
    if kind != "yarn":
        raise CheckpointError(f"rope_type {kind!r} is not supported for DeepSeek")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or hf["max_position_embeddings"] / original
    mscales = {key: None if rope.get(key) is None else float(rope[key])
               for key in ("mscale", "mscale_all_dim")}
    return YarnScaling(factor=float(factor), original_max_position=original,
                       beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1),
                       truncate=bool(rope.get("truncate", True)), **mscales)


def _deepseek(hf: dict) -> DeepSeekConfig:
    theta, rope, kind = _rope(hf)
    if rope.get("attention_factor") is not None:
        raise CheckpointError("an explicit YaRN attention_factor is not supported")
    return DeepSeekConfig(
        **_common(hf, theta, 4096), n_dense_layers=int(hf.get("first_k_dense_replace", 3)),
        q_lora_rank=None if hf.get("q_lora_rank") is None else int(hf["q_lora_rank"]),
        kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
        moe_d_ff=int(hf["moe_intermediate_size"]), n_experts=int(hf["n_routed_experts"]),
        experts_per_token=int(hf["num_experts_per_tok"]),
        n_shared_experts=int(hf.get("n_shared_experts", 1)), n_groups=int(hf.get("n_group", 8)),
        topk_groups=int(hf.get("topk_group", 4)),
        routed_scaling=float(hf.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)), rope_scaling=_yarn(hf, rope, kind),
        rope_interleave=bool(hf.get("rope_interleave", rope.get("rope_interleave", True))))


def from_hf(hf: dict):
    """Our config of a config.json (its model_type picks the family; Llama if absent)."""
    readers = {"llama": _llama, "deepseek_v3": _deepseek}
    family = hf.get("model_type", "llama")
    if family not in readers:
        raise CheckpointError(f"model_type {family!r} is not one of {', '.join(readers)}")
    return readers[family](hf)


def _rope_parameters(cfg) -> dict:
    s = cfg.rope_scaling
    if s is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if isinstance(cfg, LlamaConfig):
        return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position}
    return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": s.factor,
            "original_max_position_embeddings": s.original_max_position,
            "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "mscale": s.mscale,
            "mscale_all_dim": s.mscale_all_dim, "truncate": s.truncate}


def to_hf(cfg, dtype: str = "float32") -> dict:
    common = {"vocab_size": cfg.vocab, "hidden_size": cfg.d_model,
              "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
              "intermediate_size": cfg.d_ff, "max_position_embeddings": cfg.max_position,
              "rms_norm_eps": cfg.norm_eps, "rope_parameters": _rope_parameters(cfg),
              "tie_word_embeddings": False, "dtype": dtype}
    if isinstance(cfg, LlamaConfig):
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,
            "first_k_dense_replace": cfg.n_dense_layers, "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_dim,
            "qk_rope_head_dim": cfg.qk_rope_dim, "v_head_dim": cfg.v_head_dim,
            "num_key_value_heads": cfg.n_heads, "moe_intermediate_size": cfg.moe_d_ff,
            "n_routed_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
            "n_shared_experts": cfg.n_shared_experts, "n_group": cfg.n_groups,
            "topk_group": cfg.topk_groups, "routed_scaling_factor": cfg.routed_scaling,
            "norm_topk_prob": cfg.norm_topk_prob, "rope_interleave": cfg.rope_interleave,
            "num_nextn_predict_layers": 0, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "hidden_act": "silu", "attention_bias": False}
