"""The memory plan as printed: the placement list, the memory lines, and beside them XLA's
compiled program (its memory, its host buffers).

    python -m study plan EXPERIMENT [key=value ...]      the full-scale plan (static)
    python -m study compile EXPERIMENT [key=value ...]   beside XLA's compiled GPU program: the
                                                         host buffers it keeps, its memory

The static plan (study/plan/memory_plan.py) allocates and compiles nothing: the step is traced
and exported for a GPU from ShapeDtypeStructs sharded over an abstract mesh, with kernels every
backend has (target "any"), so a laptop plans the 128-GPU run and a GPU run plans without
touching its devices.
"""

import math

import jax.numpy as jnp

from configs import RunConfig
from offload import activations
from runtime import backend
from runtime.own_program import GiB, CompiledMemory, size_words as _size
from study.hardware.compile_only import host_limit, pool_bytes
from study.hardware.gpus import Gpu
from study.plan import memory_plan
from study.programs import addressing
from trainer import target


def _of_pool(n: int, plan: memory_plan.MemoryPlan, gpu: Gpu) -> str:
    """`n` bytes against the device memory JAX takes of `gpu`."""
    fraction, variable = backend.memory_fraction()
    return (f"of {_size(plan.capacity)} ({n / plan.capacity:.0%}; JAX's pool on the {gpu.name}: "
            f"{variable}={fraction:g} x {_size(gpu.memory)} = {_size(pool_bytes(gpu))})")


def placement_lines(lines: list[memory_plan.TagLine]) -> list[str]:
    """The placement list: one line per tag (per layer scan), and the offloaded totals."""
    compiled = any(line.in_host_memory is not None for line in lines)
    program = "compiled GPU program (XLA)" if compiled else "exported GPU program (JAX)"
    out = [f"{'scan':<13}{'tag':<20}{'per layer, per device':<26}{'bytes':>9}  {'asked':<8} "
           f"{program}"]
    for line in lines:
        v = line.value
        shape = "x".join(map(str, v.shape)) + f" {jnp.dtype(v.dtype).name}"
        out.append(f"{v.scan:<13}{v.tag:<20}{shape:<26}{_size(v.nbytes):>9}  "
                   f"{line.where:<8} {_verdict(line)}")
    for scan in dict.fromkeys(line.value.scan for line in lines):
        moved = [line.value for line in lines if line.value.scan == scan and (
            line.in_host_memory if compiled else line.offloaded)]
        if moved:
            per_layer = sum(v.nbytes for v in moved)
            out.append(f"offloaded ({scan}): "
                       f"{' + '.join(f'{v.tag} {_size(v.nbytes)}' for v in moved)} = "
                       f"{_size(per_layer)} per layer; x {moved[0].count} layers = "
                       f"{_size(per_layer * moved[0].count)} in host memory")
    return out + addressing_problems(lines)


def addressing_problems(lines: list[memory_plan.TagLine]) -> list[str]:
    """A line per offloaded tag not provably read back from where it was written
    (study/programs/addressing.py)."""
    return [f"{line.value.scan} {line.value.tag}: addressing {line.addressing.verdict}: "
            f"{line.addressing.detail}" for line in lines
            if line.addressing is not None and not line.addressing.holds]


def _verdict(line: memory_plan.TagLine) -> str:
    if not line.needed:
        return "nothing to place: the backward pass never reads it"
    if line.in_host_memory:
        return f"pinned host, stacked in memory space S(5): {line.addressing.summary}"
    if line.offloaded and line.in_host_memory is None:
        return "pinned_host, back to device for the backward pass"
    if line.offloaded:
        return "NOT IN HOST MEMORY: annotated for pinned_host, but XLA kept it on device"
    if line.value.tag == activations.LAYER_INPUT:
        return "kept on device: a checkpointed layer always keeps its input"
    return {"device": "stays on device", "remat": "recomputed"}.get(line.where, "NOT OFFLOADED")


def plan_lines(name: str, run: RunConfig, gpu: Gpu, plan: memory_plan.MemoryPlan) -> list[str]:
    """The whole plan: a title, the placement list, the memory lines."""
    mesh = run.mesh
    title = (f"memory plan: {name} at full scale, per device of the mesh data={mesh.data} x "
             f"fsdp={mesh.fsdp} x expert={mesh.expert} ({gpu.name}); "
             f"{run.batch(mesh.devices)} sequences x {run.seq} tokens; preset {run.preset}")
    return [title, *placement_lines(plan.tags), *memory_lines(plan, gpu, run)]


