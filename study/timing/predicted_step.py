"""What `python -m study compile` predicts of a step: the replay of its compiled schedule
(study/timing/replay.py) as printed lines and as the run folder's compiled.json and
timeline.json."""

import dataclasses
import json
from pathlib import Path

from configs import STUDY_TFLOPS
from model import families
from study.plan import memory_plan
from study.programs import hlo
from study.timing import replay
from study.hardware.gpus import Gpu
from runtime.own_program import CompiledMemory, size_words


@dataclasses.dataclass
class StepPrediction:
    result: replay.Replay
    model_flops: float  # per device and step, MaxText's formula
    study_tflops: float | None  # the study's measured figure for this row, if it has one
    gpu: Gpu
    overlap: replay.Overlap
    exchanges: dict | None = None  # exchange_groups, given the mesh's device ids

    @property
    def tflops(self) -> float:
        return self.model_flops / self.result.step_s / 1e12


def of_experiment(experiment, compiled_hlo: str, gpu: Gpu, devices: int, keep_slices: bool = False,
                  efficiency=None, device_ids: list[int] | None = None) -> StepPrediction:
    """The replay of an experiment's compiled program beside MaxText's FLOPs and the study's figure;
    given the mesh's device ids, its all-to-alls against the NVLink domains (one parse for both)."""
    model, run = experiment.model, experiment.run
    flops = families.of(model).training_flops(model, run.per_device_batch, run.seq)
    module = hlo.parse_module(compiled_hlo)
    result = replay.replay(module, gpu, devices, efficiency, keep_slices)
    exchanges = None if device_ids is None else exchange_groups(module, gpu, device_ids)
    return StepPrediction(result, flops, STUDY_TFLOPS.get(experiment.name), gpu,
                          replay.overlap(module, gpu, devices), exchanges)


def efficiency_words(p: StepPrediction) -> str:
    """Each precision class the step's GEMMs use, the rate it ran at and where that comes from."""
    parts = []
    for cls, flops in sorted(p.result.flops.items(), key=lambda kv: -kv[1]):
        share = p.result.efficiency.get(cls, 1.0)
        fitted = p.gpu.calibrated_on.get(cls)
        source = f"fitted on {fitted}" if fitted else "peak: not calibrated"
        parts.append(f"{cls} {flops / 1e15:.1f} PFLOP at {share:.0%} of "
                     f"{p.gpu.peaks.get(cls, p.gpu.peaks['bf16']) / 1e15:g} PFLOP/s ({source})")
    return "; ".join(parts)


def schedule_words(o: replay.Overlap) -> str:
    """How much the schedule overlaps: what the latency hiding scheduler changes."""
    words = [f"{len(o.kernels_between('collectives'))} collectives async, {o.synchronous} "
             "synchronous"]
    for stream in replay.STREAMS[1:]:
        if found := sorted(o.kernels_between(stream)):
            words.append(f"{stream}: {found[len(found) // 2]} kernels between start and done "
                         f"(median of {len(found)})")
    return "; ".join(words)


