"""Generate the DeepSeek-V3 reference fixtures under tests/fixtures/.

Each fixture is a tiny random `transformers.DeepseekV3ForCausalLM` checkpoint
(config.json + safetensors) together with `expected.npz`, which holds the
input tokens, HF's float32 logits for them, HF's causal-LM loss and HF's
logits with the checkpoint loaded in bfloat16 (`logits_bfloat16`). The
tests load the checkpoint into the JAX model and compare against these
numbers, so they need neither torch nor transformers.

The two fixtures cover MLA with and without the q LoRA, interleaved and
rotate-half RoPE, YaRN (with equal and unequal mscale/mscale_all_dim),
group-limited sigmoid routing whose choices are changed by
`e_score_correction_bias`, normalised and unnormalised top-k weights, a
dense first layer and a one-file and a sharded checkpoint.

Only regenerating the fixtures needs torch and transformers:

    python -m venv /tmp/fixvenv
    /tmp/fixvenv/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors numpy
    /tmp/fixvenv/bin/python tests/tools/make_deepseek_fixtures.py

The output is deterministic (fixed seeds, CPU, float32 and then bfloat16,
eager attention, eager experts).
"""

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "fixtures"

BATCH, SEQ_LEN = 2, 40

# HF's default init (std 0.02, norm weights exactly 1, zero correction bias)
# gives near-uniform logits and routing that no bias can sway. Larger weights
# give logits of order 1-10, and norm weights away from 1 make the
# norm-weight convention observable (also for q_a/kv_a_layernorm).
WEIGHT_STD = 0.2
NORM_WEIGHT_JITTER = 0.2
# Sigmoid scores of router logits of order 1 are spread over ~(0.2, 0.8), so
# a bias of this size reorders some experts but not all (checked by
# `assert_bias_changes_routing`).
CORRECTION_BIAS_STD = 0.15


@dataclass(frozen=True)
class Fixture:
    name: str
    seed: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    first_k_dense_replace: int
    num_heads: int
    q_lora_rank: int | None  # None: plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int  # each routed expert; shared experts are n_shared times this
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    n_shared_experts: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rope_interleave: bool
    rope_theta: float
    yarn_factor: float
    yarn_original_max_pos: int
    yarn_beta_fast: float
    yarn_beta_slow: float
    yarn_mscale: float
    yarn_mscale_all_dim: float
    # Whether some RoPE frequency must be strictly between kept and divided.
    require_mixed_frequency: bool
    max_shard_size: str | None = None  # None: one model.safetensors file


FIXTURES = [
    # v_head_dim (12) != qk head dim (8 + 8) so a model that assumes they are
    # equal fails. original_max_position_embeddings is 64 rather than 16: at
    # 16 the (floored/ceiled) YaRN correction range is [0, 1], so every
    # frequency is either kept or divided and the ramp's blend is never used;
    # at 64 it is [0, 2] and the second frequency is a 50/50 mix.
    Fixture(
        name="deepseek_yarn", seed=0, vocab_size=101, hidden_size=64, num_layers=3,
        first_k_dense_replace=1, num_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_interleave=True, rope_theta=10_000.0,
        yarn_factor=4.0, yarn_original_max_pos=64, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
        yarn_mscale=1.0, yarn_mscale_all_dim=1.0, require_mixed_frequency=True,
    ),
    # Unequal mscale / mscale_all_dim make YaRN's cos/sin factor != 1, and a
    # different factor and rope_theta catch hard-coded values. With a rope
    # head dim of 4 there are only two frequencies: one kept, one divided.
    Fixture(
        name="deepseek_halfrot", seed=1, vocab_size=89, hidden_size=48, num_layers=3,
        first_k_dense_replace=1, num_heads=3, q_lora_rank=None, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        intermediate_size=80, moe_intermediate_size=24,
        n_routed_experts=6, num_experts_per_tok=3, n_group=2, topk_group=1,
        n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.7,
        rope_interleave=False, rope_theta=5_000.0,
        yarn_factor=8.0, yarn_original_max_pos=16, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
        yarn_mscale=0.7, yarn_mscale_all_dim=1.3, require_mixed_frequency=False,
        max_shard_size="100KB",
    ),
]


def rope_parameters(fx: Fixture) -> dict:
    # transformers 5.x takes rope_theta and the YaRN parameters together in one
    # `rope_parameters` dict (the old top-level `rope_theta` / `rope_scaling`
    # keys are deprecated) and writes it to config.json as is.
    return {
        "rope_type": "yarn",
        "rope_theta": fx.rope_theta,
        "factor": fx.yarn_factor,
        "original_max_position_embeddings": fx.yarn_original_max_pos,
        "beta_fast": fx.yarn_beta_fast,
        "beta_slow": fx.yarn_beta_slow,
        "mscale": fx.yarn_mscale,
        "mscale_all_dim": fx.yarn_mscale_all_dim,
    }


