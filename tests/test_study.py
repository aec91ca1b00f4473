"""The study's facts (docs/study.md), pinned here and only here: what each row offloads, the
memory figures the model code must give, which DeepSeek rows fit; every registered experiment
sound at both scales. tests/test_gpu_compile.py checks the compiled programs against these."""

import ast
import math
from pathlib import Path

import pytest

import configs
from study.plan import memory_plan
from study.plan import traced_step as traced_step_module
from study.plan.traced_step import TracedStep
from study.programs import jaxpr
from study.search.tracer import Tracer
from study.__main__ import main as study_main
from study.hardware.compile_only import pool_bytes
from study.hardware.gpus import EXPERIMENT_GPUS, GPUS, gpu_of
from conftest import TINY_DEEPSEEK
from model import deepseek, families, llama
from offload import activations
from runtime import backend
from runtime.setup import resolve_placement

MiB, GiB = 2**20, 2**30
STUDY = Path(__file__).resolve().parent.parent / "study"
# The functools caches of study/ that keep no trace: compile-only devices, and arithmetic.
NOT_TRACES = {("hardware/compile_only.py", "compile_only"), ("search/ranking.py", "all_to_all_s")}
# What each row offloads, from the study's text (not from the presets): Q, K and V in the
# Llama offload rows; in DeepSeek's the MLA query and key/value projection intermediates
# (MaxText's names for them: the JAX-Toolbox recipe's) and the routed experts'
# up-projections in the MoE layers, the MLP up and down projections in the dense ones.
LLAMA_OFFLOADED = {"layers": {"query_proj", "key_proj", "value_proj"}}
DEEPSEEK_OFFLOADED = {"dense_layers": {"mlpwi_0", "mlpwi_1", "mlpwo"},
                      "moe_layers": {"query_wa_proj", "kv_wa_proj", "moe_mlpwi_0",
                                     "moe_mlpwi_1"}}
# The study's GPU memory per device where it gives one (DeepSeek-V3, 128 GB200s).
STUDY_MEMORY_GIB = {"deepseek671b-offload": 165.2, "deepseek671b-offload-nolhs": 145.6}


def full_plan(name: str) -> memory_plan.MemoryPlan:
    experiment = configs.get(name)
    return memory_plan.full_scale(experiment, gpu_of(experiment.name),
                                  resolve_placement(experiment.model, experiment.run))


def test_the_llama_rows_offload_q_k_and_v():
    tables = activations.resolve("qkv_offload", {}, llama.SCANS)
    assert tables == {s: {t: "offload" for t in tags} for s, tags in LLAMA_OFFLOADED.items()}
    assert {configs.get(n).run.preset for n in configs.COMPARISONS["llama405b-compare"]} == {
        "remat", "qkv_offload"}


def test_the_deepseek_rows_place_the_studys_tensors():
    """Offloaded in `dsv3_offload`, kept on device in `dsv3_device`, tag by tag."""
    for preset, place in [("dsv3_offload", "offload"), ("dsv3_device", "device")]:
        tables = activations.resolve(preset, {}, deepseek.SCANS)
        assert tables == {s: {t: place for t in tags} for s, tags in DEEPSEEK_OFFLOADED.items()}


def test_the_llama405b_offload_memory_facts():
    """Per GPU at batch 2 x 8192, bf16: Q 512 MiB, K and V 32 MiB each per layer, 70.9 GiB
    over 126 layers; FSDP over 128 of 405,853,388,800 fp32 weights and Adam's two moments."""
    planned = full_plan("llama405b-offload")
    per_layer = {line.value.tag: line.value.nbytes for line in planned.tags if line.offloaded}
    assert per_layer == {"query_proj": 512 * MiB, "key_proj": 32 * MiB, "value_proj": 32 * MiB}
    assert planned.host_activations == 126 * 576 * MiB
    assert f"{planned.host_activations / GiB:.1f}" == "70.9"
    assert planned.params == 405_853_388_800 * 4 // 128
    assert planned.optimizer == 2 * planned.params + 8  # + two int32 counts (Adam, schedule)
    assert planned.device_activations > 126 * 512 * MiB  # at least the layer inputs
    baseline = full_plan("llama405b-baseline")
    assert baseline.host_activations == 0 and not any(t.offloaded for t in baseline.tags)


