"""Our params -> a Hugging Face checkpoint (config.json + safetensors): model/hf.py reversed.

Linear weights go back to HF's [out, in] with the head axes merged; routed experts are written
one tensor per expert (`experts.{e}.gate_proj.weight`), the layout of the released DeepSeek-V3
checkpoint, which transformers converts on load. Big models are split into files of at most
`shard_bytes`, with the index transformers reads.
"""

import json
import math
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from model.config import DeepSeekConfig, LlamaConfig

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _rope(cfg) -> dict:
    scaling = cfg.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if isinstance(cfg, LlamaConfig):
        return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position}
    return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position,
            "beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow,
            "mscale": scaling.mscale, "mscale_all_dim": scaling.mscale_all_dim,
            "truncate": scaling.truncate}


def hf_config(cfg, dtype: str = "float32") -> dict:
    """config.json for `cfg`, as transformers 5 writes it (rope settings in rope_parameters)."""
    common = {"vocab_size": cfg.vocab, "hidden_size": cfg.d_model,
              "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
              "intermediate_size": cfg.d_ff, "max_position_embeddings": cfg.max_position,
              "rms_norm_eps": cfg.norm_eps, "rope_parameters": _rope(cfg),
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


def _linear(weight: np.ndarray, in_axes: int = 1) -> np.ndarray:
    """Our [*in, *out] weight as HF's [out, in]: the first `in_axes` axes are the input."""
    return weight.reshape(math.prod(weight.shape[:in_axes]), -1).T


def _swiglu(layer: dict, prefix: str, key: str = "w") -> Iterator[tuple[str, np.ndarray]]:
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        yield f"{prefix}{theirs}.weight", _linear(layer[f"{key}_{ours}"])


def _llama_layer(layer: dict, p: str) -> Iterator[tuple[str, np.ndarray]]:
    yield p + "input_layernorm.weight", layer["attn_norm"]
    for name in ("q", "k", "v"):
        yield f"{p}self_attn.{name}_proj.weight", _linear(layer[f"w{name}"])
    yield p + "self_attn.o_proj.weight", _linear(layer["wo"], in_axes=2)
    yield p + "post_attention_layernorm.weight", layer["mlp_norm"]
    yield from _swiglu(layer, p + "mlp.")


def _mla(layer: dict, p: str) -> Iterator[tuple[str, np.ndarray]]:
    a = p + "self_attn."
    yield p + "input_layernorm.weight", layer["attn_norm"]
    if "wq" in layer:
        yield a + "q_proj.weight", _linear(layer["wq"])
    else:
        yield a + "q_a_proj.weight", _linear(layer["wq_a"])
        yield a + "q_a_layernorm.weight", layer["q_norm"]
        yield a + "q_b_proj.weight", _linear(layer["wq_b"])
    yield a + "kv_a_proj_with_mqa.weight", _linear(layer["wkv_a"])
    yield a + "kv_a_layernorm.weight", layer["kv_norm"]
    yield a + "kv_b_proj.weight", _linear(layer["wkv_b"])
    yield a + "o_proj.weight", _linear(layer["wo"], in_axes=2)
    yield p + "post_attention_layernorm.weight", layer["mlp_norm"]


def _moe(layer: dict, p: str) -> Iterator[tuple[str, np.ndarray]]:
    m = p + "mlp."
    yield from _mla(layer, p)
    yield m + "gate.weight", _linear(layer["router"])
    yield m + "gate.e_score_correction_bias", layer["router_bias"]
    for e in range(layer["we_gate"].shape[0]):
        yield from _swiglu({k: v[e] for k, v in layer.items() if k.startswith("we_")},
                           f"{m}experts.{e}.", key="we")
    yield from _swiglu(layer, m + "shared_experts.")


def _layers(stacked: dict) -> Iterator[dict]:
    for i in range(next(iter(stacked.values())).shape[0] if stacked else 0):
        yield {k: v[i] for k, v in stacked.items()}


def hf_tensors(params: dict, cfg) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array in HF's layout) for every weight, in checkpoint order."""
    yield "model.embed_tokens.weight", params["embed"]
    if isinstance(cfg, LlamaConfig):
        for i, layer in enumerate(_layers(params["layers"])):
            yield from _llama_layer(layer, f"model.layers.{i}.")
    else:
        for i, layer in enumerate(_layers(params["dense_layers"])):
            yield from _mla(layer, f"model.layers.{i}.")
            yield from _swiglu(layer, f"model.layers.{i}.mlp.")
        for i, layer in enumerate(_layers(params["moe_layers"]), start=cfg.n_dense_layers):
            yield from _moe(layer, f"model.layers.{i}.")
    yield "model.norm.weight", params["final_norm"]
    yield "lm_head.weight", _linear(params["lm_head"])


def write_checkpoint(directory: Path, cfg: LlamaConfig | DeepSeekConfig, params: dict,
                     dtype: str = "float32", shard_bytes: int = 5 * 2**30) -> list[Path]:
    """config.json and the weights, one file or `model-0000k-of-0000n` files and their index.
    Files are written as each fills, so host memory holds the parameters and one file."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2))
    shards, current, size = [], {}, 0
    for name, array in hf_tensors(params, cfg):
        array = np.ascontiguousarray(np.asarray(array).astype(DTYPES[dtype]))
        if current and size + array.nbytes > shard_bytes:
            shards.append(_flush(directory, current, len(shards)))
            current, size = {}, 0
        current[name], size = array, size + array.nbytes
    shards.append(_flush(directory, current, len(shards)))
    return _name_shards(directory, shards)


def _flush(directory: Path, tensors: dict, index: int) -> tuple[Path, list[str], int]:
    path = directory / f"part-{index:05d}.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, list(tensors), sum(a.nbytes for a in tensors.values())


def _name_shards(directory: Path, shards: list) -> list[Path]:
    """Rename the parts as transformers expects, once their number is known."""
    if len(shards) == 1:
        return [shards[0][0].rename(directory / "model.safetensors")]
    paths, weight_map = [], {}
    for k, (path, names, _) in enumerate(shards, start=1):
        final = directory / f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        paths.append(path.rename(final))
        weight_map.update(dict.fromkeys(names, final.name))
    index = {"metadata": {"total_size": sum(n for *_, n in shards)}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return paths
