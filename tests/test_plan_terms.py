"""Each term of the static memory plan (study/plan/memory_plan.py) against the GPU program XLA
compiles for it, in a small configuration where that term is by far the largest: compile-only
GPUs, as `python -m study compile NAME` builds them (tests/test_gpu_compile.py compares whole rows).

Per-layer terms are compared by what more layers add: at 8 and 16 layers, the compiled
program's arguments, temporaries and host buffers against the plan's state, gradients,
activations and transposed weights. What the plan leaves out (XLA's temporaries, workspaces
and fragmentation, one layer's backward, the loss) does not grow with the depth, so the two
differences agree, and a term wrong by a fraction of itself lands far outside. (8 and 16: at
2 and 4 layers XLA lays out the sharded temporaries differently at each depth, by 1.5 MiB.)
Per-step terms are compared on whole steps. The plan's terms for the state in host memory
(parameters=host) are checked against the abstract state's shapes alone, with no compiler."""

import functools
import typing

import jax
import jax.numpy as jnp
import pytest

from model import families
from offload.state import moment_bytes, per_device_bytes
from runtime.own_program import CompiledMemory, size_words
from study.plan import memory_plan, printed
from study.plan.traced_step import traced_step
from study.command_line import study_setup
from study.compiling.compiled_row import compile_row
from test_gpu_compile import gpus

GPU_COMPILE = pytest.mark.gpu_compile  # the compiled programs' tests; the static plan's need none

# Llama 3.1 8B's family, 1024 wide, a 4k vocabulary, on llama8b-offload's 8 GB200s with its
# settings (bf16 compute, fp32 masters and moments, the loss in 8 chunks) unless overridden.
NARROW = ["model.d_model=1024", "model.n_heads=8", "model.n_kv_heads=2", "model.d_ff=3584",
          "model.vocab=4096"]
SHORT = ["seq=128", "per_device_batch=1", "preset=remat"]  # activations of a few MiB
# 4 x 8192 tokens: the MLP's up-projections to host (448 MiB a layer), the other tags the
# backward pass reads on the device (224 MiB a layer with the layer's input).
LONG = ["seq=8192", "per_device_batch=4", "preset=minimal", "placement.mlpwi_0=offload",
        "placement.mlpwi_1=offload"]
PER_LAYER = {
    "state over 8 devices": [*NARROW, *SHORT],
    # One device: FSDP gathers nothing, so XLA makes no copy of a stacked weight.
    "gradients on one device": [*NARROW, *SHORT, "mesh.fsdp=1"],
    "long sequences on one device": [*NARROW, *LONG, "mesh.fsdp=1"],
}
# What each figure of the compiled program holds, by the plan: its state in the arguments; the
# rest of its peak (gradients, activations on device, one layer's backward, the transposed
# weights) in XLA's temporaries.
FIGURES = {"arguments": lambda p: p.device_params + p.device_optimizer,
           "temporaries": lambda p: p.peak_estimate - p.device_params - p.device_optimizer,
           "host": lambda p: p.host_activations}
LM_HEAD = ("the plan has no term for the LM head's backward: in each loss chunk XLA gathers "
           "the head in the compute dtype (for the logits, and again for their gradient) and "
           "computes its gradient whole, in fp32 as the logits are, before the reduce-scatter")


class Step(typing.NamedTuple):
    plan: memory_plan.MemoryPlan
    compiled: CompiledMemory
    inputs: int  # the device's arguments besides the planned state: its batch, step counts


@functools.cache
def compiled_step(name: str, overrides: tuple[str, ...]) -> Step:
    """`python -m study compile NAME OVERRIDES...`: the step at full scale on its
    compile-only GPUs, and its plan (with the tags where the compiled program put them)."""
    setup, gpu = study_setup(name, list(overrides))
    row = compile_row(setup, gpu, gpus(gpu.name, setup.run.mesh.devices))
    state, batch = row.program.state_shapes, row.program.batch_shape
    # With the moments on host, the optimizer's step counts (0-d) stay on the device.
    counts = [x for x in jax.tree.leaves(state["opt_state"])
              if not x.ndim and row.full_plan.optimizer_on_host]
    return Step(row.full_plan, row.compiled_memory(),
                per_device_bytes([batch, state["step"], counts]))


# Per configuration, the figures compared and the plan's term that is most of each. (One test
# per configuration: its two compiles are made once, on one worker.)
FIGURE_TERMS = {
    # Temporaries: with the stacked weights XLA copies for FSDP (memory_plan.transposed_weights).
    "state over 8 devices": [("arguments", "optimizer"), ("temporaries", "grads")],
    "gradients on one device": [("temporaries", "grads")],
    "long sequences on one device": [("temporaries", "device_activations"),
                                     ("host", "host_activations")],
}


