"""Generate the Hugging Face reference fixtures under tests/fixtures/.

Each fixture is a tiny random `transformers.LlamaForCausalLM` checkpoint
(config.json + safetensors) together with `expected.npz`, which holds the
input tokens, HF's float32 logits for them, HF's causal-LM loss and HF's
logits with the checkpoint loaded in bfloat16 (`logits_bfloat16`). The
tests load the checkpoint into the JAX model and compare against these
numbers, so they need neither torch nor transformers.

Only regenerating the fixtures needs torch and transformers:

    python -m venv /tmp/fixvenv
    /tmp/fixvenv/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors numpy
    /tmp/fixvenv/bin/python tests/tools/make_hf_fixtures.py

The output is deterministic (fixed seeds, CPU, float32 and then bfloat16, eager
attention).
"""

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "fixtures"

BATCH, SEQ_LEN = 2, 40

# Llama 3.1's RoPE scaling constants. `original_max_position_embeddings` is
# shrunk from 8192 to 64 so that the tiny heads' few frequencies land in all
# three llama3 bands (checked by `assert_llama3_bands_covered`).
LLAMA3_FACTOR = 8.0
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_MAX_POS = 64

# HF's default init (std 0.02, norm weights exactly 1) gives near-uniform
# logits and hides bugs such as ignoring norm weights or using the `1 + w`
# (Gemma-style) convention. Larger weights give logits of order 1-10, and
# norm weights away from 1 make the norm-weight convention observable.
WEIGHT_STD = 0.2
NORM_WEIGHT_JITTER = 0.2


@dataclass(frozen=True)
class Fixture:
    name: str
    seed: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    max_shard_size: str | None = None  # None: one model.safetensors file


FIXTURES = [
    Fixture(
        name="llama_gqa", seed=0, vocab_size=97, hidden_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
        rope_theta=10_000.0,
    ),
    # A different rope_theta from llama_gqa so a hard-coded theta is caught.
    Fixture(
        name="llama_sharded", seed=1, vocab_size=83, hidden_size=48, num_layers=3,
        num_heads=6, num_kv_heads=2, head_dim=8, intermediate_size=80,
        rope_theta=5_000.0, max_shard_size="40KB",
    ),
]


def make_config(fx: Fixture) -> LlamaConfig:
    # transformers 5.x takes rope_theta and the scaling parameters together in
    # one `rope_parameters` dict (the old top-level `rope_theta` and
    # `rope_scaling` keys are deprecated), and writes it to config.json as is.
    rope_parameters = {
        "rope_type": "llama3",
        "rope_theta": fx.rope_theta,
        "factor": LLAMA3_FACTOR,
        "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POS,
    }
    return LlamaConfig(
        vocab_size=fx.vocab_size,
        hidden_size=fx.hidden_size,
        intermediate_size=fx.intermediate_size,
        num_hidden_layers=fx.num_layers,
        num_attention_heads=fx.num_heads,
        num_key_value_heads=fx.num_kv_heads,
        head_dim=fx.head_dim,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters=rope_parameters,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="eager",
    )


def assert_llama3_bands_covered(head_dim: int, rope_theta: float) -> None:
    """Check that the head's RoPE frequencies hit every llama3 band.

    llama3 keeps frequencies whose wavelength is below orig/high_freq_factor,
    divides by `factor` those above orig/low_freq_factor and interpolates in
    between; a fixture only tests all three branches if each has a member.
    """
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2) / head_dim)
    wavelength = 2 * math.pi / inv_freq
    high_freq_wavelength = LLAMA3_ORIGINAL_MAX_POS / LLAMA3_HIGH_FREQ_FACTOR
    low_freq_wavelength = LLAMA3_ORIGINAL_MAX_POS / LLAMA3_LOW_FREQ_FACTOR
    kept = wavelength < high_freq_wavelength
    divided = wavelength > low_freq_wavelength
    interpolated = ~kept & ~divided
    assert kept.any() and interpolated.any() and divided.any(), (
        f"head_dim={head_dim}, theta={rope_theta}: wavelengths {wavelength} do not "
        f"cover all llama3 bands ({high_freq_wavelength}, {low_freq_wavelength})"
    )


