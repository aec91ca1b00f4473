"""Architecture configs. No JAX import: configs/ reads these before JAX starts."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 frequency scaling (`rope_type: "llama3"` in Hugging Face configs)."""
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
        if scaling and scaling.high_freq_factor <= scaling.low_freq_factor:
            found.append("model.rope_scaling.high_freq_factor must exceed low_freq_factor")
        return found
