"""The GPU program, compiled on this CPU machine for the study's GPUs (compile-only devices made
from XLA's target specs): every experiment row through the builder a GPU run uses, and what
XLA really does with the offloads, against the study's tables (tests/test_study.py)."""

import collections
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import configs
from study.compiling import compiled_row, fit_table
from study.programs import addressing, hlo
from study.timing import predicted_step, replay
from study.programs.hlo import parse_module
from study.plan.traced_step import TracedStep
from study.hardware.compile_only import (DEVICELESS, CompileOnly, compile_only, kernel_checks,
                                         pool_bytes)
from study.compiling.compiled_row import CompiledRow, compile_row
from study.hardware.gpus import GPUS, gpu_of
from configs import PIPELINED

from model import families
from model.config import DeepSeekConfig
from model.layers import causal_attention
from offload import state as host_state
from runtime import backend, header, own_program, report
from runtime import setup as runtime_setup
from test_study import DEEPSEEK_OFFLOADED, LLAMA_OFFLOADED, STUDY_MEMORY_GIB
from test_invariances import NEVER_NEEDED
from study.__main__ import main as study_main
from trainer import target as trainer_target

GiB = 2**30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Fewer layers, full width, the real sequence and micro batch. Two per scan: XLA stacks an
# offloaded value in host memory only in a loop that runs more than once (see below).
FEWER_LAYERS = {"llama": ["model.n_layers=2"],
                "deepseek": ["model.n_layers=4", "model.n_dense_layers=2"]}


def in_host(offloaded: dict) -> set:
    """The study's tensors of a row that a compiled program can keep in host memory: those
    the backward pass reads."""
    return {(s, t) for s, tags in offloaded.items() for t in tags if t not in NEVER_NEEDED}


LLAMA_QKV, DEEPSEEK = in_host(LLAMA_OFFLOADED), in_host(DEEPSEEK_OFFLOADED)
IN_HOST_MEMORY = {
    "llama405b-baseline": set(), "llama405b-offload": LLAMA_QKV,
    "llama405b-offload-nolhs": LLAMA_QKV, "llama405b-offload-pipelined": LLAMA_QKV,
    "llama8b-offload": LLAMA_QKV, "llama70b-offload": LLAMA_QKV,
    "deepseek671b-remat": set(), "deepseek671b-offload-nolhs": DEEPSEEK,
    "deepseek671b-offload": DEEPSEEK, "deepseek671b-device": set(),
    "deepseek671b-device-mb8": set(),
    "llama70b-8xh200": {("layers", t) for t in ("query_proj", "key_proj", "value_proj",
                                                "attention_out", "mlpwi_1")},
    # The placement search's best (README), pinned from its `run it:` line:
    "llama405b-searched": {("layers", t) for t in ("key_proj", "value_proj", "mlpwi_0",
                                                   "mlpwi_1")},
    "shakespeare": set(),  # its activations kept on the device (preset minimal)
}
# The DeepSeek rows whose memory the study gives compile at full depth and must fit in it.
# (All rows at full depth: study/compiling/compile_table.py, a few minutes here.)
FULL_DEPTH = {"deepseek671b-offload", "deepseek671b-offload-nolhs"}
# Latency hiding on and off (assert_scheduled).
LHS_ROWS = {"deepseek671b-offload": True, "deepseek671b-offload-nolhs": False}
# The rows `make test-gpu-compile` compiles: together they show each thing only a GPU compile
# shows, once (FP4 GEMMs and gathers, LHS on and off, pipelined offload and the same step
# without the flag, Hopper and the state on host, MLA and the expert exchanges, the study's
# memory). The other rows' placements are checked on their exported programs
# (tests/test_invariances.py); their full-width compiles, ~3 minutes more here, run in
# `make test-all` (marked slow).
COMPILED_IN_CI = {"llama405b-offload", "llama70b-8xh200", *FULL_DEPTH}


def rows(names, compiled=COMPILED_IN_CI) -> list:
    return [pytest.param(n, marks=[] if n in compiled else pytest.mark.slow)
            for n in sorted(names)]


@functools.cache
def gpus(name: str, count: int) -> trainer_target.Target:
    return compile_only(GPUS[name], count)


def built_as_a_gpu_run(name: str, overrides: list[str], device: str = "") -> CompiledRow:
    """What `python train.py NAME ...` does on the experiment's own GPUs (or `device`s) up to
    its first step: resolve against the devices there, then build; with the full-scale plan
    and this run's placement list read off the compiled program
    (study/compiling/compiled_row.py)."""
    run, gpu = configs.get(name).run, gpu_of(name, device)
    target = gpus(gpu.name, run.mesh.devices)
    setup = runtime_setup.resolve(name, overrides, target.devices)
    assert setup.scale == "full"
    return compile_row(setup, gpu, target)


