"""Hugging Face checkpoints (Llama, DeepSeek-V3) -> (model config, fp32 numpy params).

HF linear weights are stored [out, in]; ours are [in, out], with heads split out.
"""

from pathlib import Path

import numpy as np

from model import deepseek, llama
from model.checkpoint import CheckpointError, check_shapes, read_json, read_tensors
from model.config import DeepSeekConfig, Llama3RopeScaling, LlamaConfig, YarnScaling


def _rope(hf: dict) -> tuple[float, dict]:
    """(theta, scaling dict). transformers 5 writes `rope_parameters`; older configs and the
    released checkpoints `rope_theta` + `rope_scaling`."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))), rope


def _rope_type(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def llama_config(hf: dict) -> LlamaConfig:
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise CheckpointError("checkpoints with attention or MLP biases are not supported")
    theta, rope = _rope(hf)
    if _rope_type(rope) not in ("default", "llama3"):
        raise CheckpointError(f"rope_type {_rope_type(rope)!r} is not supported for Llama")
    scaling = None if _rope_type(rope) == "default" else Llama3RopeScaling(
        factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position=int(rope.get("original_max_position_embeddings",
                                           hf.get("max_position_embeddings", 8192))))
    heads = int(hf["num_attention_heads"])
    return LlamaConfig(
        vocab=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        d_ff=int(hf["intermediate_size"]), rope_theta=theta, rope_scaling=scaling,
        max_position=int(hf.get("max_position_embeddings", 2048)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)))


def _yarn(hf: dict, rope: dict) -> YarnScaling | None:
    if _rope_type(rope) == "default":
        return None
    if _rope_type(rope) != "yarn":
        raise CheckpointError(f"rope_type {_rope_type(rope)!r} is not supported for DeepSeek")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or hf["max_position_embeddings"] / original

    def optional(key):
        return None if rope.get(key) is None else float(rope[key])

    return YarnScaling(factor=float(factor), original_max_position=original,
                       beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1),
                       mscale=optional("mscale"), mscale_all_dim=optional("mscale_all_dim"),
                       truncate=bool(rope.get("truncate", True)))


def deepseek_config(hf: dict) -> DeepSeekConfig:
    theta, rope = _rope(hf)
    if rope.get("attention_factor") is not None:
        raise CheckpointError("an explicit YaRN attention_factor is not supported")
    return DeepSeekConfig(
        vocab=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        n_dense_layers=int(hf.get("first_k_dense_replace", 3)),
        n_heads=int(hf["num_attention_heads"]),
        q_lora_rank=None if hf.get("q_lora_rank") is None else int(hf["q_lora_rank"]),
        kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
        d_ff=int(hf["intermediate_size"]), moe_d_ff=int(hf["moe_intermediate_size"]),
        n_experts=int(hf["n_routed_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
        n_shared_experts=int(hf.get("n_shared_experts", 1)),  # missing keys: HF's defaults
        n_groups=int(hf.get("n_group", 8)), topk_groups=int(hf.get("topk_group", 4)),
        routed_scaling=float(hf.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)), rope_theta=theta,
        rope_interleave=bool(hf.get("rope_interleave", rope.get("rope_interleave", True))),
        rope_scaling=_yarn(hf, rope), max_position=int(hf.get("max_position_embeddings", 4096)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)))


class _Tensors:
    """Named HF tensors, fetched as fp32, linear weights transposed to [in, out]."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors

    def __call__(self, name: str, *shape: int) -> np.ndarray:
        if name not in self.tensors:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}")
        array = np.asarray(self.tensors[name], np.float32)
        if array.ndim == 2:
            array = array.T
        try:
            return array.reshape(shape) if shape else array
        except ValueError:
            raise CheckpointError(f"{name}: shape {array.shape} does not fit config.json "
                                  f"({shape})") from None


def _stack(layers: list[dict]) -> dict:
    return {k: np.stack([layer[k] for layer in layers]) for k in layers[0]} if layers else {}


def _ends(get: _Tensors, tensors: dict) -> dict:
    embed = get("model.embed_tokens.weight").T  # a lookup table: back to HF's [V, D]
    head = get("lm_head.weight") if "lm_head.weight" in tensors else embed.T  # tied embeddings
    return {"embed": embed, "final_norm": get("model.norm.weight"), "lm_head": head}