@GPU_COMPILE
@pytest.mark.parametrize("config", list(FIGURE_TERMS))
def test_more_layers_add_what_the_plan_adds(config):
    """What 8 more layers add to a figure of the compiled program (its state arguments, its
    temporaries, its host buffers) against what they add to the plan's terms for it, `term`
    more than half of that. Nothing but the plan's own terms grows with the depth: with jax
    0.12.0.1 they agree to the byte, but for 16 KiB a layer that one device's temporaries hold
    less (0.03%). Within 0.5%, so that the largest term off by a tenth of itself fails by ten
    times the tolerance."""
    eight, sixteen = (compiled_step("llama8b-offload", (*PER_LAYER[config], f"model.n_layers={n}"))
                      for n in (8, 16))
    for figure, term in FIGURE_TERMS[config]:
        planned = FIGURES[figure](sixteen.plan) - FIGURES[figure](eight.plan)
        assert getattr(sixteen.plan, term) - getattr(eight.plan, term) > planned / 2, figure
        measured = getattr(sixteen.compiled, figure) - getattr(eight.compiled, figure)
        assert measured == pytest.approx(planned, rel=0.005), figure


# Whole steps: one planned term far above the others and above what the plan leaves out.
WHOLE = {
    # An embedding and an LM head of 128k x 1024 (the state), 128 tokens, two narrow layers.
    "a large vocabulary": ("llama8b-offload", (*NARROW, *SHORT, "model.vocab=128256",
                                               "model.n_layers=2")),
    # Two of Llama 70B's layers (1.6 GiB each, gathered in bf16) over 64 devices, 256 tokens.
    "wide layers over 64 devices": ("llama70b-offload", ("model.n_layers=2", "model.vocab=4096",
                                                         "seq=256", "per_device_batch=1",
                                                         "preset=remat")),
}


@GPU_COMPILE
@pytest.mark.parametrize("config, figure", [
    ("a large vocabulary", "arguments"),
    pytest.param("a large vocabulary", "device",
                 marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=LM_HEAD)),
    # One layer's backward: the compiled loop gathers no next layer ahead and frees each
    # gathered matrix for its gradient: its tags and one gathered layer.
    ("wide layers over 64 devices", "device"),
])
def test_a_whole_step_holds_what_the_plan_holds(config, figure):
    """The compiled program's arguments are the planned state and the device's batch, to the
    byte. Its device total is the planned peak within 5%: what the plan leaves out (XLA's
    temporaries: a few hundred tokens' f32 GEMM outputs and cotangents of one layer, a loss
    chunk's logits; workspaces; fragmentation) is tens of MiB of a total of about 2 GiB."""
    step = compiled_step(*WHOLE[config])
    if figure == "arguments":
        assert step.compiled.arguments == (step.plan.device_params + step.plan.device_optimizer
                                           + step.inputs)
    else:
        assert step.compiled.device == pytest.approx(step.plan.peak_estimate, rel=0.05)


@GPU_COMPILE
def test_host_memory_holds_the_activations_and_the_state():
    """optimizer_state=host, many times the moments' bytes in offloaded activations: the plan's
    host peak (the activations and the state, updated in place) is the compiled program's host
    memory, to the byte, and its device arguments the planned device state (no moments) and
    the batch."""
    step = compiled_step("llama8b-offload", (*NARROW, *LONG, "model.n_layers=4",
                                             "optimizer_state=host"))
    assert step.plan.host_activations > 10 * step.plan.optimizer > 0
    assert step.compiled.host == step.plan.host_peak
    assert step.compiled.arguments == (step.plan.device_params + step.plan.device_optimizer
                                       + step.inputs)


@GPU_COMPILE
def test_the_layer_weights_on_host_leave_the_compiled_device_memory_as_planned():
    """parameters=host, 8 narrow layers over 8 devices: the compiled program's device total
    drops by the layer scans' weights, their gradients and XLA's transposed copies of the
    stacks (within 0.1%: with jax 0.12.0.1, 32 KiB of 122 MiB), and its host buffers hold the
    plan's host line, to the byte. (The
    layer fetched from host adds nothing here: this step's peak lies in the LM head's
    backward, which the plan leaves out (LM_HEAD), so its device total stays above.)"""
    overrides = (*NARROW, *SHORT, "model.n_layers=8")
    device = compiled_step("llama8b-offload", overrides)
    host = compiled_step("llama8b-offload", (*overrides, "parameters=host"))
    weights = host.plan.host_params
    assert weights > 0 and device.plan.transposed_weights > 0
    assert device.compiled.device - host.compiled.device == pytest.approx(
        2 * weights + device.plan.transposed_weights, rel=1e-3)
    assert host.compiled.host == host.plan.host_peak
    assert host.plan.peak_estimate == pytest.approx(host.compiled.device, rel=0.05)