def custom_call_operands(hlo: str, target: str) -> list[list[tuple[int, ...]]]:
    """The operand shapes of every custom call to `target` in an optimized HLO module."""
    found = []
    for line in hlo.splitlines():
        if f'custom_call_target="{target}"' in line:
            operands = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", line)
            found.append([tuple(map(int, dims.split(","))) for dims in
                          re.findall(r"\w+\[([\d,]+)\]", operands.group(1))])
    return found


def _reachable(module, computation: str) -> list:
    """The instructions a computation runs, through fusions, calls and async wrappers (not
    into nested loops)."""
    found = []
    for ins in module.computations[computation].instructions:
        found.append(ins)
        if ins.opcode != "while":
            found += [i for c in ins.called() if c in module.computations
                      for i in _reachable(module, c)]
    return found


def _leaves(shape):
    for element in shape.elements or ():
        yield from _leaves(element)
    if shape.elements is None:
        yield shape


def _body(loop) -> str:
    return re.search(r"body=%?([\w.\-]+)", "body=" + loop.attrs["body"]).group(1)


def layer_loops(module) -> list[collections.Counter]:
    """Per while loop that runs block-scaled dots (a layer scan, forward or backward): its
    FP4 GEMMs by the named scope of fp4.matmul (fp4_fprop / fp4_dgrad / fp4_wgrad)."""
    loops = []
    for computation in module.computations.values():
        for loop in (i for i in computation.instructions if i.opcode == "while"):
            gemms = collections.Counter(
                (re.findall(r"fp4_(fprop|dgrad|wgrad)", i.attrs.get("metadata", "")) or
                 ["elsewhere"])[0] for i in _reachable(module, _body(loop))
                if i.opcode == "custom-call"
                and "blockScaledDot" in i.attrs.get("custom_call_target", ""))
            if gemms:
                loops.append(gemms)
    return loops