def llama_params(tensors: dict[str, np.ndarray], cfg: LlamaConfig) -> dict:
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    get = _Tensors(tensors)

    def layer(p):
        return {"attn_norm": get(p + "input_layernorm.weight"),
                "wq": get(p + "self_attn.q_proj.weight", D, N, H),
                "wk": get(p + "self_attn.k_proj.weight", D, K, H),
                "wv": get(p + "self_attn.v_proj.weight", D, K, H),
                "wo": get(p + "self_attn.o_proj.weight", N, H, D),
                "mlp_norm": get(p + "post_attention_layernorm.weight"),
                **_swiglu(get, p + "mlp.")}

    layers = [layer(f"model.layers.{i}.") for i in range(cfg.n_layers)]
    return {**_ends(get, tensors), "layers": _stack(layers)}


def _swiglu(get: _Tensors, prefix: str) -> dict:
    return {"w_gate": get(prefix + "gate_proj.weight"), "w_up": get(prefix + "up_proj.weight"),
            "w_down": get(prefix + "down_proj.weight")}


def _mla(get: _Tensors, p: str, cfg: DeepSeekConfig) -> dict:
    D, N, R = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank
    qk = cfg.qk_nope_dim + cfg.qk_rope_dim
    a = p + "self_attn."
    if cfg.q_lora_rank is None:
        query = {"wq": get(a + "q_proj.weight", D, N, qk)}
    else:
        query = {"wq_a": get(a + "q_a_proj.weight"), "q_norm": get(a + "q_a_layernorm.weight"),
                 "wq_b": get(a + "q_b_proj.weight", cfg.q_lora_rank, N, qk)}
    return {"attn_norm": get(p + "input_layernorm.weight"), **query,
            "wkv_a": get(a + "kv_a_proj_with_mqa.weight"),
            "kv_norm": get(a + "kv_a_layernorm.weight"),
            "wkv_b": get(a + "kv_b_proj.weight", R, N, cfg.qk_nope_dim + cfg.v_head_dim),
            "wo": get(a + "o_proj.weight", N, cfg.v_head_dim, D),
            "mlp_norm": get(p + "post_attention_layernorm.weight")}


def _experts(get: _Tensors, tensors: dict, m: str, cfg: DeepSeekConfig) -> dict:
    """Routed experts, stored unfused on disk (experts.{e}.{gate,up,down}_proj) or fused as
    transformers keeps them in memory (experts.gate_up_proj [E, 2F, D], experts.down_proj)."""
    E, F = cfg.n_experts, cfg.moe_d_ff
    if m + "experts.gate_up_proj" in tensors:
        gate_up = get(m + "experts.gate_up_proj").transpose(0, 2, 1)
        return {"we_gate": gate_up[..., :F], "we_up": gate_up[..., F:],
                "we_down": get(m + "experts.down_proj").transpose(0, 2, 1)}
    per_expert = [_swiglu(get, f"{m}experts.{e}.") for e in range(E)]
    return {"we" + k[1:]: v for k, v in _stack(per_expert).items()}


def deepseek_params(tensors: dict[str, np.ndarray], cfg: DeepSeekConfig) -> dict:
    get = _Tensors(tensors)

    def moe_layer(p):
        m = p + "mlp."
        return {**_mla(get, p, cfg), "router": get(m + "gate.weight"),
                "router_bias": get(m + "gate.e_score_correction_bias"),
                **_experts(get, tensors, m, cfg), **_swiglu(get, m + "shared_experts.")}

    prefixes = [f"model.layers.{i}." for i in range(cfg.n_layers)]  # later ones: MTP, unused
    dense = [{**_mla(get, p, cfg), **_swiglu(get, p + "mlp.")}
             for p in prefixes[:cfg.n_dense_layers]]
    moe = [moe_layer(p) for p in prefixes[cfg.n_dense_layers:]]
    return {**_ends(get, tensors), "dense_layers": _stack(dense), "moe_layers": _stack(moe)}


FAMILIES = {"llama": (llama_config, llama_params, llama.param_specs),
            "deepseek_v3": (deepseek_config, deepseek_params, deepseek.param_specs)}


def load_checkpoint(directory: str | Path):
    """(config, fp32 numpy params) from a Hugging Face checkpoint directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    hf = read_json(directory / "config.json")
    if not isinstance(hf, dict):
        raise CheckpointError(f"{directory}/config.json: not a JSON object")
    family = hf.get("model_type", "llama")
    if family not in FAMILIES:
        raise CheckpointError(f"model_type {family!r} is not one of {', '.join(FAMILIES)}")
    make_config, make_params, make_specs = FAMILIES[family]
    try:
        cfg = make_config(hf)
    except KeyError as e:
        raise CheckpointError(f"{directory}/config.json lacks {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{directory}/config.json: a value of the wrong type ({e})") from None
    if problems := cfg.problems():
        raise CheckpointError(f"{directory}/config.json: {problems[0]}")
    params = make_params(read_tensors(directory), cfg)
    check_shapes(params, make_specs(cfg))
    return cfg, params
