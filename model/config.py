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
        found = [f"model.{f.name} must be positive, got {getattr(self, f.name)}"
                 for f in dataclasses.fields(self)
                 if type(getattr(self, f.name)) in (int, float) and getattr(self, f.name) <= 0]
        if self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads:
            found.append(f"model.n_heads={self.n_heads} is not divisible by "
                         f"model.n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            found.append(f"model.head_dim={self.head_dim} must be even for rotary embeddings")
        scaling = self.rope_scaling
        if scaling and not (0 < scaling.low_freq_factor < scaling.high_freq_factor
                            and scaling.factor > 0 and scaling.original_max_position > 0):
            found.append("model.rope_scaling: factor and original_max_position must be "
                         "positive, and 0 < low_freq_factor < high_freq_factor")
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
        found = [f"model.{f.name} must be positive, got {getattr(self, f.name)}"
                 for f in dataclasses.fields(self) if f.name != "n_dense_layers"
                 and type(getattr(self, f.name)) in (int, float) and getattr(self, f.name) <= 0]
        if not 0 < self.n_dense_layers < self.n_layers:
            found.append(f"model.n_dense_layers={self.n_dense_layers}: at least one dense and "
                         f"one MoE layer (1..{self.n_layers - 1})")
        if self.v_head_dim > self.qk_nope_dim + self.qk_rope_dim:
            found.append("model.v_head_dim must not exceed qk_nope_dim + qk_rope_dim")
        yarn = self.rope_scaling
        if yarn and not (yarn.factor > 0 and yarn.original_max_position > 0
                         and yarn.beta_fast > yarn.beta_slow > 0):
            found.append("model.rope_scaling: factor and original_max_position must be "
                         "positive, and beta_fast > beta_slow > 0")
        if self.n_groups > 0 and self.n_experts % self.n_groups:
            found.append(f"model.n_experts={self.n_experts} is not divisible by "
                         f"model.n_groups={self.n_groups}")
        if self.topk_groups > self.n_groups:
            found.append("model.topk_groups exceeds model.n_groups")
        if self.n_groups > 0 and self.n_experts // self.n_groups < 2:
            found.append("each expert group needs at least 2 experts (groups score by top-2)")
        if self.experts_per_token > self.topk_groups * (self.n_experts // max(self.n_groups, 1)):
            found.append("model.experts_per_token exceeds the experts of the kept groups")
        if self.qk_rope_dim % 2:
            found.append(f"model.qk_rope_dim={self.qk_rope_dim} must be even")
        return found