def executed_gathers(module, computation: str = "", times: int = 1) -> collections.Counter:
    """(dtype, shape) of every array an all-gather delivers, times how often a step runs it
    (loops by their known trip counts)."""
    found = collections.Counter()
    for ins in module.computations[computation or module.entry.name].instructions:
        if ins.opcode == "while":
            trips = int(ins.backend_config().get("known_trip_count", {}).get("n", 1))
            found += executed_gathers(module, _body(ins), times * trips)
            continue
        if ins.opcode in ("all-gather", "all-gather-start"):
            leaves = list(_leaves(ins.shape))
            if ins.opcode == "all-gather-start":  # (operands, results)
                leaves = leaves[len(leaves) // 2:]
            for leaf in leaves:
                found[leaf.dtype, leaf.dims] += times
        for called in ins.called():
            if called in module.computations and ins.opcode != "all-gather-start":
                found += executed_gathers(module, called, times)
    return found


def test_the_experiment_table_is_covered():
    assert set(IN_HOST_MEMORY) == set(configs.EXPERIMENTS)


@pytest.mark.gpu_compile
@pytest.mark.parametrize("name", rows(IN_HOST_MEMORY))
def test_every_row_compiles_for_its_gpus_as_a_gpu_run_would(name):
    """A GPU run's own path up to its first step, on compile-only GPUs, beside the study's
    full-scale plan (traced with kernels every backend has) and placement list: full width,
    real sequence and micro batch, the row's placement, XLA flags, NVFP4 setting and expert
    parallelism, gradients and optimizer included, for the row's GPU (GB200: Blackwell) over
    its real mesh. cuDNN attention, FP4 GEMMs where NVFP4 is on, and exactly the study's
    tensors in host memory, as many bytes as the plan says, each read back from the bytes it
    was written to. Where the study measured the row's memory, the whole model compiles,
    within it, and the static plan lands within 5% of the compiled figure."""
    experiment = configs.get(name)
    family = "deepseek" if isinstance(experiment.model, DeepSeekConfig) else "llama"
    row = built_as_a_gpu_run(name, [] if name in FULL_DEPTH else FEWER_LAYERS[family])
    hlo, module = row.hlo, parse_module(row.hlo)
    assert {(line.value.scan, line.value.tag) for line in row.run_tags
            if line.in_host_memory} == IN_HOST_MEMORY[name]
    # Each read back from where it was written (tests/test_addressing.py: the proof).
    assert all(line.addressing.holds for line in row.run_tags if line.in_host_memory)
    assert "__triton_collective" not in hlo  # all-reduces on NCCL (backend.NCCL_ALL_REDUCES)
    planned = sum(line.value.nbytes * line.value.count for line in row.run_tags
                  if line.offloaded)
    compiled = row.compiled_memory()
    if experiment.run.optimizer_state == "device":
        assert compiled.host == planned
    else:
        assert_the_moments_are_written_to_host(row)
    if name in FULL_DEPTH:
        assert compiled.device <= STUDY_MEMORY_GIB[name] * GiB
        assert abs(row.full_plan.peak_estimate / compiled.device - 1) <= 0.05
    attention = custom_call_operands(hlo, "__cudnn$fmhaSoftmax")
    assert attention and custom_call_operands(hlo, "__cudnn$fmhaSoftmaxBackward")
    if family == "deepseek":  # MLA: q and k 192 wide, v 128 as it is (no zero padding)
        qk = experiment.model.qk_nope_dim + experiment.model.qk_rope_dim
        assert {(q[-1], k[-1], v[-1]) for q, k, v in attention} == {
            (qk, qk, experiment.model.v_head_dim)}
    if family == "deepseek":  # each expert exchange over one expert group, in one NVLink domain
        found = predicted_step.exchange_groups(module, gpu_of(name),
                                               [d.id for d in row.program.target.devices])["expert"]
        assert found["count"] and found["sizes"] == [experiment.run.mesh.expert] == [8]
        assert not found["crossing"]
    if name in LHS_ROWS:
        assert_scheduled(module, LHS_ROWS[name])
    if name in PIPELINED_ROWS:  # the first layer's fetch issued before the backward loop
        assert set(outside_loops(hlo).values()) == {1}
    elif IN_HOST_MEMORY[name]:  # without the flag every host write is in the forward loop
        assert {n for (_, write), n in outside_loops(hlo).items() if write} == {0}
    fp4 = experiment.run.quant == "nvfp4" and gpu_of(name).capability[0] == 10
    assert ('"__cudnn$blockScaledDot"' in hlo) == fp4
    if fp4:
        cfg = experiment.model  # each layer matrix as its GEMMs see it, [K, N]
        D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
        matrices = {"wq": (D, N * H), "wk": (D, K * H), "wv": (D, K * H), "wo": (N * H, D),
                    "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
        assert_every_gemm_of_a_layer_is_fp4(module, matrices, layers=2)


def assert_the_moments_are_written_to_host(row: CompiledRow) -> None:
    """With the optimizer state on host, the step's arguments and outputs in host memory are
    exactly the moments, the outputs written over the arguments (the update in place;
    tests/test_host_state.py: the training)."""
    stats = row.compiled.memory_analysis()
    state = row.program.state_shapes
    moments = host_state.per_device_bytes(
        [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim])
    assert moments == host_state.moment_bytes(state["opt_state"])
    assert (stats.host_argument_size_in_bytes, stats.host_output_size_in_bytes,
            stats.host_alias_size_in_bytes) == (moments, moments, moments)


def assert_every_gemm_of_a_layer_is_fp4(module, matrices: dict, layers: int):
    """Transformer Engine's recipe in the compiled program: in the forward layer loop one FP4
    GEMM per layer matrix; in the backward one Dgrad and one Wgrad per matrix (and the
    forward's, recomputed where the policy recomputes them). Per step, every layer matrix
    gathered as FP4 codes (s8: two E2M1 per byte) once a layer in each pass, and no layer
    matrix gathered in bf16 or f32. `matrices`: name -> its [K, N] as the GEMMs see it."""
    loops = layer_loops(module)
    forward = [gemms for gemms in loops if not gemms["dgrad"]]
    backward = [gemms for gemms in loops if gemms["dgrad"]]
    assert forward and backward
    for gemms in forward:
        assert gemms == {"fprop": len(matrices)}
    for gemms in backward:
        assert gemms["dgrad"] == gemms["wgrad"] == len(matrices) >= gemms["fprop"]
        assert set(gemms) <= {"fprop", "dgrad", "wgrad"}
    gathered = executed_gathers(module)
    codes = sum(n for (dtype, _), n in gathered.items() if dtype == "s8")
    assert codes == 2 * layers * len(matrices)
    shapes = {s for k, n in matrices.values() for s in ((k, n), (n, k))}
    assert not [(dtype, shape) for dtype, shape in gathered
                if dtype in ("bf16", "f16", "f32") and shape in shapes]


@pytest.mark.gpu_compile
def test_jaxs_nvfp4_recipe_compiles_for_a_gpu():
    """quant_backward=bf16 (JAX's recipe: the forward in FP4, the backward in bf16) with 1x16
    weight blocks, a path no study row takes, on compile-only GB200s: each layer matrix's
    forward GEMM is a block-scaled FP4 dot (7 a layer in the forward loop); no Dgrad or Wgrad
    is (the backward loop's FP4 dots are the forward's, recomputed where the policy says)."""
    row = built_as_a_gpu_run("llama8b-offload", ["model.n_layers=2", "quant=nvfp4",
                                                 "quant_tiles=1x16", "quant_backward=bf16"])
    loops = layer_loops(parse_module(row.hlo))
    assert {"fprop": 7} in loops and all(set(gemms) == {"fprop"} for gemms in loops)


@pytest.mark.gpu_compile
def test_a_gpu_run_reports_what_xla_compiled(tmp_path, capsys, monkeypatch):
    """What a run on 8 H200s does before its first step, on compile-only devices: the step
    compiled with the run's own kernels and flags, beside the full-scale plan (traced with
    kernels every backend has, so it needs no device) and its placement list read off the
    compiled program (study/compiling/compiled_row.py), and its header. With one layer, JAX's
    export still annotates Q/K/V for pinned host memory while XLA keeps them on the device: the
    list and the header say so."""
    overrides = ["model.n_layers=1", f"out_dir={tmp_path}"]
    row = built_as_a_gpu_run("llama8b-offload", overrides, device="h200")
    built = row.program
    assert row.full_plan.host_activations == 32 * 192 * 2**20  # the 32-layer model's Q/K/V
    asked = {line.value.tag for line in row.run_tags if line.offloaded}
    assert asked == {tag for _, tag in LLAMA_QKV}
    assert not any(line.in_host_memory for line in row.run_tags)
    assert own_program.CompiledMemory.of(row.compiled).host == 0
    # the traced step's own offloads
    assert {tag for tag in own_program.offloaded(built.traced.jaxpr)} == asked
    setup = row.setup
    # A real H200's pool (XLA's allocator limit) is what study/hardware/compile_only.py plans
    # against.
    monkeypatch.setattr(CompileOnly, "pool_bytes", lambda self: pool_bytes(GPUS["h200"]))
    print("\n".join(header.lines(setup, built, own_program.read(built),
                                  report.RunDir(tmp_path, tmp_path / "ckpt"), first_step=1)))
    out = capsys.readouterr().out
    assert "8 x NVIDIA H200 141GB HBM3e, compile-only" in out and "FULL" in out
    assert "--xla_gpu_enable_latency_hiding_scheduler=true [applied" in out
    assert "attention cudnn" in out
    assert "python -m study plan|compile llama8b-offload" in out
    assert re.search(r"^memory +[\d.]+ GiB per device of JAX's 133.9 GiB pool "
                     r"\(XLA_CLIENT_MEM_FRACTION=0.95\), 0.00 GiB in pinned host memory "
                     r"\(compiled\); over the host link per step [\d.]+ [GMK]iB to host, "
                     r"[\d.]+ [GMK]iB back \(traced\)$", out, re.M)
    assert "offloaded, per layer and device, in this run's compiled program:" in out
    assert out.count("NOT in host memory in the compiled program") == 3

    # study/hardware/compile_only.py's DEVICELESS (XLA's autotuning off where no device times
    # kernels):
    # the same instructions in the same order, memory and host buffers as XLA's default
    # compile of the same step; only kernel configs differ.
    with kernel_checks(built.target):
        lowered = built.traced.lower()
    options = trainer_target.compiler_options(setup.run, built.target)
    default = lowered.compile({**options, **DEVICELESS,
                               "xla_gpu_autotune_level": 4})  # XLA's own default

    def instructions(compiled):
        module = hlo.parse_module(compiled.as_text())
        return {c.name: [(i.name, i.opcode, i.shape, i.operands) for i in c.instructions]
                for c in module.computations.values()}

    assert instructions(row.compiled) == instructions(default)
    assert own_program.CompiledMemory.of(row.compiled) == own_program.CompiledMemory.of(default)


@pytest.mark.gpu_compile
def test_sorted_experts_compile_for_a_gpu():
    """Without expert parallelism a GPU computes routed experts as sorted grouped GEMMs
    (`ragged_dot`), a path no study row takes: the DeepSeek proxy in bf16 on 8 compile-only
    H200s, through a run's own path. Its 3 MoE layers keep their tensors in host memory; its
    one dense layer cannot (a one-layer scan)."""
    target = gpus("h200", 8)
    setup = runtime_setup.resolve("deepseek671b-offload", ["scale=proxy", "compute_dtype=bfloat16"],
                          target.devices)
    assert setup.run.mesh.expert == 1
    built = compile_row(setup, GPUS["h200"], target)
    hlo = built.hlo
    assert "ragged_dot" in hlo and custom_call_operands(hlo, "__cudnn$fmhaSoftmax")
    assert {(line.value.scan, line.value.tag) for line in built.run_tags
            if line.in_host_memory} == {t for t in DEEPSEEK if t[0] == "moe_layers"}


@pytest.mark.gpu_compile
def test_cudnn_takes_mla_attention_unpadded():
    """The cuDNN path traced for a Hopper target: q/k 192 wide, v 128, no pad of v."""
    q = jax.ShapeDtypeStruct((1, 256, 4, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    with kernel_checks(gpus("h200", 8)):
        jaxpr = jax.make_jaxpr(lambda q, k, v: causal_attention(
            q, k, v, implementation="cudnn"))(q, q, v)
    assert jaxpr.out_avals[0].shape == (1, 256, 4, 128)
    assert "pad" not in {eqn.primitive.name for eqn, *_ in own_program.walk(jaxpr.jaxpr)}


def test_the_memory_fraction_is_set_before_jax_starts_and_never_twice():
    code = ("from runtime import backend; import os; from trainer import target; "
            "target.this_machine(); "
            "print(os.environ.get('XLA_CLIENT_MEM_FRACTION'), backend.memory_fraction())")
    env = {k: v for k, v in os.environ.items() if "MEM_FRACTION" not in k}

    def ask(**extra):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env={**env, **extra}, timeout=120, check=True, cwd=ROOT)
        assert result.stderr == ""  # the CUDA plugin's start-up messages dropped
        return result.stdout.strip()

    assert ask() == "0.95 (0.95, 'XLA_CLIENT_MEM_FRACTION')"
    # The older variable alone (jaxlib refuses both together): kept, and planned against.
    assert ask(XLA_PYTHON_CLIENT_MEM_FRACTION="0.8") == (
        "None (0.8, 'XLA_PYTHON_CLIENT_MEM_FRACTION')")


@pytest.mark.gpu_compile
def test_a_gpu_compile_needs_no_cuda_toolkit(tmp_path):
    """XLA assembles every GPU kernel with ptxas. The gpu-compile extra pins one
    (nvidia-cuda-nvcc-cu12) and JAX points XLA at it, so a machine without a CUDA toolkit
    compiles as this one does. Without that package XLA looks on the PATH, tries the ptxas
    put first there (which notes the call) and, that one failing, takes the next it finds."""
    calls = tmp_path / "calls"
    ptxas = tmp_path / "bin" / "ptxas"
    ptxas.parent.mkdir()
    ptxas.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\nexit 1\n")
    ptxas.chmod(0o755)
    code = ("from runtime import backend; import jax, jax.numpy as jnp\n"
            "from study.hardware.compile_only import compile_only\n"
            "from study.hardware.gpus import GPUS\n"
            "h200 = jax.sharding.SingleDeviceSharding(compile_only(GPUS['h200'], 1).devices[0])\n"
            "x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=h200)\n"
            "compiled = jax.jit(lambda x: jnp.tanh(x @ x).sum(0)).trace(x).lower().compile()\n"
            "print(compiled.input_shardings[0][0].device_set)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, cwd=ROOT,
                            env={**os.environ, "PATH": f"{ptxas.parent}{os.pathsep}"
                                                       f"{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr
    assert "H200" in result.stdout  # compiled for the GPU
    assert not calls.exists(), calls.read_text()


@pytest.mark.gpu_compile
def test_compile_command_prints_compiled_memory_beside_the_plan(capsys, tmp_path):
    assert study_main(["compile", "llama8b-offload", "model.n_layers=2",
                       f"out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "for 8 x NVIDIA GB200, compile-only, topology 1x2x4" in out  # said once
    assert re.search(r"compile-only devices also set [^)]*xla_gpu_autotune_level=0", out)
    assert out.count("pinned host, stacked in memory space S(5): read back layer 1 first: "
                     "checked") == 3
    assert re.search(r"device total\s+[\d.]+ GiB\s+[\d.]+ GiB", out)
    assert re.search(r"^FITS: [\d.]+ GiB compiled of ", out, re.M)
    assert "XLA_CLIENT_MEM_FRACTION=0.95 x 184.3 GiB" in out
    assert "all-to-alls: expert exchanges: none; XLA's resharding: " in out
    assert "cuDNN workspaces (0 without a GPU)" in out
    # The step replayed from the compiled schedule, into the run folder.
    step_s = float(re.search(r"replayed from the compiled schedule.*: ([\d.]+) s,", out).group(1))
    [folder] = tmp_path.glob("llama8b-offload-compile-*")
    record = json.loads((folder / "compiled.json").read_text())
    assert record["predicted_step_s"] == pytest.approx(step_s, abs=0.005)
    assert set(record["exposed_s"]) == set(replay.STREAMS[1:])
    assert record["memory_bytes"]["host"] > 0
    trace = json.loads((folder / "timeline.json").read_text())
    kernels = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    last = max(e["ts"] + e["dur"] for e in kernels)
    assert last == pytest.approx(record["predicted_step_s"] * 1e6, rel=1e-6)
    assert any("transpose(jvp(layers))" in e["args"]["op_name"] for e in kernels)


def test_xlas_memory_estimate_warnings_are_explained(capfd):
    """XLA's rematerialization warning counts the offloaded host buffers as device memory, its
    scheduler's the host state's arguments; a compile adds a line that says so beside each."""
    with backend.explained_compile():
        os.write(2, b"W0 hlo_rematerialization.cc:3402] Can't reduce memory use below 1GiB\n")
        os.write(2, b"something else\n")
        os.write(2, b"E0 gpu_hlo_schedule.cc:1076] The byte size of input/output arguments (2) "
                    b"exceeds the base limit (1). This indicates an error in the calculation!\n")
    err = capfd.readouterr().err.splitlines()
    assert err[1] == backend.REMAT_NOTE.rstrip("\n") and err[2] == "something else"
    assert err[4] == backend.SCHEDULE_NOTE.rstrip("\n") and len(err) == 5


def test_compile_command_rejects_bad_input(capsys):
    assert study_main(["compile", "llama405b-offload", "device=a100"]) == 2
    assert capsys.readouterr().err.startswith("error: device='a100': choose one of")
    assert study_main(["compile", "llama405b-offload", "mesh.fsdp=-1"]) == 2
    assert "set mesh.fsdp" in capsys.readouterr().err


def assert_scheduled(module, latency_hiding: bool) -> None:
    """A row with XLA's latency-hiding scheduler and one without it. With the scheduler,
    most collectives are issued asynchronously with kernels between start and done, and every
    host transfer overlaps kernels; without it XLA runs most collectives in place. (jaxlib
    0.10.2 scheduled both alike: its analytical estimator turned LHS on whatever the flag
    said.) Without LHS XLA's default scheduler places host transfers by its own heuristics."""
    overlap = replay.overlap(module, GPUS["gb200"], 128)
    if not latency_hiding:
        assert overlap.synchronous >= 5 * len(overlap.kernels_between("collectives"))
        return
    assert len(overlap.kernels_between("collectives")) >= 2 * overlap.synchronous
    for stream in ("to host", "from host"):
        assert len(overlap.kernels_between(stream)) >= 3
        assert min(overlap.kernels_between(stream)) >= 1


PIPELINED_ROWS = sorted(name for name, e in configs.EXPERIMENTS.items()
                        if e.run.xla_flags.get(PIPELINED) == "true")


def outside_loops(hlo_text: str) -> collections.Counter:
    """(host buffer, write) -> how many of its accesses lie outside every loop, for the host
    buffers the step makes (its offloaded activations; not the state it takes in host memory)."""
    state = {p.name for p in parse_module(hlo_text).entry.parameters()}
    outside = collections.Counter()
    for access in addressing.accesses(hlo_text):
        if access.buffer.name not in state:
            outside[access.buffer.name, access.write] += not access.loops
    return outside


# Rows that set the pipelined flag, each with the same step without it: another row where the
# study has one (the every-row test checks both), else that step compiled here.
PIPELINED_TWINS = {"llama405b-offload-pipelined": "llama405b-offload"}


@pytest.mark.gpu_compile
@pytest.mark.parametrize("name", rows(set(PIPELINED_ROWS) - set(PIPELINED_TWINS),
                                     compiled={"llama70b-8xh200"}))
def test_without_the_pipelined_flag_every_host_write_is_in_its_loop(name):
    """Each row that sets xla_gpu_enable_pipelined_host_offloading peels one write and one read
    of every offloaded buffer out of the layer loops (the every-row test above); the same step
    with the flag off writes every buffer inside the forward loop. (A read may still be outside
    without it: with FP4 weights XLA peels the backward loop's first layer to start its weight
    gathers early.)"""
    family = "deepseek" if isinstance(configs.get(name).model, DeepSeekConfig) else "llama"
    built = built_as_a_gpu_run(name, [*FEWER_LAYERS[family], f"xla_flags.{PIPELINED}=false"])
    outside = outside_loops(built.compiled.as_text())
    assert outside and {n for (_, write), n in outside.items() if write} == {0}


def test_a_pipelined_twin_differs_in_the_flag_alone():
    for row, twin in PIPELINED_TWINS.items():
        flags = dict(configs.get(row).run.xla_flags)
        assert flags.pop(PIPELINED) == "true"
        assert configs.get(twin).run == dataclasses.replace(configs.get(row).run, xla_flags=flags)


@pytest.mark.gpu_compile
def test_the_replay_of_a_compiled_step_counts_the_dot_flops_of_its_trace():
    """Every GEMM XLA compiled, found and counted by the replay from the optimized HLO alone,
    adds up to the dot FLOPs of the traced gradient (XLA's attention kernel and no NVFP4, so
    that every GEMM is a dot in both)."""
    overrides = ["model.n_layers=2", "quant=none", "attention=xla"]
    built = built_as_a_gpu_run("llama8b-offload", overrides, device="h200")
    result = replay.replay(hlo.parse_module(built.compiled.as_text()), GPUS["h200"], 8)
    setup = built.setup
    traced = TracedStep(setup.model, setup.run, (1, 8, 1)).work(setup.placement)
    assert sum(result.flops.values()) == pytest.approx(sum(traced.flops.values()), rel=1e-12)
    assert 0 < result.gemm_s < result.step_s


# The fit scale on GPUs this machine lacks (study/compiling/fit_table.py: the trainer's search,
# compile-only):
# a 405B row on one H200 (its state moved to host memory: 10.6B parameters at 2 layers with
# their gradients and AdamW moments are 169 GB, above the pool; the optimizer state first,
# then the layers' weights, where that lets more layers fit) and a DeepSeek row (its moments
# moved to host where that lets more of its layers fit, its weights kept: moving them too adds
# none).
FITS = {("llama405b-offload", "h200", 1): {"optimizer_state": "host", "parameters": "host"},
        ("deepseek671b-offload", "h200", 8): {"optimizer_state": "host"}}


@pytest.mark.gpu_compile
@pytest.mark.parametrize("name, gpu, count", sorted(FITS))
def test_a_fit_compiles_for_its_gpus_within_its_budget_with_the_rows_tensors_in_host_memory(
        name, gpu, count):
    """The study's layers, as many as fit `count` compile-only `gpu`s: the chosen program
    within the budget a run there has, one more layer's not (where there is one to add), the
    reductions the row needs there, and the row's offloaded tensors in host memory, each read
    back from the bytes it was written to."""
    fit, row = fit_table.fitted(name, [], GPUS[gpu], count)
    assert fit.budget.fits(row.compiled_memory()) and fit.memory == row.compiled_memory()
    assert fit.over is None or not fit.budget.fits(fit.over)
    layers = ("model.n_layers", "model.n_dense_layers")
    assert {k: v for k, v in fit.words.items() if k not in layers} == FITS[(name, gpu, count)]
    in_host = {(line.value.scan, line.value.tag) for line in row.run_tags if line.in_host_memory}
    assert in_host == IN_HOST_MEMORY[name]
    assert all(line.addressing.holds for line in row.run_tags if line.in_host_memory)


# DeepSeek's layer narrowed, its attention's head dim kept (192: only the GPU's cuDNN checks,
# given the target's capability, take it), for preset=auto's candidates on compile-only GPUs;
# its optimizer state on host: those programs are traced apart from their compiles.
NARROW_DEEPSEEK = ["model.d_model=256", "model.n_heads=2", "model.q_lora_rank=64",
                   "model.kv_lora_rank=64", "model.v_head_dim=64", "model.d_ff=256",
                   "model.moe_d_ff=64", "model.vocab=1024", "model.n_layers=4", "seq=256",
                   "per_device_batch=1", "optimizer_state=host", "preset=auto"]


@pytest.mark.gpu_compile
def test_preset_autos_candidates_compile_for_gpus_this_machine_lacks():
    """`python -m study fit ROW preset=auto`: each candidate traced and compiled for one
    compile-only H200 (the neighbours' traces too under the target's cuDNN checks); the row's
    own preset is the fit's program, so its figures are the fit's."""
    line, setup = fit_table.fit_row("deepseek671b-offload", NARROW_DEEPSEEK, GPUS["h200"], 1)
    assert setup is not None, line
    rows = [r.split(" | ") for r in fit_table.candidate_lines(setup, GPUS["h200"], 1)
            if r.startswith("| ") and not r.startswith("| candidate")]
    names = [r[0].removeprefix("| ") for r in rows]
    assert names[:7] == ["remat", "minimal", "qkv_offload", "minimal_offloaded",
                         "dsv3_offload", "dsv3_device", "none"]
    own = rows[names.index("dsv3_offload")]
    assert (own[1], own[2]) == (f"{setup.fit.memory.device / GiB:.1f}",
                                f"{setup.fit.memory.host / GiB:.1f}")
    assert all(r[3] in ("yes |", "no |") for r in rows)


# parameters=host (offload/state.py): the layer scans' weights in host memory, two layers per
# scan, narrow (what is under test is where the state lies, not the layers' width): Llama on
# llama8b-offload's 8 GB200s; DeepSeek with its moments in host memory too, on one H200.
HOST_PARAMETERS = {
    "llama": ("llama8b-offload", "gb200", 8,
              ["model.n_layers=2", "model.d_model=1024", "model.n_heads=8", "model.n_kv_heads=2",
               "model.d_ff=3584", "model.vocab=4096", "seq=128", "per_device_batch=1"]),
    "deepseek": ("deepseek671b-offload", "h200", 1,
                 [*NARROW_DEEPSEEK[:-1], "model.n_dense_layers=2"]),
}


@functools.cache
def host_parameters_row(family: str, parameters: str = "host") -> CompiledRow:
    name, gpu, count, words = HOST_PARAMETERS[family]
    target = gpus(gpu, count)
    setup = runtime_setup.resolve(name, [*words, f"parameters={parameters}"], target.devices)
    return compile_row(setup, GPUS[gpu], target)


def layer_weights(row: CompiledRow) -> list:
    """The layer scans' stacked weights of a row's state (sharded ShapeDtypeStructs)."""
    params = row.program.state_shapes["params"]
    return [x for scan in families.of(row.setup.model).SCANS for x in jax.tree.leaves(params[scan])]


@pytest.mark.gpu_compile
@pytest.mark.parametrize("family", ["llama", pytest.param("deepseek", marks=pytest.mark.slow)])
def test_with_parameters_on_host_each_layer_reads_its_weights_and_writes_its_gradient_there(
        family):
    """Every stacked weight of every layer scan, and its gradient, in a host buffer of the
    compiled GPU program: the forward pass reads the weights layer 0 first, the backward pass
    layer 1 first, and writes each layer's gradient once, layer 1 first, each from the bytes
    meant (study/programs/addressing.py); the row's activations are still offloaded and read
    back as without it. The host state (the weights, and the moments where they are on host)
    is the program's host arguments, written over in place."""
    row = host_parameters_row(family)
    name, *_ = HOST_PARAMETERS[family]
    params = row.program.state_shapes["params"]
    assert [(w.scan, w.name) for w in row.host_weights] == [
        (scan, jax.tree_util.keystr(path, simple=True, separator="/"))
        for scan in families.of(row.setup.model).SCANS
        for path, _ in jax.tree_util.tree_leaves_with_path(params[scan])]
    for weight in row.host_weights:
        assert (weight.weights.verdict, weight.weights.detail) == (addressing.CHECKED, (
            "the forward pass reads layer 0 first, the backward pass layer 1 first, the update "
            "reads and writes each over, layer 0 first: checked"))
        assert (weight.gradient.verdict, weight.gradient.detail) == (
            addressing.CHECKED, "the backward pass writes layer 1 first: checked")
    assert {(line.value.scan, line.value.tag) for line in row.run_tags
            if line.in_host_memory} == IN_HOST_MEMORY[name]
    assert all(line.addressing.holds for line in row.run_tags if line.in_host_memory)
    moments = (host_state.moment_bytes(row.program.state_shapes["opt_state"])
               if row.setup.run.optimizer_state == "host" else 0)
    held = host_state.per_device_bytes(layer_weights(row)) + moments
    stats = row.compiled.memory_analysis()
    assert (stats.host_argument_size_in_bytes, stats.host_output_size_in_bytes,
            stats.host_alias_size_in_bytes) == (held, held, held)
    lines = compiled_row.host_weight_lines(row.host_weights)
    assert len(lines) == 1 + len(row.host_weights) + len(families.of(row.setup.model).SCANS)


@pytest.mark.gpu_compile
def test_parameters_on_host_take_the_layer_weights_and_their_gradients_off_the_device():
    """The same Llama step with its layers' weights on the device and in host memory: the
    device arguments lose the weights' bytes exactly, the device total at least the weights'
    and their gradients' (a layer of each is on the device at a time)."""
    host, device = (host_parameters_row("llama", p).compiled_memory() for p in ("host", "device"))
    weights = host_state.per_device_bytes(layer_weights(host_parameters_row("llama")))
    assert device.arguments - host.arguments == weights
    assert device.device - host.device >= 2 * weights
