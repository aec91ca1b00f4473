"""DeepSeek-V3 against Hugging Face, routing and experts against float64 numpy."""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file


from model import common, deepseek
from hf.safetensors import dequantize_fp8
from model.config import DeepSeekConfig, YarnScaling
from hf.load import load_checkpoint
from offload import policies
from analysis.trace import tagged_values
import configs
from trainer import build as trainer_build
from trainer import step as trainer_step
from trainer import target as trainer_target

FIXTURES = "tests/fixtures"
V3 = DeepSeekConfig(vocab=129_280, d_model=7168, n_layers=61, n_dense_layers=3, n_heads=128,
                    q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64,
                    v_head_dim=128, d_ff=18_432, moe_d_ff=2048, n_experts=256,
                    experts_per_token=8, n_shared_experts=1, n_groups=8, topk_groups=4,
                    routed_scaling=2.5)
TINY = DeepSeekConfig(vocab=61, d_model=32, n_layers=3, n_dense_layers=1, n_heads=2,
                      q_lora_rank=12, kv_lora_rank=8, qk_nope_dim=8, qk_rope_dim=4,
                      v_head_dim=6, d_ff=40, moe_d_ff=16, n_experts=8, experts_per_token=2,
                      n_shared_experts=1, n_groups=4, topk_groups=2, routed_scaling=2.5,
                      rope_scaling=YarnScaling(factor=4.0, original_max_position=64),
                      max_position=256)