def fit_line(fits: bool, device: int, what: str, host: int, plan: memory_plan.MemoryPlan,
             gpu: Gpu) -> str:
    """The verdict, in the same words for the static plan and the compiled program."""
    return (f"{'FITS' if fits else 'DOES NOT FIT'}: {_size(device)} {what} "
            f"{_of_pool(device, plan, gpu)}; host {_size(host)} of {_size(plan.host_capacity)} "
            "per GPU")


def nvfp4_words(gpu: Gpu, run: RunConfig) -> str:
    """What `gpu` makes of the run's NVFP4 (trainer/target.py's `quantization` for a compile)."""
    chosen = target.quantization(run, target.Target("gpu", gpu.capability))
    words = chosen.describe()
    if chosen.path == "scaled":
        return f"{words} (the {gpu.name}'s)"
    major, minor = gpu.capability
    return f"{words} (the {gpu.name} (compute capability {major}.{minor}) has no FP4 tensor cores)"


def host_pool_warning(host: float, gpu: Gpu) -> list[str]:
    """A warning when `host` bytes per GPU exceed the pinned host memory a run's process may
    hold on a host of `gpu`s, per GPU (and how to make room)."""
    per_gpu = host_limit(gpu, gpu.per_host) / gpu.per_host
    if host <= per_gpu:
        return []
    return [f"WARNING: {_size(host)} of host memory per GPU exceed the pinned host memory a "
            f"run may hold per GPU on a {gpu.name} host ({_size(per_gpu)}): set "
            f"{backend.HOST_LIMIT_VARIABLE}={math.ceil(host / GiB * 1.1)} x the process's "
            "GPUs, or offload less"]


def memory_lines(plan: memory_plan.MemoryPlan, gpu: Gpu, run: RunConfig) -> list[str]:
    stacked = sum(r.nbytes for r in plan.residuals
                  if not r.on_host and r.shape[:1] and r.shape[0] in plan.layers)
    to_device, to_host = plan.link_params
    rows = [
        ("parameters", plan.device_params,
         "master weights of the embedding, final norm and LM head, FSDP shard; the layer "
         f"scans' weights ({_size(plan.host_params)}) in pinned host memory, a layer at a "
         f"time on the device: {_size(to_device)} host->device and {_size(to_host)} "
         "device->host over the host link per step, with their gradients (parameters=host)"
         if plan.host_params
         else "master weights, FSDP shard"),
        ("gradients", plan.device_grads,
         "of the embedding, final norm and LM head; the layer scans' go to pinned host memory "
         "a layer at a time, as the backward pass makes them" if plan.host_params
         else "same sharding as the parameters"),
        ("optimizer state", plan.device_optimizer,
         f"AdamW moments ({_size(plan.optimizer)}) in pinned host memory, a layer at a time "
         f"on the device for the update: {_size(plan.optimizer)} each way over the host link "
         "per step (optimizer_state=host)" if plan.optimizer_on_host
         else "AdamW moments, same sharding"),
        ("activations on device", plan.device_activations,
         f"{_size(stacked)} stacked over the {' + '.join(map(str, plan.layers))} layers "
         "(layer inputs, tags kept on device), the rest after the last layer (norm, logits)"),
        ("one layer's backward", plan.layer_working_set,
         "its tagged values, its gathered weights"
         + (f", expert exchange blocks {_size(plan.exchange)}" if plan.exchange else "")),
        ("layer from host", plan.host_layer,
         "the widest layer's weights (fetched again for its recompute) and its gradient, FSDP "
         "shard, while its backward pass runs (parameters=host)"),
        ("transposed weights", plan.transposed_weights,
         "XLA's copy, for the whole step, of the stacked weights FSDP shards on a later axis"
         + ("; none of those in host memory (parameters=host)" if plan.host_params else "")),
        ("pipelined transfers", plan.pipelined,
         "one layer's offloaded tensors, fetched a layer early "
         "(xla_gpu_enable_pipelined_host_offloading; an estimate)"),
    ]
    out = [f"{name:<23}{_size(n):>10}  {why}" for name, n, why in rows
           if n or name not in ("pipelined transfers", "layer from host")]
    out.append(f"{'peak device (estimate)':<23}{_size(plan.peak_estimate):>10}  "
               f"{_of_pool(plan.peak_estimate, plan, gpu)}; an estimate: NCCL scratch, cuDNN "
               "workspaces and XLA temporaries are not in a static plan")
    held = ([f"the layer scans' weights ({_size(plan.host_params)}), their gradients "
             f"({_size(plan.host_params)})"] if plan.host_params else []) + (
        [f"the optimizer state ({_size(plan.optimizer)})"] if plan.optimizer_on_host else [])
    state = (f"; with {' and '.join(held)}, the state updated in place, a layer at a time"
             if held else "")
    out.append(f"{'host (pinned)':<23}{_size(plan.host_peak):>10}  of "
               f"{_size(plan.host_capacity)} of host memory per GPU "
               f"({plan.host_peak / plan.host_capacity:.0%}): offloaded activations "
               f"({_size(plan.host_activations)}), stored over the whole forward pass{state}")
    if any(plan.link):
        out.append(link_line(plan, gpu))
    if plan.matrices:
        plain, stored = plan.matrices
        out.append(f"{'weights as NVFP4':<23}{_size(stored):>10}  "
                   f"{nvfp4_words(gpu, run)}; {stored / plain:.0%} of their "
                   f"{_size(plain)} in the compute dtype, not in the peak: masters stay FP32, "
                   "each layer is quantized as it runs")
    out += host_pool_warning(plan.host_peak, gpu)
    out.append(fit_line(plan.fits, plan.peak_estimate, "planned (estimate)", plan.host_peak,
                        plan, gpu))
    return out