def assert_config_json_has_llama3(model_dir: Path) -> None:
    """Make sure the scaling survived serialisation, not just the in-memory config."""
    rope = json.loads((model_dir / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "llama3", rope
    assert rope["factor"] == LLAMA3_FACTOR, rope
    assert rope["original_max_position_embeddings"] == LLAMA3_ORIGINAL_MAX_POS, rope


@torch.no_grad()
def reinitialise(model: LlamaForCausalLM, generator: torch.Generator) -> None:
    """Overwrite HF's default init with larger weights and non-trivial norms."""
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
        if name.endswith("norm.weight"):  # input/post-attention layernorms, final norm
            param.copy_(1.0 + NORM_WEIGHT_JITTER * noise)
        else:  # embeddings, attention/MLP projections, lm_head
            param.copy_(WEIGHT_STD * noise)


def save_checkpoint(model: LlamaForCausalLM, fx: Fixture, out_dir: Path) -> None:
    # transformers 5.x always writes safetensors (`safe_serialization` is gone).
    if fx.max_shard_size is None:
        model.save_pretrained(out_dir)
        assert (out_dir / "model.safetensors").exists()
    else:
        model.save_pretrained(out_dir, max_shard_size=fx.max_shard_size)
        assert (out_dir / "model.safetensors.index.json").exists()
        assert len(list(out_dir.glob("model-*-of-*.safetensors"))) > 1
    # The JAX loader only needs config.json and the weights.
    (out_dir / "generation_config.json").unlink(missing_ok=True)


@torch.no_grad()
def save_expected_outputs(
    model: LlamaForCausalLM, fx: Fixture, generator: torch.Generator, out_dir: Path
) -> dict:
    tokens = torch.randint(0, fx.vocab_size, (BATCH, SEQ_LEN), generator=generator)
    # labels=input_ids: HF shifts internally and averages the next-token cross
    # entropy over all BATCH * (SEQ_LEN - 1) positions.
    out = model(input_ids=tokens, labels=tokens)
    logits = out.logits.numpy().astype(np.float32)
    loss = np.float32(out.loss.item())
    np.savez(
        out_dir / "expected.npz",
        tokens=tokens.numpy().astype(np.int32),
        logits=logits,
        loss=loss,
        logits_bfloat16=bfloat16_logits(out_dir, tokens),
    )
    return {"max_abs_logit": float(np.abs(logits).max()), "loss": float(loss)}


@torch.no_grad()
def bfloat16_logits(out_dir: Path, tokens: torch.Tensor) -> np.ndarray:
    """HF's logits for `tokens` with the saved checkpoint loaded in bfloat16, as float32.

    Loaded as transformers loads a bf16 model (`from_pretrained(dtype=torch.bfloat16)`):
    every weight and activation in bf16, RMSNorm statistics, RoPE angles and the attention
    softmax in float32 inside HF's modules. Not `model.to(torch.bfloat16)`, which would also
    round the RoPE inverse frequencies (a buffer, kept float32 by loading) to bf16.
    """
    model = LlamaForCausalLM.from_pretrained(
        out_dir, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    return model(input_ids=tokens).logits.float().numpy()


def build_fixture(fx: Fixture) -> None:
    assert_llama3_bands_covered(fx.head_dim, fx.rope_theta)
    generator = torch.Generator().manual_seed(fx.seed)
    torch.manual_seed(fx.seed)  # HF's own init, which is overwritten anyway

    model = LlamaForCausalLM(make_config(fx)).to(torch.float32).eval()
    reinitialise(model, generator)

    out_dir = FIXTURES_DIR / fx.name
    shutil.rmtree(out_dir, ignore_errors=True)
    save_checkpoint(model, fx, out_dir)
    assert_config_json_has_llama3(out_dir)
    stats = save_expected_outputs(model, fx, generator, out_dir)

    files = sorted(p.name for p in out_dir.iterdir())
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{fx.name}: files={files} params={n_params} "
        f"max|logit|={stats['max_abs_logit']:.3f} loss={stats['loss']:.6f}"
    )


def main() -> None:
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for fx in FIXTURES:
        build_fixture(fx)


if __name__ == "__main__":
    main()