def make_config(fx: Fixture) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=fx.vocab_size,
        hidden_size=fx.hidden_size,
        intermediate_size=fx.intermediate_size,
        moe_intermediate_size=fx.moe_intermediate_size,
        num_hidden_layers=fx.num_layers,
        first_k_dense_replace=fx.first_k_dense_replace,
        num_attention_heads=fx.num_heads,
        num_key_value_heads=fx.num_heads,
        q_lora_rank=fx.q_lora_rank,
        kv_lora_rank=fx.kv_lora_rank,
        qk_nope_head_dim=fx.qk_nope_head_dim,
        qk_rope_head_dim=fx.qk_rope_head_dim,
        v_head_dim=fx.v_head_dim,
        n_routed_experts=fx.n_routed_experts,
        num_experts_per_tok=fx.num_experts_per_tok,
        n_group=fx.n_group,
        topk_group=fx.topk_group,
        n_shared_experts=fx.n_shared_experts,
        norm_topk_prob=fx.norm_topk_prob,
        routed_scaling_factor=fx.routed_scaling_factor,
        rope_interleave=fx.rope_interleave,
        rope_parameters=rope_parameters(fx),
        # factor * original length, so HF does not warn about an implicit factor.
        max_position_embeddings=int(fx.yarn_factor * fx.yarn_original_max_pos),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        # The checkpoint holds no multi-token-prediction layers, so say so
        # (written as `num_nextn_predict_layers`) instead of the default 1.
        num_mtp_layers=0,
        attn_implementation="eager",
        # The plain per-expert loop; grouped_mm would be the CPU default.
        experts_implementation="eager",
    )


def yarn_correction_range(fx: Fixture) -> tuple[int, int, np.ndarray]:
    """HF's YaRN correction dims (after floor/ceil and clamping) and ramp.

    Mirrors `_compute_yarn_parameters` in transformers' modeling_rope_utils:
    frequency i is kept (extrapolated) where ramp[i] == 0, divided by
    `factor` (interpolated) where ramp[i] == 1 and blended in between.
    """
    dim = fx.qk_rope_head_dim

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(fx.yarn_original_max_pos / (num_rotations * 2 * math.pi))) / (
            2 * math.log(fx.rope_theta)
        )

    lo = max(math.floor(correction_dim(fx.yarn_beta_fast)), 0)
    hi = min(math.ceil(correction_dim(fx.yarn_beta_slow)), dim - 1)
    span = hi - lo if hi != lo else 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / span, 0.0, 1.0)
    return lo, hi, ramp


def assert_yarn_ramp_mixes(
    fx: Fixture, model: DeepseekV3ForCausalLM
) -> tuple[int, int, np.ndarray]:
    """Check that YaRN keeps some frequencies and divides others at this rope dim.

    Otherwise the fixture could not tell YaRN from plain or linearly scaled
    RoPE. Also check that the recomputation matches HF's actual inv_freq.
    """
    lo, hi, ramp = yarn_correction_range(fx)
    assert 0 <= lo < hi <= fx.qk_rope_head_dim - 1, (lo, hi)
    assert (ramp == 0).any() and (ramp == 1).any(), ramp
    if fx.require_mixed_frequency:
        assert ((ramp > 0) & (ramp < 1)).any(), ramp

    dim = fx.qk_rope_head_dim
    pos_freqs = fx.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    expected = (1 / pos_freqs) * (1 - ramp) + (1 / (fx.yarn_factor * pos_freqs)) * ramp
    actual = model.model.rotary_emb.inv_freq.double().numpy()
    np.testing.assert_allclose(actual, expected, rtol=1e-6)
    return lo, hi, ramp


