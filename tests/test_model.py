"""The Llama model against Hugging Face, and invariances that need no reference."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest


from configs.llama3 import LLAMA31_8B, LLAMA31_70B, LLAMA31_405B
from model import common, llama
from model.config import LlamaConfig
from hf.load import load_checkpoint
from offload import policies
from analysis.trace import tagged_values
from trainer import step as trainer_step

FIXTURES = "tests/fixtures"
TINY = LlamaConfig(vocab=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=48, rope_theta=1000.0)


def tiny_params(cfg=TINY, seed=0):
    mesh = common.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
    params = common.init_params(llama.param_specs(cfg), common.AxisRules(batch="fsdp", mesh=mesh),
                                jax.random.key(seed))
    # Norm weights away from 1, so a test would notice them being ignored.
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p + 0.3 * jnp.sin(jnp.arange(p.size).reshape(p.shape))
        if str(path[-1].key).endswith("norm") else p, params)


def tokens(batch=2, seq=12, vocab=TINY.vocab, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, vocab)


@pytest.mark.parametrize("name", ["llama_gqa", "llama_sharded"])
def test_logits_and_loss_match_hugging_face(name):
    cfg, params = load_checkpoint(f"{FIXTURES}/{name}")
    expected = np.load(f"{FIXTURES}/{name}/expected.npz")
    logits = np.asarray(llama.forward(params, expected["tokens"], cfg, dtype=jnp.float32)[0])
    reference = expected["logits"]
    assert np.abs(logits - reference).max() <= 1e-4 * np.abs(reference).max()
    loss = trainer_step.cross_entropy(logits[:, :-1], expected["tokens"][:, 1:])
    np.testing.assert_allclose(loss, expected["loss"], rtol=1e-5)


def test_scan_equals_unrolled_loop():
    params, toks = tiny_params(), tokens()
    cos, sin = common.rope_tables(toks.shape[1], common.rope_frequencies(
        TINY.head_dim, TINY.rope_theta, TINY.rope_scaling), jnp.float32)
    x = params["embed"][toks]
    for i in range(TINY.n_layers):
        x = llama.block(x, jax.tree.map(lambda w: w[i], params["layers"]), TINY, cos, sin)
    x = common.rms_norm(x, params["final_norm"], TINY.norm_eps)
    unrolled = x @ params["lm_head"]
    scanned, _ = llama.forward(params, toks, TINY, dtype=jnp.float32)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-6, atol=1e-6)


EVERY_TABLE = {**policies.PRESETS,
               "all_device": {t: "device" for t in llama.SCANS["layers"]},
               "all_offload": {t: "offload" for t in llama.SCANS["layers"]},
               "mixed": {t: ("device", "offload", "remat")[i % 3]
                         for i, t in enumerate(llama.SCANS["layers"])}}


@jax.jit(static_argnums=2)
def loss_and_grads(params, batch, policy):
    loss = partial(trainer_step.loss_fn, batch=batch, model=TINY, rules=None,
                   policies={} if policy is None else {"layers": policy},
                   dtype=jnp.float32)
    return jax.value_and_grad(loss, has_aux=True)(params)


@pytest.fixture(scope="module")
def no_checkpoint():
    params, batch = tiny_params(), tokens(seq=13)
    return params, batch, loss_and_grads(params, batch, None)


@pytest.mark.parametrize("table", EVERY_TABLE.values(), ids=EVERY_TABLE.keys())
def test_every_policy_gives_the_gradients_of_no_checkpointing(table, no_checkpoint):
    params, batch, reference = no_checkpoint
    checked = loss_and_grads(params, batch, policies.checkpoint_policy(table))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 checked, reference)


def test_causality_by_gradient():
    """Logits at position t depend on no token after t: with distinct tokens, the embedding
    row of a later token gets exactly zero gradient."""
    params, seq, t = tiny_params(), 10, 4
    toks = jax.random.permutation(jax.random.key(3), TINY.vocab)[:seq][None]

    def logits_at_t(embed):
        logits, _ = llama.forward({**params, "embed": embed}, toks, TINY, dtype=jnp.float32)
        return logits[0, t].sum()

    grad = np.asarray(jax.grad(logits_at_t)(params["embed"]))
    later, earlier = np.asarray(toks[0, t + 1:]), np.asarray(toks[0, :t + 1])
    assert np.all(grad[later] == 0)
    assert np.all(np.abs(grad[earlier]).max(axis=1) > 0)


def test_tags_of_the_traced_model_are_the_tag_list():
    abstract = common.abstract_params(llama.param_specs(TINY))
    toks = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    found = tagged_values(lambda p, t: llama.forward(p, t, TINY), abstract, toks)
    assert sorted(found) == sorted(llama.SCANS["layers"])
    assert all(len(sites) == 1 for sites in found.values())  # one tag per tensor
    assert found["query_proj"][0].shape == (2, 8, TINY.n_heads, TINY.head_dim)
    assert found["mlpwi_0"][0].shape == (2, 8, TINY.d_ff)


@pytest.mark.parametrize("cfg, count", [(LLAMA31_8B, 8_030_261_248),
                                        (LLAMA31_70B, 70_553_706_496),
                                        (LLAMA31_405B, 405_853_388_800)])
def test_parameter_counts_of_the_real_models(cfg, count):
    assert common.param_count(llama.param_specs(cfg)) == count
    abstract = common.abstract_params(llama.param_specs(cfg))
    assert sum(a.size for a in jax.tree.leaves(abstract)) == count


@pytest.mark.parametrize("seq, tflop", [(8192, 20_676.2), (4096, 10_130.3)])
def test_flop_formula_gives_maxtexts_405b_figures(seq, tflop):
    """maxtext-notes.md §4: per-device TFLOP per step at per-device batch 1."""
    assert llama.training_flops(LLAMA31_405B, 1, seq) / 1e12 == pytest.approx(tflop, abs=0.1)


def test_rope_frequencies_follow_the_llama3_rule_in_float64():
    """An independent per-frequency transcription of Meta's apply_scaling."""
    scaling = LLAMA31_405B.rope_scaling
    got = common.rope_frequencies(128, 500_000.0, scaling)
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
