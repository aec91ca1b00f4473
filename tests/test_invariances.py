"""Invariances that need no reference, per model family: the traced tags are the family's tag
lists; every placement policy gives the loss and gradients of no checkpointing; the scan is
the unrolled loop; the program exported for a GPU offloads exactly what the table says."""

import dataclasses
import re
from functools import partial

import jax
import jax.numpy as jnp
import pytest
from jax import export

import configs
from study.plan import memory_plan
from study.programs import offload_proof
from study.programs.jaxpr import tagged_values
from study.plan.traced_step import freeze, traced_step
from conftest import (TINY_DEEPSEEK, TINY_LLAMA, assert_trees_close, one_device_params,
                      tokens)
from model import deepseek, families, llama
from model.options import ForwardOptions
from model.layers import rms_norm, rope_frequencies, rope_tables
from model.params import abstract_params
from offload import activations
from trainer.program import UNROLLED_LAYERS, forward_options, make_loss
from trainer.target import Target

FAMILIES = {"llama": (llama, TINY_LLAMA), "deepseek": (deepseek, TINY_DEEPSEEK)}
RUN = configs.RunConfig(compute_dtype="float32", balance_loss_weight=0.01)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_traced_tags_are_the_family_tag_lists(name):
    """Each scan's sites are its family's list, each tag once per layer (a site's run count is
    its scan's layer count), for every expert path."""
    family, cfg = FAMILIES[name]
    abstract = abstract_params(family.param_specs(cfg))
    toks = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    paths = list(deepseek.EXPERT_PATHS) if family is deepseek else ["sorted"]
    for path in paths:
        options = ForwardOptions(experts=path)
        found = tagged_values(lambda p, t: family.forward(p, t, cfg, options), abstract, toks)
        sites = [s for sites in found.values() for s in sites]
        for scan, tags in family.SCANS.items():
            layers = family.param_specs(cfg)[scan]["attn_norm"].shape[0]
            assert sorted(s.tag for s in sites if s.scan == scan) == sorted(tags), scan
            assert {s.count for s in sites if s.scan == scan} == {layers}
    if family is llama:
        assert found["query_proj"][0].shape == (2, 8, cfg.n_heads, cfg.head_dim)
        assert found["mlpwi_0"][0].shape == (2, 8, cfg.d_ff)


def every_table(family) -> dict[str, dict]:
    """Placements to check: the presets, every tag on device, every tag offloaded, a mix."""
    scans = family.SCANS
    names = (["remat", "dsv3_offload", "dsv3_device"] if family is deepseek
             else activations.presets_for(scans))
    tables = {n: activations.resolve(n, {}, scans) for n in names}
    tables["all_offload"] = {s: {t: "offload" for t in tags} for s, tags in scans.items()}
    if family is llama:
        tables["all_device"] = {s: {t: "device" for t in tags} for s, tags in scans.items()}
        tables["mixed"] = {s: {t: ("device", "offload", "remat")[i % 3]
                               for i, t in enumerate(tags)} for s, tags in scans.items()}
    return tables


CASES = [(name, table) for name in FAMILIES for table in every_table(FAMILIES[name][0])]


@partial(jax.jit, static_argnums=(0, 3, 4))
def loss_and_grads(cfg, params, batch, frozen, expert_path):
    tables = None if frozen is None else {s: dict(t) for s, t in frozen}
    run = dataclasses.replace(RUN, expert_path=expert_path)
    loss = make_loss(cfg, run, forward_options(cfg, run, tables, None, Target("cpu")))
    return jax.value_and_grad(lambda p: loss(p, batch)[0])(params)


@pytest.mark.parametrize("name, table", CASES, ids=[f"{n}-{t}" for n, t in CASES])
def test_every_policy_gives_the_gradients_of_no_checkpointing(name, table):
    """Kept, offloaded or recomputed, every value is the one autodiff would keep: the loss and
    every gradient equal those of no checkpointing, to float32 reordering (another fusion of
    the recomputed forward). (The sorted experts' path under a policy: tests/test_sharding.py.)"""
    family, cfg = FAMILIES[name]
    params, batch = one_device_params(cfg), tokens(cfg, seq=13, seed=3)
    reference = loss_and_grads(cfg, params, batch, None, "tiled")  # a CPU's experts
    checked = loss_and_grads(cfg, params, batch, freeze(every_table(family)[table]), "tiled")
    assert_trees_close(checked, reference, rel=1e-5)


