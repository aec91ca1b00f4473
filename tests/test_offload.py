"""Placement: the exported GPU program offloads exactly what the table says, and the
full-scale memory facts of the study come out of the model code."""

import jax
import jax.numpy as jnp
import pytest
from jax import export

import configs
from analysis import plan
import train
from analysis import memory as memory_, placement
from analysis.traced import TracedStep
from offload import policies
from model import llama

MiB, GiB = 2**20, 2**30
# Under a layer scan, the down projection's output is never read by the backward pass (the
# residual add's gradient needs neither input), so no placement of `mlpwo` changes anything.
NEVER_NEEDED = {"mlpwo"}


def planned(experiment, table):
    step = TracedStep(experiment.model, experiment.run, (1, 128))
    return memory_.plan(step, table, memory_.tag_lines(step, table), 186 * 10**9, 240 * 10**9)


def programs(table):
    experiment = configs.get("llama405b-offload")
    proxy_model, proxy_run = experiment.at_scale("proxy")
    yield "full", TracedStep(experiment.model, experiment.run, (1, 128))
    yield "proxy", TracedStep(proxy_model, proxy_run, (1, 8))


@pytest.mark.parametrize("preset", policies.presets_for(llama.SCANS))
def test_the_exported_program_offloads_exactly_the_table(preset):
    tables = policies.placement_tables(preset, {}, llama.SCANS)
    wanted = {tag for tag, place in tables["layers"].items() if place == "offload"}
    for scale, program in programs(tables):
        lines = memory_.tag_lines(program, tables)
        assert {line.value.tag for line in lines if line.offloaded} == wanted - NEVER_NEEDED
        assert {line.value.tag for line in lines if not line.needed} == NEVER_NEEDED, scale


def test_a_mismatch_between_traced_and_exported_placement_is_caught():
    """An offload that no tag asked for (a bare device_put to host) must not pass."""
    def step(x):
        hidden = jax.device_put(jnp.sin(x), jax.memory.Space.Host)
        return jax.device_put(hidden, jax.memory.Space.Device).sum()

    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    assert export.export(jax.jit(step), platforms=["cuda"])(x)  # exports fine for a GPU
    with pytest.raises(placement.PlacementError):
        placement.verify_offloads(jax.jit(step), x)


def test_the_study_memory_facts_for_llama405b_offload():
    experiment = configs.get("llama405b-offload")
    table = policies.placement_tables(experiment.run.policy, {}, llama.SCANS)
    memory = planned(experiment, table)
    per_layer = {line.value.tag: line.value.nbytes for line in memory.tags if line.offloaded}
    assert per_layer == {"query_proj": 512 * MiB, "key_proj": 32 * MiB, "value_proj": 32 * MiB}
    assert memory.host_activations == 126 * 576 * MiB
    assert f"{memory.host_activations / GiB:.1f}" == "70.9"
    # FSDP over 128: 405,853,388,800 fp32 weights, Adam's two moments.
    assert memory.params == 405_853_388_800 * 4 // 128
    assert memory.optimizer == 2 * memory.params + 8  # + two int32 counts (Adam, schedule)
    assert memory.device_activations > 126 * 512 * MiB  # at least the layer inputs


def test_the_baseline_offloads_nothing_and_stores_nothing_on_host():
    experiment = configs.get("llama405b-baseline")
    table = policies.placement_tables(experiment.run.policy, {}, llama.SCANS)
    memory = planned(experiment, table)
    assert memory.host_activations == 0
    assert not any(line.offloaded for line in memory.tags)


def test_plan_command_prints_the_study_facts(capsys):
    assert train.main(["llama405b-offload", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "= 576 MiB per layer; x 126 layers = 70.9 GiB in host memory" in out
    assert "WARNING" in out and plan.HOST_POOL_VARIABLE in out
    assert "peak device (estimate)" in out


def test_plan_command_rejects_bad_input(capsys):
    assert train.main(["llama405b-offload", "--plan", "policy.nothing=offload"]) == 2
    assert capsys.readouterr().err.startswith("error: policy.nothing")
    assert train.main(["llama405b-offload", "--plan", "model.d_ff=1000"]) == 2
    assert capsys.readouterr().err.startswith("error: quant=nvfp4: NVFP4 needs axis")


def test_unknown_tags_and_placements_are_errors():
    llama_scans = llama.SCANS
    with pytest.raises(ValueError, match="no tag"):
        policies.placement_tables("remat", {"qkv_proj": "offload"}, llama_scans)
    with pytest.raises(ValueError, match="placement"):
        policies.placement_tables("remat", {"query_proj": "hbm"}, llama_scans)
    with pytest.raises(ValueError, match="no layer scan"):
        policies.placement_tables("remat", {"moe_layers.query_proj": "offload"}, llama_scans)