@pytest.mark.parametrize("expert_path", list(deepseek.EXPERT_PATHS))
@pytest.mark.parametrize("name", ["deepseek_yarn", "deepseek_halfrot"])
def test_logits_and_loss_match_hugging_face(name, expert_path):
    cfg, params = load_checkpoint(f"{FIXTURES}/{name}")
    expected = np.load(f"{FIXTURES}/{name}/expected.npz")
    logits, _ = deepseek.forward(params, expected["tokens"], cfg, dtype=jnp.float32,
                                 expert_path=expert_path)
    reference = expected["logits"]
    assert np.abs(np.asarray(logits) - reference).max() <= 1e-4 * np.abs(reference).max()
    loss = trainer_step.cross_entropy(logits[:, :-1], expected["tokens"][:, 1:])
    np.testing.assert_allclose(loss, expected["loss"], rtol=1e-5)


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
    cfg = dataclasses.replace(TINY, n_experts=16, experts_per_token=3, n_groups=4,
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


@pytest.mark.parametrize("expert_path", list(deepseek.EXPERT_PATHS))
def test_dropless_experts_equal_a_per_token_loop(expert_path):
    rng = np.random.default_rng(1)
    E, D, F, S, k = 6, 16, 12, 40, 3
    w = {name: rng.normal(scale=0.3, size=shape).astype(np.float32) for name, shape in
         [("we_gate", (E, D, F)), ("we_up", (E, D, F)), ("we_down", (E, F, D))]}
    x = rng.normal(size=(S, D)).astype(np.float32)
    experts = np.stack([rng.permutation(E)[:k] for _ in range(S)]).astype(np.int32)
    experts[:10] = experts[0]  # a crowded expert, and others left empty
    weights = rng.uniform(size=(S, k)).astype(np.float32)
    got = deepseek.EXPERT_PATHS[expert_path](x, weights, experts, w, E)
    want = np.zeros((S, D))
    for t in range(S):
        for j in range(k):
            e = experts[t, j]
            gate, up = x[t] @ w["we_gate"][e], x[t] @ w["we_up"][e]
            want[t] += weights[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ w["we_down"][e])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_real_config_counts():
    specs = deepseek.param_specs(V3)
    assert common.param_count(specs) == 671_026_419_200  # correction biases included
    assert deepseek.active_params_per_token(V3) / 1e9 == pytest.approx(37.55, abs=0.005)
    assert deepseek.softmax_scale(V3) == pytest.approx(192**-0.5 * (0.1 * np.log(40) + 1) ** 2)


@pytest.mark.parametrize("seq, tflop", [(4096, 1025.8), (8192, 2303.2)])
def test_flop_formula_gives_maxtexts_deepseek_figures(seq, tflop):
    """maxtext-notes.md §4: per-device TFLOP per step at per-device batch 1."""
    assert deepseek.training_flops(V3, 1, seq) / 1e12 == pytest.approx(tflop, abs=0.1)


def test_yarn_keeps_fast_and_divides_slow_frequencies_for_v3():
    """maxtext-notes §3: correction dims 10..23 for rope dim 64, base 1e4, original 4096."""
    freqs = common.yarn_frequencies(64, 10_000.0, V3.rope_scaling)
    base = 1.0 / 10_000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(freqs[:11], base[:11], rtol=1e-6)
    np.testing.assert_allclose(freqs[23:], base[23:] / 40, rtol=1e-6)
    assert np.all((freqs[11:23] < base[11:23]) & (freqs[11:23] > base[11:23] / 40))


def test_fp8_block_dequantization_follows_128_blocks():
    rng = np.random.default_rng(2)
    weight = rng.normal(size=(300, 200)).astype(ml_dtypes.float8_e4m3fn)
    scale_inv = rng.uniform(0.5, 2, size=(3, 2)).astype(np.float32)
    got = dequantize_fp8(weight, scale_inv)
    for i, j in [(0, 0), (127, 127), (128, 0), (299, 199), (200, 130)]:
        assert got[i, j] == np.float32(weight[i, j]) * scale_inv[i // 128, j // 128]


def test_an_fp8_checkpoint_loads_dequantized(tmp_path):
    source = f"{FIXTURES}/deepseek_yarn"
    shutil.copy(f"{source}/config.json", tmp_path / "config.json")
    tensors = load_file(f"{source}/model.safetensors")
    name = "model.layers.1.self_attn.q_b_proj.weight"
    fp8 = tensors[name].astype(ml_dtypes.float8_e4m3fn)
    tensors[name] = fp8
    tensors[name + "_scale_inv"] = np.array([[0.5]], np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    cfg, params = load_checkpoint(tmp_path)
    q_b = params["moe_layers"]["wq_b"][0].reshape(cfg.q_lora_rank, -1)
    np.testing.assert_array_equal(q_b, fp8.astype(np.float32).T * 0.5)


def test_tags_of_both_scans_are_the_tag_lists():
    """TINY has 1 dense and 2 MoE layers: a site's run count says which scan it is in."""
    abstract = common.abstract_params(deepseek.param_specs(TINY))
    toks = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    for path in deepseek.EXPERT_PATHS:
        found = tagged_values(lambda p, t: deepseek.forward(p, t, TINY, expert_path=path),
                              abstract, toks)
        for count, tags in [(1, deepseek.SCANS["dense_layers"]), (2, deepseek.SCANS["moe_layers"])]:
            sites = [s for sites in found.values() for s in sites if s.count == count]
            assert sorted(s.tag for s in sites) == sorted(tags)  # each tag exactly once


def tiny_params(cfg=TINY, seed=0):
    mesh = common.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
    rules = common.AxisRules(batch="fsdp", mesh=mesh)
    params = common.init_params(deepseek.param_specs(cfg), rules, jax.random.key(seed))
    bias = jax.random.normal(jax.random.key(seed + 1), (cfg.n_moe_layers, cfg.n_experts)) * 0.3
    return {**params, "moe_layers": {**params["moe_layers"], "router_bias": bias}}


@jax.jit(static_argnums=(2, 3))
def loss_and_grads(params, batch, tables, expert_path):
    tables = None if tables is None else {s: dict(t) for s, t in tables}
    loss = trainer_build.make_loss(TINY, dataclasses.replace(RUN, expert_path=expert_path), tables,
                              rules=None, target=trainer_target.Target("cpu"))
    return jax.value_and_grad(lambda p: loss(p, batch)[0])(params)


RUN = configs.RunConfig(compute_dtype="float32", balance_loss_weight=0.01)
DEEPSEEK_TABLES = {name: policies.placement_tables(name, {}, deepseek.SCANS)
                   for name in ("remat", "dsv3_offload", "dsv3_device")}
DEEPSEEK_TABLES["all_offload"] = {scan: {t: "offload" for t in tags}
                                  for scan, tags in deepseek.SCANS.items()}


def _hashable(tables):
    return tuple((s, tuple(sorted(t.items()))) for s, t in tables.items())


@pytest.mark.parametrize("name", list(DEEPSEEK_TABLES))
def test_every_policy_gives_the_gradients_of_no_checkpointing(name):
    params = tiny_params()
    batch = jax.random.randint(jax.random.key(3), (2, 13), 0, TINY.vocab)
    path = "sorted" if name == "all_offload" else "dense"
    reference = loss_and_grads(params, batch, None, path)
    checked = loss_and_grads(params, batch, _hashable(DEEPSEEK_TABLES[name]), path)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 checked, reference)


def test_the_router_bias_gets_no_gradient():
    """(Its own update rule: tests/test_training_step.py.)"""
    params = tiny_params()
    batch = jax.random.randint(jax.random.key(3), (2, 13), 0, TINY.vocab)
    _, grads = loss_and_grads(params, batch, None, "dense")
    assert not np.any(grads["moe_layers"]["router_bias"])


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


@pytest.mark.parametrize("preset", ["dsv3_offload", "dsv3_device", "remat"])
def test_the_exported_program_offloads_exactly_the_table_in_both_scans(preset):
    from analysis import memory
    from analysis.traced import TracedStep
    from configs.deepseek_v3 import DEEPSEEK_V3, PROXY_V3, STUDY_V3
    tables = policies.placement_tables(preset, {}, deepseek.SCANS)
    for model, mesh in [(DEEPSEEK_V3, (1, 128)), (PROXY_V3, (1, 8))]:
        run = dataclasses.replace(STUDY_V3, seq=256 if model is PROXY_V3 else STUDY_V3.seq)
        lines = memory.tag_lines(TracedStep(model, run, mesh), tables)
        wanted = {(scan, t) for scan, table in tables.items() for t, p in table.items()
                  if p == "offload"} - {(scan, "mlpwo") for scan in tables}
        assert {(x.value.scan, x.value.tag) for x in lines if x.offloaded} == wanted
        assert {x.value.tag for x in lines if not x.needed} == {"mlpwo"}


def test_the_plan_shows_the_studys_deepseek_memory_facts():
    """experiments.md, DeepSeek row 4 and its note: saving the selected activations on device
    fits at micro batch 2, not at 8; offloading them fits at 8, with host memory to spare.
    Full scale, 128 GB200s, experts split over the GPUs."""
    from analysis import plan
    from configs import get
    fits = {}
    for name in ("deepseek671b-device", "deepseek671b-device-mb8", "deepseek671b-offload"):
        experiment = get(name)
        tables = policies.placement_tables(experiment.run.policy, {},
                                           deepseek.SCANS)
        fits[name] = plan.full_scale(experiment, tables)
    assert fits["deepseek671b-device"].fits
    assert fits["deepseek671b-device-mb8"].peak_estimate > fits["deepseek671b-device-mb8"].capacity
    offload = fits["deepseek671b-offload"]
    assert offload.fits and offload.host_activations > 100 * 2**30


def test_the_plan_keeps_a_devices_own_experts_whole():
    """Under expert parallelism a device holds its experts whole: the plan must not divide
    what it saves of them (their bf16 casts, without checkpointing) by the fsdp size again."""
    from analysis import memory
    from analysis.traced import TracedStep
    run = dataclasses.replace(RUN, policy="none", expert_parallel=True, seq=16,
                              per_device_batch=1, compute_dtype="bfloat16")
    step = TracedStep(TINY, run, (1, 2))
    memory = memory.plan(step, None, memory.tag_lines(step, None), 10**12, 10**12)
    own = (TINY.n_moe_layers, TINY.n_experts // 2, TINY.d_model, TINY.moe_d_ff)
    assert TINY.n_moe_layers % 2 == 0  # what the old arithmetic would have halved
    assert own in {r.shape for r in memory.residuals}