def test_the_scan_is_the_unrolled_loop():
    """The layers one by one in Python, each block as the scan body runs it: the same logits,
    to float32 reordering (a jitted scan and an eager loop fuse differently)."""
    cfg = TINY_LLAMA
    params, toks = one_device_params(cfg), tokens(cfg)
    cos, sin = rope_tables(toks.shape[1], rope_frequencies(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), jnp.float32)
    x = params["embed"][toks]
    for i in range(cfg.n_layers):
        x = llama.block(x, jax.tree.map(lambda w: w[i], params["layers"]), cfg, cos, sin)
    unrolled = rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["lm_head"]
    scanned, _ = llama.forward(params, toks, cfg)
    assert_trees_close(scanned, unrolled, rel=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_cpu_runs_a_short_layer_scan_unrolled_with_the_loops_gradients(name):
    """XLA's CPU backend zero-fills and copies a layer loop's stacked residuals every step, so a
    CPU program unrolls a scan of up to UNROLLED_LAYERS layers: no loop left in its compiled
    gradient, and the loop's loss and gradients (to float32 reordering). A longer scan, one
    of NVFP4 weights, a fit's (its search compares layer counts across the bound) and every
    GPU's keep the loop."""
    _, cfg = FAMILIES[name]
    params, batch = one_device_params(cfg), tokens(cfg, seq=13, seed=3)
    run = dataclasses.replace(RUN, expert_path="tiled")
    unrolled = forward_options(cfg, run, None, None, Target("cpu"))
    looped = dataclasses.replace(unrolled, unrolled=False)

    def gradient(options):
        loss = make_loss(cfg, run, options)
        return jax.jit(jax.value_and_grad(lambda p: loss(p, batch)[0])).lower(params).compile()

    compiled = [gradient(o) for o in (unrolled, looped)]
    loops = [len(re.findall(r"\bwhile\(", c.as_text())) for c in compiled]
    assert unrolled.unrolled and loops[0] == 0 and loops[1] >= 2  # forward and backward
    assert_trees_close(compiled[0](params), compiled[1](params), rel=1e-5)
    longer = dataclasses.replace(cfg, n_layers=UNROLLED_LAYERS + 1)
    assert not forward_options(longer, run, None, None, Target("cpu")).unrolled
    assert not forward_options(cfg, run, None, None, Target("gpu", (9, 0))).unrolled
    fit = dataclasses.replace(run, scale="fit")
    assert not forward_options(cfg, fit, None, None, Target("cpu")).unrolled
    nvfp4 = dataclasses.replace(run, quant="nvfp4")
    assert not forward_options(cfg, nvfp4, None, None, Target("cpu")).unrolled


def test_the_router_bias_gets_no_gradient():
    """(It has its own update rule: tests/test_training_step.py.)"""
    cfg = TINY_DEEPSEEK
    params, batch = one_device_params(cfg), tokens(cfg, seq=13, seed=3)
    _, grads = loss_and_grads(cfg, params, batch, None, "dense")
    assert not jnp.any(grads["moe_layers"]["router_bias"])


# Under a layer scan, the down projection's output is never read by the backward pass (the
# residual add's gradient needs neither input), so no placement of `mlpwo` changes anything.
NEVER_NEEDED = {"mlpwo"}
EXPORTED = {"llama": ("llama405b-offload", activations.presets_for(llama.SCANS)),
            "deepseek": ("deepseek671b-offload", ["dsv3_offload", "dsv3_device", "remat"])}


def family_of(experiment) -> str:
    return families.of(experiment.model).__name__.removeprefix("model.")


# The rows with their own tag changes over a preset: (family, preset, changes).
CHANGED = [(family_of(e), e.run.preset, e.run.tag_changes) for e in configs.EXPERIMENTS.values()
           if e.run.tag_changes]


@pytest.mark.parametrize("name, preset, changes", [
    *[(n, p, {}) for n, (_, presets) in EXPORTED.items() for p in presets],
    *CHANGED])
def test_the_exported_program_offloads_exactly_the_table(name, preset, changes):
    """At full scale (the study's mesh of 128) and as the proxy: the step exported for a GPU
    moves to host exactly the tags its table offloads that the backward pass reads. (Every
    row's placement is a preset here, or a row's changes to one.)"""
    family = FAMILIES[name][0]
    tables = activations.resolve(preset, changes, family.SCANS)
    wanted = {(scan, t) for scan, table in tables.items() for t, p in table.items()
              if p == "offload" and t not in NEVER_NEEDED}
    experiment = configs.get(EXPORTED[name][0])
    proxy_model, proxy_run = experiment.at_scale("proxy")
    for model, run, mesh in [(experiment.model, experiment.run,
                              experiment.run.mesh.shape(experiment.run.mesh.devices)),
                             (proxy_model, proxy_run, (1, 8, 1))]:
        lines = memory_plan.tag_lines(traced_step(model, run, mesh), tables)
        assert {(x.value.scan, x.value.tag) for x in lines if x.offloaded} == wanted
        assert {x.value.tag for x in lines if not x.needed} == NEVER_NEEDED


def test_every_rows_placement_is_one_exported_above():
    """(So the rows `make test-gpu-compile` does not compile for a GPU still have their
    placement checked on an exported program: tests/test_gpu_compile.py.)"""
    for experiment in configs.EXPERIMENTS.values():
        if not experiment.run.tag_changes:  # (those with changes are exported as they are)
            assert experiment.run.preset in EXPORTED[family_of(experiment)][1], experiment.name


def test_a_mismatch_between_traced_and_exported_placement_is_caught():
    """An offload that no tag asked for (a bare device_put to host) must not pass."""
    def step(x):
        hidden = jax.device_put(jnp.sin(x), jax.memory.Space.Host)
        return jax.device_put(hidden, jax.memory.Space.Device).sum()

    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    assert export.export(jax.jit(step), platforms=["cuda"])(x)  # exports fine for a GPU
    with pytest.raises(offload_proof.PlacementError):
        offload_proof.verify_offloads(jax.jit(step), x)
