"""optimizer_state=host (offload/state.py): the same training to the bit as the state on
the device, across a checkpoint; the plan and the search that move its bytes to host (the
compiled GPU program: tests/test_gpu_compile.py, its every-row test); bad input."""

import dataclasses
import json

import jax
import pytest

import configs
from conftest import start_state
from study.hardware.gpus import gpu_of
from study.plan import memory_plan
from study.search import candidates, ranking
from study.search.placements import placement_text
from model import families
from model.params import abstract_params, param_count
from offload import state as host_state
from runtime import own_program
from runtime import setup as runtime_setup
from test_checkpoints import SMALL, assert_bit_identical, cli, losses, saved_params
from trainer import target as trainer_target

GiB = 2**30
# Without NVFP4 (tests/test_checkpoints.py resumes it), whose emulation slows a CPU step;
# every step clipped (its gradient norm is 1-2), so that the norm's every bit counts.
ROWS = {"llama405b-offload": ["quant=none", "optimizer.clip_norm=0.1"],
        "deepseek671b-offload": ["mesh.expert=4", "optimizer.clip_norm=0.1"]}


def norms(run_dir) -> list[float]:
    return [json.loads(line)["grad_norm"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name, parameters, optimizer_state", [
    ("llama405b-offload", "device", "host"), ("deepseek671b-offload", "device", "host"),
    ("llama405b-offload", "host", "host"), ("deepseek671b-offload", "host", "device")])
def test_the_state_on_host_trains_to_the_bit_as_on_the_device_across_a_resume(
        name, parameters, optimizer_state, tmp_path, capsys):
    """Both families, sharded over 8 CPU devices (which have pinned_host memory): 4 steps with
    the whole state on the device; 4 with part of it on host (the moments, the layers'
    weights, or both), checkpointed at 2, and steps 3-4 again from there, once as checkpointed
    and once with the state on the device. Every loss and every final weight equal; the
    restored state lies where its run asks."""
    args = [name, *SMALL, *ROWS[name]]
    assert cli([*args, "checkpoint_every=4", f"out_dir={tmp_path / 'device'}"], capsys)[0] == 0
    placed = [f"parameters={parameters}", f"optimizer_state={optimizer_state}"]
    host = [*args, *placed, "checkpoint_every=2", f"out_dir={tmp_path / 'host'}"]
    code, _, err = cli(host, capsys)
    assert code == 0, err
    (on_device,), (on_host,) = (tmp_path / "device").iterdir(), (tmp_path / "host").iterdir()
    step_2 = f"resume={on_host / 'checkpoints' / '2'}"
    code, _, err = cli([*host, step_2], capsys)
    assert code == 0, err
    (resumed,) = set((tmp_path / "host").iterdir()) - {on_host}
    code, _, err = cli([*args, "checkpoint_every=2", f"out_dir={tmp_path / 'back'}", step_2],
                       capsys)
    assert code == 0, err
    (back,) = (tmp_path / "back").iterdir()
    assert losses(on_host) == losses(on_device) and list(losses(on_device)) == [1, 2, 3, 4]
    assert norms(on_host) == norms(on_device) and min(norms(on_device)) > 0.1  # clipped
    for run in (resumed, back):
        assert losses(run) == {k: v for k, v in losses(on_device).items() if k > 2}
    setup = runtime_setup.resolve(name, [*SMALL, *ROWS[name], *placed], jax.devices())
    like = abstract_params(families.of(setup.model).param_specs(setup.model))
    final = saved_params(on_device / "checkpoints" / "4", like)
    for run in (on_host, resumed, back):
        assert_bit_identical(saved_params(run / "checkpoints" / "4", like), final)

    target = trainer_target.this_machine()
    state, step = start_state(
        dataclasses.replace(setup, resume=runtime_setup.checkpoints.find(str(resumed), "", "")),
        target)
    host_kind = {"host": "pinned_host", "device": "device"}
    kinds = {(x.ndim > 0, x.sharding.memory_kind) for x in jax.tree.leaves(state["opt_state"])}
    assert step == 4 and kinds == {(True, host_kind[optimizer_state]), (False, "device")}
    scans = families.of(setup.model).SCANS
    for key, tree in state["params"].items():
        kind = host_kind[parameters] if key in scans else "device"
        assert {x.sharding.memory_kind for x in jax.tree.leaves(tree)} == {kind}, key


def test_70b_on_one_h200_host_fits_only_with_the_state_on_host():
    """Llama 3.1 70B, FSDP 8 on H200s: FP32 weights, gradients and moments alone leave less
    than 2% of the pool; with the moments on host the plan fits, and the host line holds them
    beside the activations (updated in place)."""
    experiment = configs.get("llama70b-8xh200")
    tables = runtime_setup.resolve_placement(experiment.model, experiment.run)
    on_host = memory_plan.full_scale(experiment, gpu_of(experiment.name), tables)
    device_run = dataclasses.replace(experiment.run, optimizer_state="device")
    on_device = memory_plan.full_scale(dataclasses.replace(experiment, run=device_run),
                                       gpu_of(experiment.name), tables)
    specs = families.of(experiment.model).param_specs(experiment.model)
    moments = 2 * 4 * param_count(specs) / 8
    assert on_host.optimizer == on_device.optimizer == pytest.approx(moments, abs=64)
    assert on_device.peak_estimate - on_host.peak_estimate == on_device.optimizer
    assert on_host.host_peak == on_host.moments + on_host.host_activations
    assert on_host.fits and not on_device.fits
    assert on_device.params + on_device.grads + on_device.optimizer > 0.98 * on_device.capacity


