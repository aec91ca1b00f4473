"""Where each of our parameters lies in a Hugging Face checkpoint, per family: the tables
hf/load.py reads and hf/save.py writes (as torchtitan keeps a state-dict adapter beside each
model), so that nothing in model/ knows Hugging Face's names."""

import dataclasses
from functools import partial

from model.config import DeepSeekConfig, LlamaConfig


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


def layer_tensor(name: str, n_in: int = 0, first: int = 0, fused=None) -> HfTensor:
    """The stacked layer tensor `model.layers.{layer}.<name>.weight`, a linear one with `n_in`
    in axes (0: not linear); `fused` names its fused tensor under the same layer prefix."""
    return HfTensor(f"model.layers.{{layer}}.{name}.weight", bool(n_in), n_in or 1, first,
                    fused and (f"model.layers.{{layer}}.{fused[0]}", *fused[1:]))


def swiglu_tensors(prefix: str, first: int = 0) -> dict:
    """A SwiGLU's weights (model/layers.py swiglu_specs), HF's `<prefix>gate_proj` and so on."""
    return {f"w_{part}": layer_tensor(f"{prefix}{part}_proj", 1, first)
            for part in ("gate", "up", "down")}


def _llama(cfg: LlamaConfig) -> dict:
    """Each parameter's tensor in a Hugging Face `LlamaForCausalLM` checkpoint."""
    return {"embed": HfTensor("model.embed_tokens.weight"),
            "layers": {"attn_norm": layer_tensor("input_layernorm"),
                       **{f"w{x}": layer_tensor(f"self_attn.{x}_proj", 1) for x in "qkv"},
                       "wo": layer_tensor("self_attn.o_proj", 2),
                       "mlp_norm": layer_tensor("post_attention_layernorm"),
                       **swiglu_tensors("mlp.")},
            "final_norm": HfTensor("model.norm.weight"),
            "lm_head": HfTensor("lm_head.weight", linear=True, tied="model.embed_tokens.weight")}


def _deepseek(cfg: DeepSeekConfig) -> dict:
    """Each parameter's tensor in a Hugging Face `DeepseekV3ForCausalLM` checkpoint: routed
    experts one tensor per expert (the released checkpoint) or fused (`experts.gate_up_proj`
    [E, 2F, D], `experts.down_proj`); multi-token prediction layers are not read."""
    def layer(first: int, mlp: dict) -> dict:
        t = partial(layer_tensor, first=first)
        query = ({"wq": t("self_attn.q_proj", 1)} if cfg.q_lora_rank is None else
                 {"wq_a": t("self_attn.q_a_proj", 1), "q_norm": t("self_attn.q_a_layernorm"),
                  "wq_b": t("self_attn.q_b_proj", 1)})
        return {"attn_norm": t("input_layernorm"), **query,
                "wkv_a": t("self_attn.kv_a_proj_with_mqa", 1),
                "kv_norm": t("self_attn.kv_a_layernorm"), "wkv_b": t("self_attn.kv_b_proj", 1),
                "wo": t("self_attn.o_proj", 2), "mlp_norm": t("post_attention_layernorm"), **mlp}

    first_moe, gate_up = cfg.n_dense_layers, "mlp.experts.gate_up_proj"
    moe = partial(layer_tensor, first=first_moe)
    return {
        "embed": HfTensor("model.embed_tokens.weight"),
        "dense_layers": layer(0, swiglu_tensors("mlp.")),
        "moe_layers": layer(first_moe, {
            "router": moe("mlp.gate", 1),
            "router_bias": HfTensor("model.layers.{layer}.mlp.gate.e_score_correction_bias",
                                    first_layer=first_moe),
            "we_gate": moe("mlp.experts.{expert}.gate_proj", 1, fused=(gate_up, 0, 2)),
            "we_up": moe("mlp.experts.{expert}.up_proj", 1, fused=(gate_up, 1, 2)),
            "we_down": moe("mlp.experts.{expert}.down_proj", 1,
                           fused=("mlp.experts.down_proj", 0, 1)),
            **swiglu_tensors("mlp.shared_experts.", first_moe)}),
        "final_norm": HfTensor("model.norm.weight"),
        "lm_head": HfTensor("lm_head.weight", linear=True, tied="model.embed_tokens.weight"),
    }


def tensors(cfg) -> dict:
    """Each parameter's Hugging Face tensor, in the parameter tree's shape."""
    return _llama(cfg) if isinstance(cfg, LlamaConfig) else _deepseek(cfg)