def test_the_deepseek_offload_row_stores_its_tensors_on_host():
    """Per GPU at micro batch 8 x 4096 tokens, bf16, from the tensors' shapes: the MLA
    latents' down-projections [8, 4096, 1536 / 512 + 64], and the experts' up-projections
    over their blocks, received from the 8 devices of the expert group for each of the 32
    experts a device holds: 256 blocks of ceil(1.0 x 8 x 4096 x 8 / 256) = 1024 rows x 2048,
    in each of 58 MoE layers; the dense MLP's [8, 4096, 18432] up-projections in each of 3
    dense layers (its down-projection is never read by the backward pass: nothing to
    store)."""
    tokens = 8 * 4096
    latents = tokens * (1536 + 576) * 2
    experts = 2 * 32 * 8 * math.ceil(1.0 * tokens * 8 / 256) * 2048 * 2
    dense = 2 * tokens * 18432 * 2
    host = 58 * (latents + experts) + 3 * dense
    assert f"{host / GiB:.1f}" == "130.2"
    assert full_plan("deepseek671b-offload").host_activations == host


def test_the_deepseek_rows_fit_as_the_study_found():
    """Saving the selected activations on device fits at micro batch 2, not at 8; offloading
    them fits at 8, with host memory to spare (128 GB200s, experts split over the GPUs)."""
    fits = {name: full_plan(name) for name in ("deepseek671b-device", "deepseek671b-device-mb8",
                                               "deepseek671b-offload")}
    assert fits["deepseek671b-device"].fits
    assert fits["deepseek671b-device-mb8"].peak_estimate > fits["deepseek671b-device-mb8"].capacity
    offload = fits["deepseek671b-offload"]
    assert offload.fits and offload.host_activations > 100 * GiB


def test_the_rows_made_for_other_gpus_name_experiments_and_gpus_the_study_has():
    """study/hardware/gpus.py EXPERIMENT_GPUS: a renamed experiment would silently fall back to
    GB200s."""
    assert set(EXPERIMENT_GPUS) <= set(configs.EXPERIMENTS)
    assert {gpu_of(name).name for name in configs.EXPERIMENTS} <= set(GPUS)
    assert gpu_of("llama70b-8xh200").name == "h200" and gpu_of("llama405b-offload").name == "gb200"


def test_plans_measure_against_the_memory_jax_takes(monkeypatch):
    """The DeepSeek offload row's plan is measured against the 95% of a GB200 the trainer
    gives XLA's pool, and its verdict follows the pool: at 70% it does not fit (its compiled
    program, 142.3 GiB per GPU, does not fit JAX's default 75% either: docs/placement.md)."""
    gpu = GPUS["gb200"]
    assert gpu.memory == 197_897_748_480  # the spec's device_memory_size: 184.3 GiB
    assert pool_bytes(gpu) == int(0.95 * gpu.memory)
    assert full_plan("deepseek671b-offload").fits
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.70")
    assert pool_bytes(gpu) == int(0.70 * gpu.memory)
    assert not full_plan("deepseek671b-offload").fits


def test_the_plan_keeps_a_devices_own_experts_whole():
    """Under expert parallelism without an fsdp axis a device holds its experts whole: the
    plan must not divide what it saves of them (their bf16 casts, without checkpointing) by
    the expert axis again."""
    run = configs.RunConfig(preset="none", mesh=configs.MeshConfig(fsdp=1, expert=2), seq=16,
                            per_device_batch=1, compute_dtype="bfloat16")
    step = TracedStep(TINY_DEEPSEEK, run, (1, 1, 2))
    planned = memory_plan.plan(step, None, memory_plan.tag_lines(step, None), 10**12, 10**12)
    own = (TINY_DEEPSEEK.n_moe_layers, TINY_DEEPSEEK.n_experts // 2, TINY_DEEPSEEK.d_model,
           TINY_DEEPSEEK.moe_d_ff)
    assert TINY_DEEPSEEK.n_moe_layers % 2 == 0  # what a second division would have halved
    assert own in {r.shape for r in planned.residuals}


