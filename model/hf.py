"""Load a Hugging Face Llama checkpoint directory into (LlamaConfig, params).

Reads config.json and model.safetensors, or model.safetensors.index.json and its shards.
HF linear weights are stored [out, in]; ours are [in, out] with heads split out.
"""

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from model.common import param_count
from model.config import Llama3RopeScaling, LlamaConfig
from model.llama import param_specs


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or not a Llama this code can run."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _rope_fields(hf: dict) -> tuple[float, Llama3RopeScaling | None]:
    """transformers 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise CheckpointError(f"rope_type {kind!r} is not supported (only default and llama3)")
    return float(theta), Llama3RopeScaling(
        factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position=int(rope.get("original_max_position_embeddings",
                                           hf.get("max_position_embeddings", 8192))))


def config_from_hf(hf: dict) -> LlamaConfig:
    if hf.get("model_type") not in (None, "llama"):
        raise CheckpointError(f"model_type {hf['model_type']!r} is not a Llama")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise CheckpointError("checkpoints with attention or MLP biases are not supported")
    try:
        heads = int(hf["num_attention_heads"])
        theta, scaling = _rope_fields(hf)
        return LlamaConfig(
            vocab=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            d_ff=int(hf["intermediate_size"]), rope_theta=theta, rope_scaling=scaling,
            max_position=int(hf.get("max_position_embeddings", 131_072)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)))
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e.args[0]!r}") from None


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map")
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{directory}: neither model.safetensors nor an index file")
    return [single]


def read_tensors(directory: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for file in _safetensors_files(directory):
        try:
            with safe_open(file, framework="numpy") as f:
                tensors.update({name: f.get_tensor(name) for name in f.keys()})
        except FileNotFoundError:
            raise CheckpointError(f"{file}: no such file (named by the index)") from None
        except Exception as e:  # safetensors raises its own types for truncated/corrupt files
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None
    return tensors


def params_from_hf(tensors: dict[str, np.ndarray], cfg: LlamaConfig) -> dict:
    """Our parameter tree (fp32 numpy) from HF tensor names; shapes checked against the specs."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def get(name):
        if name not in tensors:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}")
        return np.asarray(tensors[name], np.float32)

    def layer(i):
        p = f"model.layers.{i}."
        return {
            "attn_norm": get(p + "input_layernorm.weight"),
            "wq": get(p + "self_attn.q_proj.weight").T.reshape(D, N, H),
            "wk": get(p + "self_attn.k_proj.weight").T.reshape(D, K, H),
            "wv": get(p + "self_attn.v_proj.weight").T.reshape(D, K, H),
            "wo": get(p + "self_attn.o_proj.weight").T.reshape(N, H, D),
            "mlp_norm": get(p + "post_attention_layernorm.weight"),
            "w_gate": get(p + "mlp.gate_proj.weight").T,
            "w_up": get(p + "mlp.up_proj.weight").T,
            "w_down": get(p + "mlp.down_proj.weight").T,
        }

    try:
        layers = [layer(i) for i in range(cfg.n_layers)]
    except ValueError as e:  # a reshape that does not fit: the tensor disagrees with config.json
        raise CheckpointError(f"a tensor does not match config.json: {e}") from None
    embed = get("model.embed_tokens.weight")
    head = get("lm_head.weight") if "lm_head.weight" in tensors else embed  # tied embeddings
    params = {
        "embed": embed,
        "layers": {k: np.stack([layer[k] for layer in layers]) for k in layers[0]},
        "final_norm": get("model.norm.weight"),
        "lm_head": head.T,
    }
    _check_shapes(params, param_specs(cfg))
    return params


def _check_shapes(params: dict, specs: dict) -> None:
    flat = [("", params, specs)]
    while flat:
        path, p, s = flat.pop()
        if isinstance(s, dict):
            flat += [(f"{path}/{k}", p[k], s[k]) for k in s]
        elif p.shape != s.shape:
            raise CheckpointError(f"{path}: shape {p.shape} in the checkpoint, {s.shape} expected")


def load_llama(directory: str | Path) -> tuple[LlamaConfig, dict]:
    """(config, fp32 numpy params) from a Hugging Face Llama checkpoint directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    cfg = config_from_hf(_read_json(directory / "config.json"))
    if problems := cfg.problems():
        raise CheckpointError(f"{directory}/config.json: {problems[0]}")
    params = params_from_hf(read_tensors(directory), cfg)
    assert sum(a.size for a in _leaves(params)) == param_count(param_specs(cfg))
    return cfg, params


def _leaves(tree):
    return [x for v in tree.values() for x in (_leaves(v) if isinstance(v, dict) else [v])]