def test_the_search_weighs_the_state_placement():
    """The same tables with the state on host: its bytes leave the device for the host (beside
    the activations: updated in place), and its transfer each way is added, exposed."""
    scan = ranking.Scan("layers", 4, (ranking.Tag("decoder_layer_input", 10, 0, 0, 0),
                                      ranking.Tag("query_proj", 30, 0.2, 1e9, 0)),
                        4e12, 8e12, 1e12, 0, 0, 100)
    work = ranking.Workload(1, (scan,), 0.0, 1000, 1e13, state_bytes=400)
    hw = ranking.Hardware("test", 1e15, 1e11, 1e2, 8, 10**6, 10**6)
    found = candidates.search({1: work}, hw, [ranking.Schedule(True)])
    by_state = {}
    for p in found:
        by_state.setdefault((p.candidate.placement, p.candidate.optimizer_state), p)
    for (tables, state), p in by_state.items():
        if state == "device":
            continue
        twin = by_state[tables, "device"]
        assert twin.device_bytes - p.device_bytes == 400
        assert p.host_bytes == 400 + twin.host_bytes
        assert p.step_s - twin.step_s == pytest.approx(400 / 1e2)
    assert "AdamW moments on host" in placement_text(p.candidate, ["layers"])
    assert "optimizer_state=host" in ranking.overrides(p.candidate, ["layers"])


def test_bad_state_placements_are_one_line(tmp_path, capsys):
    code, _, err = cli(["llama405b-offload", *SMALL, "optimizer_state=disk",
                        f"out_dir={tmp_path}"], capsys)
    assert code == 2 and "optimizer_state='disk': choose one of device, host" in err
    # 70B's moments on 8 CPU devices: 66 GiB per device, more than any host here.
    full_width = [f"model.{k}={v}" for k, v in dataclasses.asdict(
        configs.get("llama70b-8xh200").model).items() if isinstance(v, int)]
    code, _, err = cli(["llama70b-8xh200", "seq=32", *full_width, f"out_dir={tmp_path}"], capsys)
    assert code == 2 and "optimizer_state=host: the state in host memory needs" in err
    assert len(err.strip().splitlines()) == 1 and not any(tmp_path.iterdir())


def test_the_state_in_host_memory_asks_for_a_backend_and_a_host_that_have_it(tmp_path, capsys):
    """A backend without pinned host memory, a host too small for the state and its
    gradients, and parameters=host without a checkpoint policy: one line each; the command
    line's is exit status 2 with nothing written."""
    run = configs.RunConfig(parameters="host")
    assert runtime_setup.state_problem(run, "rocm", {"device"}, 1, 2) == (
        "parameters=host: the rocm backend has no pinned_host memory (it has device)")
    both = dataclasses.replace(run, optimizer_state="host")
    assert runtime_setup.state_problem(both, "gpu", {"device", "pinned_host"}, 3 * GiB,
                                       2 * GiB).startswith(
        "parameters=host optimizer_state=host: the state in host memory needs 3.0 GiB here "
        "(with the weights' gradients), the host has 2.0 GiB")
    assert runtime_setup.state_problem(run, "gpu", {"device", "pinned_host"}, 1, 2) is None
    assert runtime_setup.state_problem(configs.RunConfig(), "rocm", {"device"}, 1, 0) is None
    code, _, err = cli(["llama405b-offload", *SMALL, "parameters=host", "preset=none",
                        f"out_dir={tmp_path}"], capsys)
    assert code == 2 and err.strip() == ("error: parameters=host needs a preset: without "
                                         "checkpointing "
                                         "the backward pass keeps every layer's weights on the "
                                         "device")
    assert not any(tmp_path.iterdir())


def test_a_step_with_the_weights_on_host_moves_them_a_layer_at_a_time():
    """The traced step of a 2-layer Llama with parameters=host: its host-link bytes, read off
    the jaxpr, are the layer scan's weights' bytes four times to the device (forward, backward,
    the update's gradients and weights: the gradient norm is taken in the backward pass, not
    read back) and twice to host (gradients, new weights): nothing else of the state crosses,
    and with it on the device nothing does."""
    setup = runtime_setup.resolve("llama405b-offload", [*SMALL, "quant=none", "parameters=host"],
                                  jax.devices())
    target = trainer_target.this_machine()
    program = runtime_setup.Program(setup.model, setup.run, setup.placement, target)
    weights = host_state.per_device_bytes(program.state_shapes["params"]["layers"])
    devices = len(target.devices)
    to_host, to_device = own_program.link_bytes(program.traced.jaxpr, devices)
    activations = sum(v.nbytes * v.count for sites in own_program.offloaded(
        program.traced.jaxpr).values() for v in sites) / devices  # (batch-sharded)
    assert to_host == pytest.approx(2 * weights + activations)
    assert to_device == pytest.approx(4 * weights + activations)
    plain = runtime_setup.Program(setup.model, dataclasses.replace(setup.run, parameters="device"),
                                  setup.placement, target)
    assert own_program.link_bytes(plain.traced.jaxpr, devices) == pytest.approx(
        (activations, activations))
