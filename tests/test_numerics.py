"""The models' numbers against independent references: Hugging Face's logits and loss (tiny
random checkpoints made by tests/tools/), float64 transcriptions of the routing, the experts,
the balance loss and the RoPE frequency rules, the published parameter counts, MaxText's FLOP
figures; and causality, by gradient."""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import FIXTURES, TINY_DEEPSEEK, TINY_LLAMA, one_device_params
from configs.deepseek_v3 import DEEPSEEK_V3
from configs.llama3 import LLAMA31_8B, LLAMA31_70B, LLAMA31_405B
from hf.load import load_checkpoint
from model import deepseek, families
from model import experts as model_experts
from model.options import ForwardOptions
from model.layers import rope_frequencies, yarn_frequencies
from model.params import abstract_params, param_count
from trainer.step import cross_entropy, loss_fn

HF_CASES = [("llama_gqa", "sorted"), ("llama_sharded", "sorted")] + [
    (fixture, path) for fixture in ("deepseek_yarn", "deepseek_halfrot")
    for path in deepseek.EXPERT_PATHS]


@pytest.mark.parametrize("fixture, expert_path", HF_CASES)
def test_logits_and_loss_match_hugging_face(fixture, expert_path):
    """Within 1e-4 of the logits' scale: transformers' float32 CPU kernels sum in other orders."""
    cfg, params = load_checkpoint(FIXTURES / fixture)
    expected = np.load(FIXTURES / fixture / "expected.npz")
    logits, _ = families.of(cfg).forward(params, expected["tokens"], cfg,
                                         ForwardOptions(experts=expert_path))
    reference = expected["logits"]
    assert np.abs(np.asarray(logits) - reference).max() <= 1e-4 * np.abs(reference).max()
    loss = cross_entropy(logits[:, :-1], expected["tokens"][:, 1:])
    np.testing.assert_allclose(loss, expected["loss"], rtol=1e-5)


@pytest.mark.parametrize("fixture", ["llama_gqa", "deepseek_yarn"])
def test_the_training_loss_is_hugging_faces(fixture):
    """loss_fn on a fixture's tokens is the loss transformers computes with labels=tokens
    (it shifts them itself: position t predicts token t + 1)."""
    cfg, params = load_checkpoint(FIXTURES / fixture)
    expected = np.load(FIXTURES / fixture / "expected.npz")
    options = ForwardOptions(experts="dense")
    loss, aux = jax.jit(lambda p, b: loss_fn(p, b, model=cfg, options=options))(
        params, expected["tokens"])
    np.testing.assert_allclose(loss, expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(aux["cross_entropy"], expected["loss"], rtol=1e-5)


def numpy_route(x, router, bias, cfg):
    """HF's rules, token by token, in float64."""
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ router.astype(np.float64))))
    chosen, weights = [], []
    for s in scores:
        biased = s + bias
        groups = biased.reshape(cfg.n_groups, -1)
        group_score = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
        kept = np.argsort(-group_score)[:cfg.topk_groups]
        masked = np.full_like(groups, -np.inf)
        masked[kept] = groups[kept]
        experts = np.argsort(-masked.reshape(-1))[:cfg.experts_per_token]
        w = s[experts]
        if cfg.norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        chosen.append(experts)
        weights.append(w * cfg.routed_scaling)
    return np.array(weights), np.array(chosen)


@pytest.mark.parametrize("norm", [True, False])
def test_routing_matches_a_float64_transcription(norm):
    cfg = dataclasses.replace(TINY_DEEPSEEK, n_experts=16, experts_per_token=3, n_groups=4,
                              topk_groups=2, norm_topk_prob=norm)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, cfg.d_model)).astype(np.float32)
    router = rng.normal(scale=cfg.d_model**-0.5, size=(cfg.d_model, 16)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=16).astype(np.float32)  # big enough to change choices
    weights, experts, _ = deepseek.route(x, router, bias, cfg)
    want_w, want_e = numpy_route(x, router, bias, cfg)
    _, unbiased = numpy_route(x, router, np.zeros(16), cfg)
    assert (np.sort(want_e, 1) != np.sort(unbiased, 1)).any()  # the bias matters here
    order, want_order = np.argsort(experts, 1), np.argsort(want_e, 1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, 1),
                                  np.take_along_axis(want_e, want_order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                               np.take_along_axis(want_w, want_order, 1), rtol=1e-6)