def exchange_groups(module: hlo.Module, gpu: Gpu, device_ids: list[int]) -> dict:
    """The compiled program's all-to-alls and their device groups (by the mesh's device ids)
    against the NVLink domains: the model's own (expert exchanges) and those XLA's partitioner
    adds to reshard a value (the embedding lookup's: table sharded by width, tokens by batch)."""
    size = gpu.domain_size(len(device_ids))
    found = {"expert": [], "resharding": []}
    wrappers = {c for comp in module.computations.values() for ins in comp.instructions
                if ins.opcode == "async-start" for c in ins.called()}  # counted at their start
    for comp in module.computations.values():
        for ins in comp.instructions if comp.name not in wrappers else ():
            if hlo.kind(module, ins) not in ("all-to-all", "ragged-all-to-all"):
                continue
            inner = hlo.wrapped(module, ins)
            which = ("resharding" if 'is_spmd_generated="true"' in inner.attrs.get(
                "frontend_attributes", "") else "expert")
            found[which].append([tuple(device_ids[d] for d in group)
                                 for group in hlo.replica_groups(inner, len(device_ids))])
    out = {}
    for which, instructions in found.items():
        groups = {g for groups in instructions for g in groups}
        out[which] = {"count": len(instructions), "sizes": sorted({len(g) for g in groups}),
                      "domain": size,
                      "crossing": sorted(g for g in groups if len({d // size for d in g}) > 1)}
    return out


def exchange_line(found: dict) -> str:
    """The all-to-alls, the model's and the partitioner's: do they stay in one NVLink domain?"""
    words = []
    for which, name in (("expert", "expert exchanges"), ("resharding", "XLA's resharding")):
        f = found[which]
        if not f["count"]:
            words.append(f"{name}: none")
            continue
        sizes = "/".join(map(str, f["sizes"]))
        where = (f"each inside one NVLink domain of {f['domain']} GPUs" if not f["crossing"]
                 else f"groups across the NVLink domains of {f['domain']} GPUs, over the NICs")
        words.append(f"{name}: {f['count']} all-to-alls over groups of {sizes} devices, {where}")
    return "all-to-alls: " + "; ".join(words)


def lines(p: StepPrediction) -> list[str]:
    r = p.result
    study = (f"; the study measured {p.study_tflops:,.0f} ({p.tflops / p.study_tflops - 1:+.1%})"
             if p.study_tflops else "")
    exposed = ", ".join(f"{k} {v:.2f} s" for k, v in r.exposed.items() if v >= 0.005) or "none"
    busy = ", ".join(f"{k} {v:.2f} s" for k, v in r.busy.items() if k != "compute" and v >= 0.005)
    return [
        f"step time (replayed from the compiled schedule, study/timing/replay.py): "
        f"{r.step_s:.2f} s, {p.tflops:,.0f} TFLOP/s/device (MaxText's formula){study}",
        f"  compute stream {r.step_s:.2f} s: GEMM-bound kernels {r.gemm_s:.2f} s, waiting on "
        f"other streams (exposed) {exposed}; critical: {r.critical()}",
        f"  other streams busy: {busy or 'none'}",
        *([f"  host link: {size_words(r.moved['from host'])} host->device, "
           f"{size_words(r.moved['to host'])} device->host per step and device (offloaded "
           "activations, the state in host memory)"] if any(r.moved.values()) else []),
        f"  schedule: {schedule_words(p.overlap)}",
        f"  GEMMs: {efficiency_words(p)}",
        "  not known to a replay: the kernels autotuning picks on a GPU, contention between "
        "streams, clocks, NCCL's algorithm (docs/replay.md)",
    ]


def write(p: StepPrediction, compiled: CompiledMemory, plan: memory_plan.MemoryPlan,
          folder: Path, title: str) -> None:
    """The run folder's compiled.json (memory beside the plan, predicted step) and timeline.json."""
    r = p.result
    record = {
        "predicted_step_s": r.step_s,
        "predicted_tflops_per_device": p.tflops,
        "study_tflops_per_device": p.study_tflops,
        "exposed_s": r.exposed,
        "host_link_bytes": r.moved,
        "busy_s": r.busy,
        "gemm_bound_s": r.gemm_s,
        "critical": r.critical(),
        "gemm_flops": r.flops,
        "efficiency": {cls: {"share_of_peak": r.efficiency.get(cls, 1.0),
                             "fitted_on": p.gpu.calibrated_on.get(cls)} for cls in r.flops},
        "model_flops_per_device": p.model_flops,
        "memory_bytes": {**dataclasses.asdict(compiled), "device": compiled.device,
                         "static_plan_peak": plan.peak_estimate,
                         "static_plan_host": plan.host_activations},
    }
    (folder / "compiled.json").write_text(json.dumps(record, indent=2))
    replay.write_timeline(p.result, title, folder / "timeline.json")
