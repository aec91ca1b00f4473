"""Architecture configs. No JAX import: configs/ reads these before JAX starts."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 frequency scaling (`rope_type: "llama3"` in the released configs)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama-3-style dense decoder. Letters as in the README glossary."""
    vocab: int  # V
    d_model: int  # D
    n_layers: int  # L
    n_heads: int  # N, query heads
    n_kv_heads: int  # K, key/value heads; N/K query heads share one (GQA)
    head_dim: int  # H
    d_ff: int  # F
    rope_theta: float = 500_000.0
    rope_scaling: Llama3RopeScaling | None = Llama3RopeScaling()
    max_position: int = 131_072  # the longest sequence the RoPE frequencies are made for
    norm_eps: float = 1e-5

    def problems(self) -> list[str]:
        """Every impossible setting, one line each; empty when the config is sound."""
        if found := _out_of_range(self):
            return found
        if self.n_heads % self.n_kv_heads:
            found.append(f"model.n_heads={self.n_heads} is not divisible by "
                         f"model.n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            found.append(f"model.head_dim={self.head_dim} must be even for rotary embeddings")
        if (scaling := self.rope_scaling) and scaling.low_freq_factor >= scaling.high_freq_factor:
            found.append("model.rope_scaling.low_freq_factor must be below high_freq_factor")
        return found


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling as the reference computes it (`rope_type: "yarn"`)."""
    factor: float = 40.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = 1.0
    mscale_all_dim: float | None = 1.0
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class DeepSeekConfig:
    """A DeepSeek-V3-style decoder: MLA, dense then MoE layers. Letters as in the README."""
    vocab: int  # V
    d_model: int  # D
    n_layers: int  # L, dense and MoE together
    n_dense_layers: int  # the first layers use a dense MLP (`first_k_dense_replace`)
    n_heads: int  # N
    q_lora_rank: int | None  # R of the query down-projection; None: a plain q_proj
    kv_lora_rank: int  # R of the compressed key/value latent
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    d_ff: int  # F of the dense layers
    moe_d_ff: int  # F of each routed (and each shared) expert
    n_experts: int  # E
    experts_per_token: int
    n_shared_experts: int
    n_groups: int  # experts are split in this many groups; a token's experts come from
    topk_groups: int  # this many of them
    routed_scaling: float
    norm_topk_prob: bool = True
    rope_theta: float = 10_000.0
    rope_interleave: bool = True  # rope dims as interleaved pairs (2i, 2i+1); else rotate-half
    rope_scaling: YarnScaling | None = YarnScaling()
    max_position: int = 163_840
    norm_eps: float = 1e-6

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    def problems(self) -> list[str]:
        if found := _out_of_range(self):
            return found
        if self.n_dense_layers >= self.n_layers:
            found.append(f"model.n_dense_layers must be below model.n_layers={self.n_layers}")
        if self.v_head_dim > self.qk_nope_dim + self.qk_rope_dim:
            found.append("model.v_head_dim must not exceed qk_nope_dim + qk_rope_dim")
        if (yarn := self.rope_scaling) and yarn.beta_slow >= yarn.beta_fast:
            found.append("model.rope_scaling.beta_slow must be below beta_fast")
        if self.n_experts % self.n_groups:
            found.append(f"model.n_experts={self.n_experts} is not divisible by "
                         f"model.n_groups={self.n_groups}")
        if self.topk_groups > self.n_groups:
            found.append("model.topk_groups exceeds model.n_groups")
        if self.n_experts // self.n_groups < 2:
            found.append("each expert group needs at least 2 experts (groups score by top-2)")
        if self.experts_per_token > self.topk_groups * (self.n_experts // self.n_groups):
            found.append("model.experts_per_token exceeds the experts of the kept groups")
        if self.qk_rope_dim % 2:
            found.append(f"model.qk_rope_dim={self.qk_rope_dim} must be even")
        return found


def _out_of_range(config, prefix: str = "") -> list[str]:
    """Numbers of `config` (and its groups) out of range: first, lest combinations say it again."""
    found = []
    for f in dataclasses.fields(config):
        key, value = prefix + f.name, getattr(config, f.name)
        zero_taken = f.name in ("mscale", "mscale_all_dim")  # YaRN's: as None, HF's default
        if dataclasses.is_dataclass(value):
            found += _out_of_range(value, key + ".")
        elif type(value) in (int, float) and not (value >= 0 if zero_taken else value > 0):
            allowed = ">= 0 (0 or none: Hugging Face's default)" if zero_taken else "> 0"
            found.append(f"model.{key}={value!r} must be {allowed}")
    return found