def routed_case(seed: int, E=6, D=16, F=12, S=40, k=3):
    """Expert weights, tokens, routing weights and (token, expert) choices: (w, x, weights)."""
    rng = np.random.default_rng(seed)
    w = {name: rng.normal(scale=0.3, size=shape).astype(np.float32) for name, shape in
         [("we_gate", (E, D, F)), ("we_up", (E, D, F)), ("we_down", (E, F, D))]}
    x = rng.normal(size=(S, D)).astype(np.float32)
    return w, x, rng.uniform(size=(S, k)).astype(np.float32)


def per_token_loop(x, weights, experts, w) -> np.ndarray:
    """Each token's chosen experts one by one, in float64."""
    want = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = experts[t, j]
            gate, up = x[t] @ w["we_gate"][e], x[t] @ w["we_up"][e]
            want[t] += weights[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ w["we_down"][e])
    return want


@pytest.mark.parametrize("expert_path", list(deepseek.EXPERT_PATHS))
def test_dropless_experts_equal_a_per_token_loop(expert_path):
    w, x, weights = routed_case(1)
    rng = np.random.default_rng(1)
    experts = np.stack([rng.permutation(6)[:3] for _ in range(40)]).astype(np.int32)
    experts[:10] = experts[0]  # a crowded expert, and others left empty
    got = deepseek.EXPERT_PATHS[expert_path](x, weights, experts, w, 6)
    np.testing.assert_allclose(got, per_token_loop(x, weights, experts, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", [1, 6, 19])
def test_tiles_of_any_size_hold_every_routing(tile):
    """The tiled path with tiles smaller than an expert's pairs: several tiles per expert, the
    last one padded; every token choosing the same 3 experts (3 full experts, 3 empty); every
    expert holding one pair more than whole tiles (120 pairs: the most padding and tiles)."""
    w, x, weights = routed_case(2)
    crowded = np.tile(np.array([[5, 0, 2]], np.int32), (40, 1))
    whole = [114 // tile // 6 + (e < 114 // tile % 6) for e in range(6)]  # tiles per expert
    pairs = np.repeat(np.arange(6, dtype=np.int32), [n * tile + 1 for n in whole])
    padded = np.random.default_rng(3).permutation(pairs).reshape(40, 3)
    for experts in (crowded, padded):
        got = model_experts.experts_tiled(x, weights, experts, w, 6, tile=tile)
        np.testing.assert_allclose(got, per_token_loop(x, weights, experts, w), rtol=1e-5,
                                   atol=1e-5)


def test_balance_loss_matches_the_papers_formula():
    rng = np.random.default_rng(4)
    B, T, E, k = 2, 6, 8, 2
    scores = rng.uniform(0.05, 1, size=(B * T, E)).astype(np.float32)
    experts = np.stack([rng.permutation(E)[:k] for _ in range(B * T)]).astype(np.int32)
    want = 0.0
    for b in range(B):
        s, chosen = scores[b * T:(b + 1) * T], experts[b * T:(b + 1) * T]
        f = np.array([E / (k * T) * np.sum(chosen == e) for e in range(E)])
        p = (s / s.sum(axis=1, keepdims=True)).mean(axis=0)
        want += np.sum(f * p) / B
    assert float(deepseek.balance_loss(scores, experts, B, E)) == pytest.approx(want, rel=1e-5)


def test_rope_frequencies_follow_the_llama3_rule_in_float64():
    """An independent per-frequency transcription of Meta's apply_scaling."""
    scaling = LLAMA31_405B.rope_scaling
    got = rope_frequencies(128, 500_000.0, scaling)
    for i, f in enumerate(1.0 / 500_000.0 ** (np.arange(0, 128, 2) / 128)):
        wavelength = 2 * np.pi / f
        if wavelength < scaling.original_max_position / scaling.high_freq_factor:
            want = f
        elif wavelength > scaling.original_max_position / scaling.low_freq_factor:
            want = f / scaling.factor
        else:
            smooth = (scaling.original_max_position / wavelength - 1) / (4 - 1)
            want = (1 - smooth) * f / 8 + smooth * f
        assert got[i] == pytest.approx(want, rel=1e-6)


def test_yarn_keeps_fast_and_divides_slow_frequencies_for_v3():
    """Correction dims 10..23 for rope dim 64, base 1e4, original context 4096 (YaRN)."""
    freqs = yarn_frequencies(64, 10_000.0, DEEPSEEK_V3.rope_scaling)
    base = 1.0 / 10_000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(freqs[:11], base[:11], rtol=1e-6)
    np.testing.assert_allclose(freqs[23:], base[23:] / 40, rtol=1e-6)
    assert np.all((freqs[11:23] < base[11:23]) & (freqs[11:23] > base[11:23] / 40))


@pytest.mark.parametrize("cfg, count", [(LLAMA31_8B, 8_030_261_248),
                                        (LLAMA31_70B, 70_553_706_496),
                                        (LLAMA31_405B, 405_853_388_800),
                                        (DEEPSEEK_V3, 671_026_419_200)])  # correction biases in
def test_parameter_counts_of_the_real_models(cfg, count):
    specs = families.of(cfg).param_specs(cfg)
    assert param_count(specs) == count
    assert sum(a.size for a in jax.tree.leaves(abstract_params(specs))) == count


def test_deepseek_v3_active_parameters_and_softmax_scale():
    """docs/study.md: 37.55 billion parameters active per token; MLA's softmax scale
    192^-1/2 x (0.1 ln 40 + 1)^2 under YaRN."""
    assert deepseek.active_params_per_token(DEEPSEEK_V3) / 1e9 == pytest.approx(37.55, abs=0.005)
    assert deepseek.softmax_scale(DEEPSEEK_V3) == pytest.approx(
        192**-0.5 * (0.1 * np.log(40) + 1) ** 2)


@pytest.mark.parametrize("cfg, seq, tflop", [(LLAMA31_405B, 8192, 20_676.2),
                                             (LLAMA31_405B, 4096, 10_130.3),
                                             (DEEPSEEK_V3, 4096, 1025.8),
                                             (DEEPSEEK_V3, 8192, 2303.2)])
def test_flop_formula_gives_maxtexts_figures(cfg, seq, tflop):
    """docs/study.md: per-device TFLOP per step at per-device batch 1, MaxText's formula."""
    assert families.of(cfg).training_flops(cfg, 1, seq) / 1e12 == pytest.approx(tflop, abs=0.1)


@pytest.mark.parametrize("cfg", [TINY_LLAMA, TINY_DEEPSEEK], ids=["llama", "deepseek"])
def test_causality_by_gradient(cfg):
    """Logits at position t depend on no token after t: with distinct tokens, the embedding
    row of a later token gets exactly zero gradient (through every layer, the experts' too)."""
    params, seq, t = one_device_params(cfg), 10, 4
    toks = jax.random.permutation(jax.random.key(3), cfg.vocab)[:seq][None]
    def logits_at_t(embed):
        logits, _ = families.of(cfg).forward({**params, "embed": embed}, toks, cfg,
                                             ForwardOptions(experts="dense"))
        return logits[0, t].sum()

    grad = np.asarray(jax.grad(logits_at_t)(params["embed"]))
    later, earlier = np.asarray(toks[0, t + 1:]), np.asarray(toks[0, :t + 1])
    assert np.all(grad[later] == 0)
    assert np.all(np.abs(grad[earlier]).max(axis=1) > 0)


def test_the_recomputed_flops_are_those_of_the_layers_forward_again():
    """What a run reports its checkpoint policies recompute (runtime/own_program.py), per
    device of 8, against hand-counted matrix products of a Llama layer (D=64, N=4, K=2, H=16,
    F=128; 16 sequences of 32 tokens; 2 layers): remat runs every layer's forward again but
    the MLP's down projection, whose output the backward pass never reads (its Q/K/V and output
    projections, its two attention products over all T x T scores, the SwiGLU's gate and up);
    keeping Q/K/V saves their projections; no checkpointing recomputes nothing."""
    from runtime.own_program import recomputed_flops
    from runtime.setup import resolve
    from trainer.program import Program
    from trainer.target import this_machine

    words = ["scale=proxy", "model.n_layers=2", "model.d_model=64", "model.n_heads=4",
             "model.n_kv_heads=2", "model.head_dim=16", "model.d_ff=128", "model.vocab=512",
             "seq=32", "quant=none"]
    B, T, D, N, K, H, F, L = 16, 32, 64, 4, 2, 16, 128, 2
    qkv = 2 * B * T * D * (N + 2 * K) * H
    layer = qkv + 2 * B * T * N * H * D + 2 * (2 * B * T * T * N * H) + 2 * (2 * B * T * D * F)

    def recomputed(preset: str) -> float:
        setup = resolve("llama405b-baseline", [*words, f"preset={preset}"], jax.devices())
        program = Program(setup.model, setup.run, setup.placement, this_machine())
        return recomputed_flops(program) * 8

    assert recomputed("remat") == L * layer
    assert recomputed("remat") - recomputed("qkv_offload") == L * qkv
    assert recomputed("none") == 0
