"""Hugging Face checkpoints (Llama, DeepSeek-V3) -> (model config, params).

HF linear weights are stored [out, in]; ours are [in, out], with heads split out. Each
parameter is described by where its values lie in the HF tensors (a `Source`), so it can be
read whole (one process) or only in the slices this process's devices hold (multi-host).
"""

import dataclasses
import math
from pathlib import Path

import jax
import numpy as np

from model import deepseek, llama
from model.checkpoint import CheckpointError, Reader, check_shapes, read_json
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


@dataclasses.dataclass(frozen=True)
class Source:
    """One of our parameters as Hugging Face tensors, read a slice at a time.

    `names` holds the HF tensor of each stacked entry (layers, then experts): its shape leads
    `shape`. `n_in` None: a tensor is ours as stored. Else it is [*batch, out, in] (`batch`
    leading axes: a fused expert axis), HF's linear layout, and becomes ours transposed,
    [*batch, *ins, *outs]: its in axis split into our next `n_in` axes, its out axis (from
    row `first_row`: the up half of a fused gate and up) into the rest (heads split out)."""
    names: np.ndarray
    shape: tuple[int, ...]
    n_in: int | None = None
    batch: int = 0
    first_row: int = 0

    def read(self, reader: Reader, index: tuple[slice, ...] = ()) -> np.ndarray:
        """self[index] as float32, reading only that slice (and, where ours splits heads out of
        one HF axis and a slice cuts through an inner one, whole rows of the outer one)."""
        index = tuple(slice(*s.indices(n)[:2])
                      for s, n in zip(index or [slice(None)] * len(self.shape), self.shape))
        names = self.names[(*index[:self.names.ndim], Ellipsis)]
        parts = [self._read_one(reader, name, index[self.names.ndim:]) for name in names.flat]
        return np.stack(parts).reshape(names.shape + parts[0].shape)

    def _read_one(self, reader: Reader, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if self.n_in is None:
            return reader.read(name, index)
        b, i = self.batch, self.batch + self.n_in
        dims = self.shape[self.names.ndim:]
        cols, rows = _covering(index[b:i], dims[b:i]), _covering(index[i:], dims[i:])
        rows = slice(rows.start + self.first_row, rows.stop + self.first_row)
        x = np.swapaxes(reader.read(name, (*index[:b], rows, cols)), -1, -2)
        x = x.reshape(*x.shape[:b], index[b].stop - index[b].start, *dims[b + 1:i],
                      index[i].stop - index[i].start, *dims[i + 1:])
        whole = (slice(None),)
        return x[whole * (b + 1) + index[b + 1:i] + whole + index[i + 1:]]


def _covering(index: tuple[slice, ...], dims: tuple[int, ...]) -> slice:
    """The range of one axis of size prod(dims) that, split into `dims`, covers `index`:
    whole inner axes of the outer axis's slice."""
    inner = math.prod(dims[1:])
    return slice(index[0].start * inner, index[0].stop * inner)


class _Sources:
    """Sources from a checkpoint's named HF tensors, their shapes checked against config.json."""

    def __init__(self, reader: Reader):
        self.reader = reader

    def __call__(self, name: str, ins=None, outs=None, *, transpose=True, batch=0,
                 first_row=0, rows=0) -> Source:
        """`ins`/`outs`: our axes from HF's in/out axis (default: as they are); `rows`: the
        out axis's size where it holds more than ours (fused gate and up)."""
        if name not in self.reader:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}")
        stored = self.reader.shapes[name]
        if not transpose or len(stored) < 2:
            return Source(np.array(name, object), stored)
        ins, outs = ins or stored[-1:], outs or stored[-2:-1]
        expected = (*stored[:batch], rows or math.prod(outs), math.prod(ins))
        if stored != expected:
            raise CheckpointError(f"{name}: shape {stored} does not fit config.json "
                                  f"({expected})")
        return Source(np.array(name, object), (*stored[:batch], *ins, *outs), len(ins), batch,
                      first_row)


def _stack(entries: list[dict]) -> dict:
    """Sources of each entry (layer or expert) stacked on a new leading axis."""
    def stack(key):
        first = entries[0][key]
        layout = (first.shape, first.n_in, first.batch, first.first_row)
        if any((e[key].shape, e[key].n_in, e[key].batch, e[key].first_row) != layout
               for e in entries):
            raise CheckpointError(f"{first.names.flat[0]} and its peers differ in shape")
        return dataclasses.replace(first, names=np.stack([e[key].names for e in entries]),
                                   shape=(len(entries), *first.shape))
    return {key: stack(key) for key in entries[0]}


def _ends(get: _Sources) -> dict:
    embed = "model.embed_tokens.weight"
    head = "lm_head.weight" if "lm_head.weight" in get.reader else embed  # tied embeddings
    return {"embed": get(embed, transpose=False), "final_norm": get("model.norm.weight"),
            "lm_head": get(head)}


def llama_params(get: _Sources, cfg: LlamaConfig) -> dict:
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def layer(p):
        return {"attn_norm": get(p + "input_layernorm.weight"),
                "wq": get(p + "self_attn.q_proj.weight", (D,), (N, H)),
                "wk": get(p + "self_attn.k_proj.weight", (D,), (K, H)),
                "wv": get(p + "self_attn.v_proj.weight", (D,), (K, H)),
                "wo": get(p + "self_attn.o_proj.weight", (N, H), (D,)),
                "mlp_norm": get(p + "post_attention_layernorm.weight"),
                **_swiglu(get, p + "mlp.")}

    layers = [layer(f"model.layers.{i}.") for i in range(cfg.n_layers)]
    return {**_ends(get), "layers": _stack(layers)}


