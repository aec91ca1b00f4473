"""Where a step's activations go, and how much memory each device needs, from abstract values.

    python train.py EXPERIMENT --plan [key=value ...]      the full-scale plan (static)
    python train.py EXPERIMENT --compile [key=value ...]   beside XLA's compiled GPU program

The static plan allocates and compiles nothing: the step is traced and exported for a GPU from
ShapeDtypeStructs sharded over an abstract mesh, with kernels every backend has (target
"any"), so a laptop plans the 128-GPU run and a GPU run plans without touching its devices.
A compiled program (`--compile`, a GPU run) adds what XLA really does: the host buffers it
keeps and its memory per device.
"""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType

import backend
import training
from configs import Experiment, RunConfig
from configs.gpus import GPUS, Gpu
from model import common, quant
from offload import addressing, memory, placement, policies, trace

GiB, MiB = 2**30, 2**20
HOST_POOL_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
HOST_POOL_DEFAULT_GIB = 64  # XLA's pinned-host allocator on GPU, unless the variable says more


def _size(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n / 1024:.0f} KiB"


class Program:
    """One step of (model, run, tables) on a mesh of this shape, as abstract values. MoE
    experts are planned as a GPU computes them (grouped GEMMs, or under expert parallelism
    one GEMM per local expert over its blocks)."""

    def __init__(self, model, run: RunConfig, tables: dict | None,
                 mesh_shape: tuple[int, int]):
        if run.expert_path == "auto":
            run = dataclasses.replace(run, expert_path="sorted")
        self.model, self.run, self.tables = model, run, tables
        self.devices = math.prod(mesh_shape)
        mesh = AbstractMesh(mesh_shape, ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
        self.fsdp = mesh_shape[1]
        self.rules = training.axis_rules(run, mesh)
        self.optimizer = training.make_optimizer(run.optimizer, run.steps)
        self.state = training.abstract_state(model, run, self.rules, self.optimizer)
        self.batch = training.abstract_batch(run, self.rules, self.devices)
        # One device's share of the work, unsharded: its activations are what it stores. Under
        # expert parallelism it holds only its own experts.
        self.specs = jax.tree.map(self._own_experts, training.family(model).param_specs(model),
                                  is_leaf=lambda x: isinstance(x, common.ParamSpec))
        self.local_params = common.abstract_params(self.specs, jnp.dtype(run.param_dtype))
        self.local_batch = jax.ShapeDtypeStruct(
            (run.batch(self.devices) // self.devices, run.seq + 1), jnp.int32)

    def _split_by_expert(self, spec: common.ParamSpec) -> bool:
        """Under expert parallelism, routed-expert weights: each device holds its own, whole."""
        return self.rules.experts is not None and "experts" in spec.axes

    def _own_experts(self, spec: common.ParamSpec) -> common.ParamSpec:
        if not self._split_by_expert(spec):
            return spec
        axis = spec.axes.index("experts")
        shape = list(spec.shape)
        shape[axis] //= self.fsdp
        return dataclasses.replace(spec, shape=tuple(shape))

    def local_loss(self, tables: dict | None):
        loss = training.make_loss(self.model, self.run, tables, rules=None, target=backend.ANY,
                                  fsdp_devices=self.fsdp)
        return lambda params, batch: loss(params, batch)[0]

    def tag_lines(self, compiled_hlo: str | None = None) -> list[memory.TagLine]:
        """Every tag of every layer scan: per-device per-layer value, placement asked, whether
        the backward pass needs it, whether the exported GPU program offloads it and, given a
        compiled GPU program's optimized HLO, whether XLA keeps its stacked buffer in host
        memory."""
        tagged = trace.tagged_values(self.local_loss(None), self.local_params, self.local_batch)
        sites = [site for sites in tagged.values() for site in sites]
        everything = {scan: {tag: "offload" for tag in tags}
                      for scan, tags in training.scan_tags(self.model).items()}
        needed = trace.offloaded_tags(jax.grad(self.local_loss(everything)),
                                      self.local_params, self.local_batch)
        needed = {(s.scan, s.tag) for found in needed.values() for s in found}
        step = training.make_step(self.model, self.run, self.tables, self.rules, self.optimizer,
                                  backend.ANY)
        offloaded = placement.verify_offloads(step, self.state, self.batch)
        in_host = None  # (scan, tag) -> the addressing proof of its host buffer
        if compiled_hlo is not None:
            moved = trace.offloaded_tags(jax.grad(self.local_loss(self.tables)),
                                         self.local_params, self.local_batch)
            in_host = placement.compiled_host_buffers(
                compiled_hlo, [v for values in moved.values() for v in values])
        tables, scans = self.tables or {}, training.family(self.model).SCANS
        return [memory.TagLine(s, tables.get(s.scan, {}).get(s.tag, "remat"),
                               (s.scan, s.tag) in needed, (s.scan, s.tag) in offloaded,
                               None if in_host is None else (s.scan, s.tag) in in_host,
                               None if in_host is None else in_host.get((s.scan, s.tag)))
                for s in sorted(sites, key=lambda s: scans.index(s.scan))]

    def memory_plan(self, capacity: int, host_capacity: int, compiled_hlo: str | None = None,
                    tags: list[memory.TagLine] | None = None) -> memory.MemoryPlan:
        """The plan; `tags` (a placement list already made) spares exporting the step."""
        residuals = trace.saved_residuals(self.local_loss(self.tables), self.local_params,
                                          self.local_batch)
        # Shapes of the FSDP-sharded parameters (a device's own experts are whole already).
        shapes = {spec.shape for spec in jax.tree.leaves(self.specs, is_leaf=_is_spec)
                  if not self._split_by_expert(spec)}
        scans = training.family(self.model).SCANS
        weights_per_layer = max(  # the widest layer's
            common.param_count(self.specs[scan]) // max(self.specs[scan][k].shape[0]
                                                        for k in self.specs[scan])
            for scan in scans if self.specs[scan])
        return memory.MemoryPlan(
            params=memory.per_device_bytes(self.state["params"]),
            grads=memory.per_device_bytes(self.state["params"]),
            optimizer=memory.per_device_bytes(self.state["opt_state"]),
            tags=self.tag_lines(compiled_hlo) if tags is None else tags,
            residuals=memory.per_device_residuals(residuals, shapes, self.fsdp),
            layers=tuple(next(iter(self.specs[scan].values())).shape[0] for scan in scans),
            layer_weights=weights_per_layer * jnp.dtype(self.run.compute_dtype).itemsize,
            # The layer casts its weights to the compute dtype, so their gradients arrive (and
            # are reduce-scattered) in it; only a device's shard becomes param_dtype.
            layer_grads=weights_per_layer * jnp.dtype(self.run.compute_dtype).itemsize,
            exchange=self.exchange_buffers(),
            capacity=capacity, host_capacity=host_capacity,
            matrices=self.quantizable_matrices() if self.run.quant != "none" else None)

    def gathered_layer_bytes(self, scan: str) -> int:
        """One layer's weights as FSDP all-gathers them (in the compute dtype), which is also
        its gradients' reduce-scatter; a device's own experts are not gathered."""
        shared = [s for s in self.specs[scan].values() if not self._split_by_expert(s)]
        return (sum(math.prod(s.shape[1:]) for s in shared)
                * jnp.dtype(self.run.compute_dtype).itemsize)

    def exchange_buffers(self) -> int:
        """Expert parallelism's blocks in one MoE layer: sent, received, their outputs and the
        outputs returned, each [devices x block rows, D] in the compute dtype."""
        parallel = training.forward_options(self.model, self.run, self.fsdp,
                                            backend.ANY).get("expert_parallel")
        if parallel is None:
            return 0
        tokens = self.local_batch.shape[0] * self.run.seq
        rows = self.model.n_experts * parallel.block_rows(tokens, self.model.experts_per_token,
                                                          self.model.n_experts)
        return 4 * rows * self.model.d_model * jnp.dtype(self.run.compute_dtype).itemsize

    def quantizable_matrices(self) -> tuple[int, int]:
        """Per device, the layer matrices `quant=nvfp4` multiplies in NVFP4: (bytes in the
        compute dtype, bytes stored as NVFP4: E2M1 codes at 4 bits, E4M3 scales, FP32 scale)."""
        family = training.family(self.model)
        specs = family.param_specs(self.model)
        plain = stored = 0
        for scan in family.SCANS:
            for name, spec in specs[scan].items():
                if not common.quantizable(name, len(spec.shape) - 1, family.UNQUANTIZED):
                    continue
                per_layer = math.prod(spec.shape[1:])
                plain += spec.shape[0] * per_layer * jnp.dtype(self.run.compute_dtype).itemsize
                stored += spec.shape[0] * quant.nvfp4_bytes((per_layer,), 0)
        return plain // self.fsdp, stored // self.fsdp


def _is_spec(x) -> bool:
    return isinstance(x, common.ParamSpec)


def full_scale(experiment: Experiment, tables: dict | None,
               compiled_hlo: str | None = None) -> memory.MemoryPlan:
    """The experiment's full-scale memory plan and placement list under these tables, against
    the memory JAX takes of its GPU (and, given one, the compiled program's host buffers)."""
    run = experiment.run
    program = Program(experiment.model, run, tables, (run.mesh.data, run.mesh.fsdp))
    gpu = GPUS[run.device]
    return program.memory_plan(backend.pool_bytes(gpu), gpu.host_memory, compiled_hlo)


def memory_source(gpu: Gpu) -> str:
    fraction, variable = backend.memory_fraction()
    return (f"JAX's pool on the {gpu.name}: {variable}={fraction:g} x {_size(gpu.memory)} "
            f"= {_size(backend.pool_bytes(gpu))}")


def placement_lines(lines: list[memory.TagLine]) -> list[str]:
    """The placement list: one line per tag (per layer scan), and the offloaded totals."""
    compiled = any(line.in_host_memory is not None for line in lines)
    program = "compiled GPU program (XLA)" if compiled else "exported GPU program (JAX)"
    out = [f"{'scan':<13}{'tag':<20}{'per layer, per device':<26}{'bytes':>9}  {'asked':<8} "
           f"{program}"]
    for line in lines:
        v = line.value
        shape = "x".join(map(str, v.shape)) + f" {jnp.dtype(v.dtype).name}"
        out.append(f"{v.scan:<13}{v.tag:<20}{shape:<26}{_size(v.nbytes):>9}  "
                   f"{line.placement:<8} {_verdict(line)}")
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


def addressing_problems(lines: list[memory.TagLine]) -> list[str]:
    """One line per offloaded tag whose host buffer the compiled program does not provably
    read back from where it wrote it (offload/addressing.py)."""
    return [f"{line.value.scan} {line.value.tag}: addressing {line.addressing.verdict}: "
            f"{line.addressing.detail}" for line in lines
            if line.addressing is not None and not line.addressing.holds]


def addressing_refusal(lines: list[memory.TagLine]) -> str | None:
    """Why a GPU run must not start: its compiled step reads an offloaded activation back
    from another layer's bytes (silently wrong gradients); None when none does."""
    wrong = [line for line in lines if line.addressing is not None
             and line.addressing.verdict == addressing.WRONG]
    if not wrong:
        return None
    return (f"the compiled step would train on wrong gradients: {addressing_problems(wrong)[0]}"
            f"{f' (and {len(wrong) - 1} more)' if len(wrong) > 1 else ''}; this is jax "
            f"{jax.__version__}; the bug is fixed from {addressing.FIXED_IN} on")


def _verdict(line: memory.TagLine) -> str:
    if not line.needed:
        return "nothing to place: the backward pass never reads it"
    if line.in_host_memory:
        return f"pinned host, stacked in memory space S(5): {line.addressing.summary}"
    if line.offloaded and line.in_host_memory is None:
        return "pinned_host, back to device for the backward pass"
    if line.offloaded:
        return "NOT IN HOST MEMORY: annotated for pinned_host, but XLA kept it on device"
    if line.value.tag == policies.LAYER_INPUT:
        return "kept on device: a checkpointed layer always keeps its input"
    return {"device": "stays on device", "remat": "recomputed"}.get(line.placement,
                                                                    "NOT OFFLOADED")


def plan_lines(name: str, run: RunConfig, plan: memory.MemoryPlan) -> list[str]:
    """The whole plan: a title, the placement list, the memory lines."""
    devices = run.mesh.data * run.mesh.fsdp
    pool = float(os.environ.get(HOST_POOL_VARIABLE, HOST_POOL_DEFAULT_GIB))
    title = (f"memory plan: {name} at full scale, per device of the mesh data={run.mesh.data} x "
             f"fsdp={run.mesh.fsdp} ({run.device}); {run.batch(devices)} sequences x {run.seq} "
             f"tokens; policy {run.policy}")
    return [title, *placement_lines(plan.tags), *memory_lines(plan, GPUS[run.device], pool)]


def memory_lines(plan: memory.MemoryPlan, gpu: Gpu, host_pool_gib: float) -> list[str]:
    device = [r for r in plan.residuals if not r.on_host]
    stacked = sum(r.nbytes for r in device if r.shape[:1] and r.shape[0] in plan.layers)
    rows = [
        ("parameters", plan.params, "master weights, FSDP shard"),
        ("gradients", plan.grads, "same sharding as the parameters"),
        ("optimizer state", plan.optimizer, "AdamW moments, same sharding"),
        ("activations on device", plan.device_activations,
         f"{_size(stacked)} stacked over the {' + '.join(map(str, plan.layers))} layers "
         "(layer inputs, tags kept on device), the rest after the last layer (norm, logits)"),
        ("one layer's backward", plan.layer_working_set,
         "its tagged values, its gathered weights x2, its unreduced gradients"
         + (f", expert exchange blocks {_size(plan.exchange)}" if plan.exchange else "")),
    ]
    out = [f"{name:<23}{_size(n):>10}  {why}" for name, n, why in rows]
    out.append(f"{'peak device (estimate)':<23}{_size(plan.peak_estimate):>10}  of "
               f"{_size(plan.capacity)} ({plan.peak_estimate / plan.capacity:.0%}; "
               f"{memory_source(gpu)}); an estimate: NCCL scratch, cuDNN workspaces and XLA "
               "temporaries are not in a static plan")
    out.append(f"{'host (pinned)':<23}{_size(plan.host_activations):>10}  of "
               f"{_size(plan.host_capacity)} of host memory per GPU "
               f"({plan.host_activations / plan.host_capacity:.0%}): offloaded activations, "
               "stored over the whole forward pass")
    if plan.matrices:
        plain, stored = plan.matrices
        out.append(f"{'weights as NVFP4':<23}{_size(stored):>10}  the layer matrices multiplied "
                   f"in FP4 ({_size(plain)} in the compute dtype: {stored / plain:.0%}); not in "
                   "the peak: masters stay FP32, each layer is quantized as it runs")
    if plan.host_activations > host_pool_gib * GiB:
        need = math.ceil(plan.host_activations / GiB * 1.1)
        out.append(f"WARNING: {_size(plan.host_activations)} of host activations exceed XLA's "
                   f"pinned-host pool ({host_pool_gib:g} GiB): set {HOST_POOL_VARIABLE}={need} "
                   "(per process) or offload less")
    return out


def compiled_lines(compiled: memory.CompiledMemory, plan: memory.MemoryPlan,
                   gpu: Gpu) -> list[str]:
    """XLA's per-device memory of the compiled GPU program beside the static plan, and whether
    it fits the memory JAX takes and the host memory there is."""
    rows = [
        ("arguments", compiled.arguments, plan.params + plan.optimizer,
         "the state (parameters, optimizer) and the batch; static: the state"),
        ("outputs - donated", compiled.outputs - compiled.aliased, 0,
         "outputs not written over their donated inputs"),
        ("temporaries", compiled.temporaries,
         plan.grads + plan.device_activations + plan.layer_working_set,
         "XLA's buffers; static: gradients, activations on device, one layer's backward"),
        ("device total", compiled.device, plan.peak_estimate,
         "arguments + outputs - donated + temporaries"),
        ("host (pinned)", compiled.host, plan.host_activations,
         "stacked offload buffers in memory space S(5)"),
    ]
    out = [f"{'per device':<20}{'compiled':>11}{'static plan':>13}"]
    out += [f"{name:<20}{_size(a):>11}{_size(b):>13}  {why}" for name, a, b, why in rows]
    fits = compiled.device <= plan.capacity
    proofs = [t.addressing for t in plan.tags if t.addressing is not None]
    if wrong := [p for p in proofs if p.verdict == addressing.WRONG]:
        out.append(f"DOES NOT WORK: {len(wrong)} of {len(proofs)} host buffers are read back "
                   "from other layers' bytes: the gradients would be wrong (above)")
    elif unproven := [p for p in proofs if not p.holds]:
        out.append(f"UNPROVEN: the addressing of {len(unproven)} of {len(proofs)} host buffers "
                   "cannot be verified (above); check the gradients on a GPU: "
                   "benchmarks/gpu_check.py")
    out.append(f"{'FITS' if fits else 'DOES NOT FIT'}: {_size(compiled.device)} compiled of "
               f"{_size(plan.capacity)} ({compiled.device / plan.capacity:.0%}; "
               f"{memory_source(gpu)}); host {_size(compiled.host)} of "
               f"{_size(plan.host_capacity)} per GPU")
    out.append("not in the compiled figures: GEMM autotuning (none without a GPU: default "
               "tiles), cuDNN workspaces (0 without a GPU), NCCL buffers (outside XLA's pool)")
    return out