def link_line(plan: memory_plan.MemoryPlan, gpu: Gpu) -> str:
    """The state's bytes over the host link per step, each way, and their time on `gpu`'s."""
    rate = gpu.host_link / gpu.host_link_gpus  # each GPU's share, as the replay's
    to_device, to_host = plan.link
    return (f"{'host link (state)':<23}{_size(to_device):>10}  host->device per step and "
            f"{_size(to_host)} device->host (the state's moves, traced from the step): "
            f"{to_device / rate:.2f} s and {to_host / rate:.2f} s at the {gpu.name}'s "
            f"{rate / 1e9:.0f} GB/s each way per GPU, the two directions at once")


def compiled_lines(compiled: CompiledMemory, plan: memory_plan.MemoryPlan, gpu: Gpu) -> list[str]:
    """XLA's per-device memory of the compiled program beside the static plan: does it fit?"""
    rows = [
        ("arguments", compiled.arguments, plan.device_params + plan.device_optimizer,
         "the state (parameters, optimizer) and the batch; static: the state"),
        ("outputs - donated", compiled.outputs - compiled.aliased, 0,
         "outputs not written over their donated inputs"),
        ("temporaries", compiled.temporaries,
         plan.device_grads + plan.device_activations + plan.layer_working_set
         + plan.host_layer + plan.transposed_weights,
         "XLA's buffers; static: gradients, activations on device, one layer's backward, "
         + ("a layer from host, " if plan.host_layer else "") + "transposed weights"),
        ("device total", compiled.device, plan.peak_estimate,
         "arguments + outputs - donated + temporaries"),
        ("host (pinned)", compiled.host, plan.host_peak,
         "buffers in memory space S(5): offloaded activations"
         + (", the layer scans' weights and gradients" if plan.host_params else "")
         + (", the optimizer state" if plan.optimizer_on_host else "")),
    ]
    out = [f"{'per device':<20}{'compiled':>11}{'static plan':>13}"]
    out += [f"{name:<20}{_size(a):>11}{_size(b):>13}  {why}" for name, a, b, why in rows]
    proofs = [t.addressing for t in plan.tags if t.addressing is not None]
    if wrong := [p for p in proofs if p.verdict == addressing.WRONG]:
        out.append(f"DOES NOT WORK: {len(wrong)} of {len(proofs)} host buffers are read back "
                   "from other layers' bytes: the gradients would be wrong (above)")
    elif unproven := [p for p in proofs if not p.holds]:
        out.append(f"UNPROVEN: the addressing of {len(unproven)} of {len(proofs)} host buffers "
                   "cannot be verified (above); check the gradients on a GPU: "
                   "study/bench/gpu_check.py")
    out.append(fit_line(compiled.device <= plan.capacity, compiled.device, "compiled",
                        compiled.host, plan, gpu))
    out.append("not in the compiled figures: GEMM autotuning (none without a GPU: default "
               "tiles), cuDNN workspaces (0 without a GPU), NCCL buffers (outside XLA's pool)")
    return out