def _swiglu(get: _Sources, prefix: str) -> dict:
    return {"w_gate": get(prefix + "gate_proj.weight"), "w_up": get(prefix + "up_proj.weight"),
            "w_down": get(prefix + "down_proj.weight")}


def _mla(get: _Sources, p: str, cfg: DeepSeekConfig) -> dict:
    D, N, R = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank
    qk = cfg.qk_nope_dim + cfg.qk_rope_dim
    a = p + "self_attn."
    if cfg.q_lora_rank is None:
        query = {"wq": get(a + "q_proj.weight", (D,), (N, qk))}
    else:
        query = {"wq_a": get(a + "q_a_proj.weight"), "q_norm": get(a + "q_a_layernorm.weight"),
                 "wq_b": get(a + "q_b_proj.weight", (cfg.q_lora_rank,), (N, qk))}
    return {"attn_norm": get(p + "input_layernorm.weight"), **query,
            "wkv_a": get(a + "kv_a_proj_with_mqa.weight"),
            "kv_norm": get(a + "kv_a_layernorm.weight"),
            "wkv_b": get(a + "kv_b_proj.weight", (R,), (N, cfg.qk_nope_dim + cfg.v_head_dim)),
            "wo": get(a + "o_proj.weight", (N, cfg.v_head_dim), (D,)),
            "mlp_norm": get(p + "post_attention_layernorm.weight")}


def _experts(get: _Sources, m: str, cfg: DeepSeekConfig) -> dict:
    """Routed experts, stored unfused on disk (experts.{e}.{gate,up,down}_proj) or fused as
    transformers keeps them in memory (experts.gate_up_proj [E, 2F, D], experts.down_proj)."""
    D, E, F = cfg.d_model, cfg.n_experts, cfg.moe_d_ff
    if m + "experts.gate_up_proj" in get.reader:
        fused = m + "experts.gate_up_proj"
        return {"we_gate": get(fused, (D,), (F,), batch=1, rows=2 * F),
                "we_up": get(fused, (D,), (F,), batch=1, rows=2 * F, first_row=F),
                "we_down": get(m + "experts.down_proj", (F,), (D,), batch=1)}
    per_expert = [_swiglu(get, f"{m}experts.{e}.") for e in range(E)]
    return {"we" + k[1:]: v for k, v in _stack(per_expert).items()}


def deepseek_params(get: _Sources, cfg: DeepSeekConfig) -> dict:
    def moe_layer(p):
        m = p + "mlp."
        return {**_mla(get, p, cfg), "router": get(m + "gate.weight"),
                "router_bias": get(m + "gate.e_score_correction_bias"),
                **_experts(get, m, cfg), **_swiglu(get, m + "shared_experts.")}

    prefixes = [f"model.layers.{i}." for i in range(cfg.n_layers)]  # later ones: MTP, unused
    dense = [{**_mla(get, p, cfg), **_swiglu(get, p + "mlp.")}
             for p in prefixes[:cfg.n_dense_layers]]
    moe = [moe_layer(p) for p in prefixes[cfg.n_dense_layers:]]
    return {**_ends(get), "dense_layers": _stack(dense), "moe_layers": _stack(moe)}


FAMILIES = {"llama": (llama_config, llama_params, llama.param_specs),
            "deepseek_v3": (deepseek_config, deepseek_params, deepseek.param_specs)}


def _is_source(x) -> bool:
    return isinstance(x, Source)


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint's parameters before any is read: `sources` has the param tree's shape."""
    reader: Reader
    sources: dict

    def read(self) -> dict:
        """Every parameter whole, as fp32 numpy arrays."""
        return jax.tree.map(lambda s: s.read(self.reader), self.sources, is_leaf=_is_source)

    def arrays(self, shardings, dtype) -> dict:
        """Every parameter as a jax.Array with its sharding: this process reads only the
        slices its own devices hold, each once (replicated ones are shared by its devices)."""
        def array(source: Source, sharding):
            slices = {}

            def read(index):
                key = tuple(s.indices(n)[:2] for s, n in zip(index, source.shape))
                if key not in slices:
                    slices[key] = source.read(self.reader, index).astype(dtype)
                return slices[key]

            return jax.make_array_from_callback(source.shape, sharding, read)

        return jax.tree.map(array, self.sources, shardings, is_leaf=_is_source)


def open_checkpoint(directory: str | Path):
    """(config, Checkpoint) from a Hugging Face checkpoint directory: config.json and the
    tensors' names and shapes (checked against it) are read; no weights yet."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    hf = read_json(directory / "config.json")
    if not isinstance(hf, dict):
        raise CheckpointError(f"{directory}/config.json: not a JSON object")
    family = hf.get("model_type", "llama")
    if family not in FAMILIES:
        raise CheckpointError(f"model_type {family!r} is not one of {', '.join(FAMILIES)}")
    make_config, make_sources, make_specs = FAMILIES[family]
    try:
        cfg = make_config(hf)
    except KeyError as e:
        raise CheckpointError(f"{directory}/config.json lacks {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{directory}/config.json: a value of the wrong type ({e})") from None
    if problems := cfg.problems():
        raise CheckpointError(f"{directory}/config.json: {problems[0]}")
    reader = Reader(directory)
    sources = make_sources(_Sources(reader), cfg)
    check_shapes(sources, make_specs(cfg))
    return cfg, Checkpoint(reader, sources)


def load_checkpoint(directory: str | Path):
    """(config, fp32 numpy params) from a Hugging Face checkpoint directory, read whole."""
    cfg, checkpoint = open_checkpoint(directory)
    return cfg, checkpoint.read()