@GPU_COMPILE
def test_the_compiled_host_bytes_count_a_donated_host_buffer_once():
    """Guards the class: the compiled host bytes counting a buffer twice or not at all (a
    donated host argument and the output written over it both counted; host temporaries left
    out: tests/test_addressing.py's probe), visible only in a GPU program (a CPU's has no
    host memory space). The optimizer state on host in small, as a GPU run's step donates it:
    a moment of 1024 x 256 f32 (1 MiB) in pinned host memory, donated, brought to the device,
    updated and written back, compiled for one compile-only H200. Its bytes are in host
    memory once, argument and output alike, and nothing else is."""
    on_device = jax.sharding.NamedSharding(jax.sharding.Mesh(gpus("h200", 1).devices[:1], ("x",)),
                                           jax.sharding.PartitionSpec())
    on_host = on_device.with_memory_kind("pinned_host")

    def update(moment, grad):
        moment = jax.device_put(moment, jax.memory.Space.Device)
        return jax.device_put(0.9 * moment + 0.1 * grad, jax.memory.Space.Host)

    moment, grad = (jax.ShapeDtypeStruct((1024, 256), jnp.float32, sharding=s)
                    for s in (on_host, on_device))
    compiled = jax.jit(update, donate_argnums=0, out_shardings=on_host).trace(
        moment, grad).lower().compile()
    assert compiled.memory_analysis().host_alias_size_in_bytes > 0  # donated in host memory
    assert CompiledMemory.of(compiled).host == 1024 * 256 * 4


# The study's rows at full width, a few layers each (DeepSeek: dense and MoE scans, experts split
# over 8 devices): the static plan only, traced from abstract values.
STATE_ON_HOST = {"llama405b-offload": ["model.n_layers=4"],
                 "deepseek671b-offload": ["model.n_layers=5", "model.n_dense_layers=2"]}


class Planned(typing.NamedTuple):
    plan: memory_plan.MemoryPlan
    lines: list[str]  # its memory lines, as printed
    state: dict  # the abstract train state it read
    scans: list  # the state's stacked layer weights, one tree per layer scan


def planned(name: str, *overrides: str) -> Planned:
    """`python -m study plan NAME OVERRIDES...`."""
    setup, gpu = study_setup(name, list(overrides))
    run = setup.run
    state = traced_step(setup.model, run, run.mesh.shape(run.mesh.devices)).state
    plan = memory_plan.full_scale(setup.experiment, gpu, setup.placement)
    return Planned(plan, printed.memory_lines(plan, gpu, run), state,
                   [state["params"][s] for s in families.of(setup.model).SCANS])


@pytest.mark.parametrize("name", list(STATE_ON_HOST))
def test_the_layer_weights_on_host_leave_the_device_plan_for_the_host_line(name):
    """parameters=host, from the abstract state's shapes: the device figure loses the layer
    scans' weights and gradients (and the stacked copies XLA transposes), and gains the widest
    layer's weights and gradient while its backward pass runs; the host line gains the weights
    and gradients (the update writes them over themselves); the host link
    carries, as the traced step moves them, the weights' bytes four times to the device (a
    layer's weights for its forward pass and its recompute, model/layers.py; its gradient
    and weights for the update, offload/state.py: the global norm is summed in the backward
    pass) and twice back (gradients, new weights) per step, and DeepSeek's router bias once
    more each way for its own update (trainer/step.py). Nothing else changes."""
    device = planned(name, *STATE_ON_HOST[name]).plan
    host, lines, _, scans = planned(name, *STATE_ON_HOST[name], "parameters=host")
    weights = per_device_bytes(scans)
    widest = max(per_device_bytes(scan) // jax.tree.leaves(scan)[0].shape[0] for scan in scans)
    assert host.host_params == weights > 0 and device.host_params == 0
    assert (device.device_params - host.device_params, device.device_grads - host.device_grads
            ) == (weights, weights)
    assert device.peak_estimate - host.peak_estimate == (2 * weights - 2 * widest
                                                          + device.transposed_weights)
    for term in ("optimizer", "device_activations", "layer_working_set", "host_activations",
                 "pipelined"):
        assert getattr(host, term) == getattr(device, term), term
    assert device.host_activations > weights
    assert host.host_peak - device.host_peak == 2 * weights
    bias = per_device_bytes([scan["router_bias"] for scan in scans if "router_bias" in scan])
    assert (bias > 0) == name.startswith("deepseek")
    to_device, to_host = 4 * weights + bias, 2 * weights + bias
    assert (host.link, device.link) == ((to_device, to_host), (0, 0))
    assert any(line.startswith("parameters") and f"{size_words(to_device)} host->device and "
               f"{size_words(to_host)} device->host over the host link per step" in line
               for line in lines)


def test_the_moments_and_the_weights_on_host_cross_the_host_link_each_as_alone():
    """optimizer_state=host moves the moments (the optimizer state but its 0-d step counts)
    once each way per step; with parameters=host as well, both moves add up, and the host
    line holds the weights, their gradients and the moments beside the activations (the
    update writes the state over itself)."""
    name, overrides = "llama405b-offload", STATE_ON_HOST["llama405b-offload"]
    moments, _, state, scans = planned(name, *overrides, "optimizer_state=host")
    both = planned(name, *overrides, "optimizer_state=host", "parameters=host").plan
    weights = per_device_bytes(scans)
    m = per_device_bytes([x for x in jax.tree.leaves(state["opt_state"]) if x.ndim])
    assert moment_bytes(state["opt_state"]) == m > 0
    assert moments.link == (m, m)
    assert both.link == (4 * weights + m, 2 * weights + m)
    assert both.link_params == (4 * weights, 2 * weights)
    held = weights + both.moments  # between steps
    assert both.host_peak == held + weights + both.host_activations