def yarn_mscale(scale: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def assert_yarn_scales(fx: Fixture, model: DeepseekV3ForCausalLM) -> dict:
    """Pin down the two YaRN scales HF applies, so the fixture documents them."""
    cos_sin_factor = yarn_mscale(fx.yarn_factor, fx.yarn_mscale) / yarn_mscale(
        fx.yarn_factor, fx.yarn_mscale_all_dim
    )
    qk_head_dim = fx.qk_nope_head_dim + fx.qk_rope_head_dim
    softmax_scale = qk_head_dim**-0.5 * yarn_mscale(fx.yarn_factor, fx.yarn_mscale_all_dim) ** 2
    assert math.isclose(model.model.rotary_emb.attention_scaling, cos_sin_factor, rel_tol=1e-12)
    for layer in model.model.layers:
        assert math.isclose(layer.self_attn.scaling, softmax_scale, rel_tol=1e-12)
    return {"cos_sin_factor": cos_sin_factor, "softmax_scale": softmax_scale}


@torch.no_grad()
def reinitialise(model: DeepseekV3ForCausalLM, fx: Fixture, generator: torch.Generator) -> None:
    """Overwrite HF's default init with larger weights, non-trivial norms and biases."""
    # h after the post-attention RMSNorm has entries of order 1, so this std
    # gives router logits of order 1 (sigmoid scores not saturated).
    router_std = fx.hidden_size**-0.5
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
        if name.endswith("norm.weight"):  # input/post-attention/final, q_a and kv_a layernorms
            param.copy_(1.0 + NORM_WEIGHT_JITTER * noise)
        elif name.endswith("mlp.gate.weight"):  # MoE router
            param.copy_(router_std * noise)
        else:  # embeddings, attention, dense/shared/routed expert projections, lm_head
            param.copy_(WEIGHT_STD * noise)
    # e_score_correction_bias is a buffer, not a parameter.
    for module in model.modules():
        if isinstance(module, DeepseekV3TopkRouter):
            bias = module.e_score_correction_bias
            noise = torch.randn(bias.shape, generator=generator, dtype=bias.dtype)
            bias.copy_(CORRECTION_BIAS_STD * noise)


def router_choice(
    hidden: torch.Tensor, router: DeepseekV3TopkRouter, use_bias: bool
) -> torch.Tensor:
    """Sorted top-k expert ids per token, recomputed as the router selects them."""
    logits = hidden.reshape(-1, router.hidden_dim).float() @ router.weight.float().T
    scores = logits.sigmoid()
    if use_bias:
        scores = scores + router.e_score_correction_bias
    grouped = scores.view(-1, router.num_group, router.num_experts // router.num_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    top_groups = group_scores.topk(router.topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0).bool()
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(scores.shape)
    masked = scores.masked_fill(~expert_mask, float("-inf"))
    return masked.topk(router.top_k, dim=-1).indices.sort(-1).values


@torch.no_grad()
def assert_bias_changes_routing(model: DeepseekV3ForCausalLM, tokens: torch.Tensor) -> float:
    """Check that e_score_correction_bias changes some tokens' expert sets.

    Captures each router's input (the MoE layer's input) and actual choice
    with a hook, checks the recomputation with bias against HF's choice, and
    returns the fraction of (token, MoE layer) pairs whose expert set differs
    from the choice made without the bias.
    """
    captured = []  # (router, MoE input, HF's topk indices)

    def hook(router, args, output):
        captured.append((router, args[0], output[2]))

    routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
    handles = [router.register_forward_hook(hook) for router in routers]
    model(input_ids=tokens)
    for handle in handles:
        handle.remove()

    assert len(captured) == len(routers) > 0
    changed, total = 0, 0
    for router, hidden, hf_indices in captured:
        with_bias = router_choice(hidden, router, use_bias=True)
        without_bias = router_choice(hidden, router, use_bias=False)
        hf_choice = hf_indices.sort(-1).values
        assert torch.equal(with_bias, hf_choice), "router recomputation disagrees with HF"
        differs = (with_bias != without_bias).any(-1)
        changed += int(differs.sum())
        total += differs.numel()
    assert changed > 0, "the correction bias never changes an expert choice"
    return changed / total


def save_checkpoint(model: DeepseekV3ForCausalLM, fx: Fixture, out_dir: Path) -> None:
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


def saved_tensor_names(out_dir: Path) -> list[str]:
    names = []
    for path in sorted(out_dir.glob("*.safetensors")):
        with safe_open(path, framework="np") as f:
            names.extend(f.keys())
    return sorted(names)


def assert_saved_tensor_names(out_dir: Path, fx: Fixture) -> None:
    """Experts are fused in memory (gate_up_proj [E, 2I, H]) but must be on disk
    one Linear per expert, as in the original DeepSeek checkpoints."""
    names = set(saved_tensor_names(out_dir))
    assert not any("gate_up_proj" in n for n in names), names
    for i in range(fx.first_k_dense_replace, fx.num_layers):
        prefix = f"model.layers.{i}.mlp"
        assert f"{prefix}.gate.weight" in names
        assert f"{prefix}.gate.e_score_correction_bias" in names
        for e in range(fx.n_routed_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"{prefix}.experts.{e}.{proj}.weight" in names, (prefix, e, proj)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"{prefix}.shared_experts.{proj}.weight" in names
    for i in range(fx.first_k_dense_replace):
        assert f"model.layers.{i}.mlp.gate_proj.weight" in names
    attn = "model.layers.0.self_attn"
    if fx.q_lora_rank is None:
        assert f"{attn}.q_proj.weight" in names and f"{attn}.q_a_proj.weight" not in names
    else:
        assert f"{attn}.q_proj.weight" not in names
        q_lora = {f"{attn}.{n}.weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj")}
        assert q_lora <= names


def assert_config_json(out_dir: Path, fx: Fixture) -> None:
    """Make sure every tested setting survived serialisation, not just the in-memory config."""
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["rope_parameters"] == rope_parameters(fx), cfg["rope_parameters"]
    assert cfg.get("rope_scaling") is None, cfg.get("rope_scaling")
    expected = {
        "rope_interleave": fx.rope_interleave,  # top level, not in rope_parameters
        "q_lora_rank": fx.q_lora_rank,  # null for the plain q_proj
        "kv_lora_rank": fx.kv_lora_rank,
        "qk_nope_head_dim": fx.qk_nope_head_dim,
        "qk_rope_head_dim": fx.qk_rope_head_dim,
        "v_head_dim": fx.v_head_dim,
        "n_routed_experts": fx.n_routed_experts,
        "num_experts_per_tok": fx.num_experts_per_tok,
        "n_group": fx.n_group,
        "topk_group": fx.topk_group,
        "n_shared_experts": fx.n_shared_experts,
        "norm_topk_prob": fx.norm_topk_prob,
        "routed_scaling_factor": fx.routed_scaling_factor,
        "first_k_dense_replace": fx.first_k_dense_replace,
        "moe_intermediate_size": fx.moe_intermediate_size,
        "intermediate_size": fx.intermediate_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
    }
    for key, value in expected.items():
        assert key in cfg and cfg[key] == value, (key, cfg.get(key), value)


@torch.no_grad()
def assert_reload_matches(out_dir: Path, tokens: torch.Tensor, logits: torch.Tensor) -> None:
    """Reload through HF's unfused-to-fused conversion and check the logits are unchanged."""
    reloaded = DeepseekV3ForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    torch.testing.assert_close(reloaded(input_ids=tokens).logits, logits, rtol=0, atol=0)


@torch.no_grad()
def save_expected_outputs(
    model: DeepseekV3ForCausalLM, tokens: torch.Tensor, out_dir: Path
) -> tuple[torch.Tensor, dict]:
    # labels=input_ids: HF shifts internally and averages the next-token cross
    # entropy over all BATCH * (SEQ_LEN - 1) positions. No router aux loss is
    # added (output_router_logits is False).
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
    return out.logits, {"max_abs_logit": float(np.abs(logits).max()), "loss": float(loss)}


@torch.no_grad()
def bfloat16_logits(out_dir: Path, tokens: torch.Tensor) -> np.ndarray:
    """HF's logits for `tokens` with the saved checkpoint loaded in bfloat16, as float32.

    Loaded as transformers loads a bf16 model (`from_pretrained(dtype=torch.bfloat16)`):
    every weight and activation in bf16 but the router, whose weight and correction bias
    transformers keeps in float32 (`_keep_in_fp32_modules_strict`) and routes with in
    float32; RMSNorm statistics, RoPE angles and the attention softmax in float32 inside
    HF's modules. Not `model.to(torch.bfloat16)`, which would also round the router and the
    RoPE inverse frequencies (a buffer) to bf16.
    """
    model = DeepseekV3ForCausalLM.from_pretrained(
        out_dir, dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    return model(input_ids=tokens).logits.float().numpy()


def build_fixture(fx: Fixture) -> None:
    generator = torch.Generator().manual_seed(fx.seed)
    torch.manual_seed(fx.seed)  # HF's own init, which is overwritten anyway

    model = DeepseekV3ForCausalLM(make_config(fx)).to(torch.float32).eval()
    lo, hi, ramp = assert_yarn_ramp_mixes(fx, model)
    scales = assert_yarn_scales(fx, model)
    reinitialise(model, fx, generator)
    tokens = torch.randint(0, fx.vocab_size, (BATCH, SEQ_LEN), generator=generator)
    changed = assert_bias_changes_routing(model, tokens)

    out_dir = FIXTURES_DIR / fx.name
    shutil.rmtree(out_dir, ignore_errors=True)
    save_checkpoint(model, fx, out_dir)
    assert_config_json(out_dir, fx)
    assert_saved_tensor_names(out_dir, fx)
    logits, stats = save_expected_outputs(model, tokens, out_dir)
    assert_reload_matches(out_dir, tokens, logits)

    files = sorted(p.name for p in out_dir.iterdir())
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{fx.name}: files={files} params={n_params} "
        f"max|logit|={stats['max_abs_logit']:.3f} loss={stats['loss']:.6f} "
        f"yarn lo/hi={lo}/{hi} ramp={ramp.tolist()} "
        f"cos/sin factor={scales['cos_sin_factor']:.6f} "
        f"softmax scale={scales['softmax_scale']:.6f} "
        f"bias-changed expert sets={changed:.3f}"
    )


def main() -> None:
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for fx in FIXTURES:
        build_fixture(fx)


if __name__ == "__main__":
    main()