def test_plan_command_prints_the_study_facts(capsys, monkeypatch):
    """The Llama offload rows' 70.9 GiB per GPU in host memory: within what a run on a GB200
    tray may pin (3/4 of 4 x 240 GB, a quarter each: 167.6 GiB), not within XLA's own 64 GiB
    a process, which a shell that sets it keeps."""
    assert study_main(["plan", "llama405b-offload"]) == 0
    out = capsys.readouterr().out
    assert "= 576 MiB per layer; x 126 layers = 70.9 GiB in host memory" in out
    assert "WARNING" not in out and "peak device (estimate)" in out
    monkeypatch.setattr(backend, "HOST_LIMIT_GIVEN", True)
    monkeypatch.setenv(backend.HOST_LIMIT_VARIABLE, "64")
    assert study_main(["plan", "llama405b-offload"]) == 0
    assert ("WARNING: 70.9 GiB of host memory per GPU exceed the pinned host memory a run may "
            "hold per GPU on a gb200 host (16.0 GiB): set XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=78 x"
            ) in capsys.readouterr().out


@pytest.mark.parametrize("name", list(configs.EXPERIMENTS))
@pytest.mark.parametrize("scale", ["proxy", "full"])
def test_every_experiment_is_sound_at_both_scales(name, scale):
    experiment = configs.get(name)
    model, run = experiment.at_scale(scale)
    devices = run.mesh.devices if scale == "full" else 8
    assert configs.problems(model, run, devices) == []
    if run.preset != activations.NO_CHECKPOINT:
        activations.resolve(run.preset, run.tag_changes, families.of(model).SCANS)


def test_rows_that_differ_in_placement_and_flags_share_one_traced_step(monkeypatch):
    """The one trace cache (study/plan/traced_step.py): the search's tracers of two rows that
    differ only in XLA flags get one step from traced_step(), and what the first traced the
    second reads back, nothing traced again."""
    built, traced = [], []

    class Counted(TracedStep):
        def __init__(self, *args):
            built.append(args)
            super().__init__(*args)

    work = jaxpr.work
    monkeypatch.setattr(traced_step_module, "_STEPS", {})
    monkeypatch.setattr(traced_step_module, "TracedStep", Counted)
    monkeypatch.setattr(jaxpr, "work", lambda *a, **k: traced.append(a) or work(*a, **k))
    steps = []
    for name in ("llama405b-offload", "llama405b-offload-nolhs"):
        tracer = Tracer(configs.get(name), gpu_of(name))
        steps.append(tracer.step(1))
        tracer.recompute(1, tracer.remat)  # the gradient with no table and with all recomputed
    assert steps[0] is steps[1] and len(built) == 1 and len(traced) == 2


def test_the_study_has_one_trace_cache():
    """Only study/plan/traced_step.py keeps traced programs for later: no other study module
    builds a TracedStep itself or holds a module-level dict filled as it runs, and functools
    caches only what is no trace."""
    found = []
    for path in sorted(STUDY.rglob("*.py")):
        where = path.relative_to(STUDY).as_posix()
        if where == "plan/traced_step.py":
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            value = getattr(node, "value", None)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and (
                    (isinstance(value, ast.Dict) and not value.keys) or (
                        isinstance(value, ast.Call) and not (value.args or value.keywords)
                        and ast.unparse(value.func).split(".")[-1] in ("dict", "defaultdict"))):
                found.append(f"{where}:{node.lineno}: an empty module-level dict")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("TracedStep"):
                found.append(f"{where}:{node.lineno}: a TracedStep not from traced_step()")
            if isinstance(node, ast.FunctionDef) and (where, node.name) not in NOT_TRACES:
                found += [f"{where}:{node.lineno}: {node.name} cached" for d in node.decorator_list
                          if ast.unparse(d).split("(")[0].split(".")[-1] in ("cache", "lru_cache")]
    assert found == []
