"""Step time from the compiled, scheduled GPU program: XLA's schedule replayed on one GPU's
figures (study/hardware/gpus.py, sources in docs/hardware.md; the model in full: docs/replay.md).

The entry computation is walked in schedule order (`is_scheduled=true`: the order its work is
issued on the GPU), while loops by their known trip counts, each instruction costed from its own
shapes: a GEMM by its FLOPs at the calibrated rate of its inputs' precision (or by its bytes,
where that is longer), any other kernel by its bytes at HBM rate, a collective over NVLink and
the NICs plus NCCL's latency, a host transfer over the host link. An async start queues its
work on its stream; the compute stream waits at a done whose work has not finished, and that
wait is the stream's exposed time. Synchronous collectives and host copies are all exposed.

What a replay cannot know: the kernels XLA's autotuner picks on a real GPU (compile-only
devices skip autotuning), contention between streams for SMs and HBM, clocks and power, and
which algorithm NCCL picks."""

import dataclasses
import json
import math
import re

from study.programs import hlo
from study.hardware.gpus import Gpu

STREAMS = ("compute", "collectives", "to host", "from host", "async compute")
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "opt-barrier",
        "after-all", "partition-id", "replica-id", "add-dependency"}
COLLECTIVES = {"all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all", "collective-broadcast"}
SLICING = {"dynamic-slice", "slice", "gather"}  # a fusion reads only what these take
ATTENTION = {"__cudnn$fmhaSoftmax": 2, "__cudnn$fmhaSoftmaxBackward": 5}  # GEMMs per call
_PRECISION = {"f4e2m1fn": "fp4", "bf16": "bf16", "f16": "bf16", "f32": "tf32", "f64": "tf32"}
_BITS = {"fp4": 4, "fp8": 8, "bf16": 16, "tf32": 32}  # of each precision class


def precision(dtype: str) -> str:
    """A GEMM input's precision class (f8 types and s8: "fp8")."""
    return "fp8" if dtype.startswith(("f8", "s8", "u8")) else _PRECISION.get(dtype, "bf16")


@dataclasses.dataclass(frozen=True)
class Work:
    """One instruction's work: `seconds` on `stream`; a GEMM's FLOPs per precision class."""
    seconds: float
    stream: str
    flops: tuple[tuple[str, float], ...] = ()
    gemm_bound: bool = False  # a kernel whose GEMMs take longer than its HBM traffic
    nbytes: float = 0.0  # a host transfer's bytes over the host link


@dataclasses.dataclass
class Replay:
    step_s: float
    busy: dict  # stream -> seconds of work issued on it
    exposed: dict  # stream -> seconds the compute stream waited for it
    flops: dict  # precision class -> GEMM FLOPs executed (per device)
    gemm_s: float  # compute-stream seconds in GEMM-bound kernels
    slices: list  # (stream, instruction, op_name, start, seconds, loop iterations) when kept
    efficiency: dict  # what the GEMMs ran at, per precision class
    moved: dict = dataclasses.field(default_factory=dict)  # "to host", "from host" -> bytes
    # per device over the host link (offloaded activations, the state in host memory)

    def critical(self) -> str:
        """The resource the step waits on most: the compute stream's GEMMs or its
        memory-bound kernels, or the stream with most exposed time, whichever is largest."""
        compute = self.busy["compute"] - sum(self.exposed.values())
        parts = {"GEMMs": self.gemm_s, "memory-bound kernels": compute - self.gemm_s,
                 **{f"exposed {k}": v for k, v in self.exposed.items()}}
        return max(parts, key=parts.get)


class Costs:
    """Each instruction's `Work` on `devices` GPUs of one kind, from its shapes."""

    def __init__(self, module: hlo.Module, gpu: Gpu, devices: int, efficiency=None):
        self.module, self.gpu, self.devices = module, gpu, devices
        self.efficiency = dict(gpu.efficiency if efficiency is None else efficiency)
        self.domain = gpu.domain_size(devices)
        self._cache = {}  # one replay's memo of its instructions' work: no traces

    def rate(self, precision_class: str) -> float:
        peaks = self.gpu.peaks
        peak = peaks.get(precision_class, peaks["bf16"])  # no FP4/FP8 units: XLA upcasts
        return peak * self.efficiency.get(precision_class, 1.0)

    def of(self, computation: hlo.Computation, instruction: hlo.Instruction,
           done: hlo.Instruction | None = None) -> Work:
        if id(instruction) not in self._cache:
            self._cache[id(instruction)] = self._work(computation, instruction, done)
        return self._cache[id(instruction)]

    def _work(self, comp, ins, done) -> Work:
        kind = hlo.kind(self.module, ins)
        output = (done or ins).shape
        inputs = [comp.by_name[o].shape for o in ins.operands if o in comp.by_name]
        if kind in COLLECTIVES:
            return self._collective(ins, kind, max(sum(s.nbytes for s in inputs), output.nbytes))
        if output.on_host or any(s.on_host for s in inputs):
            return self._host(inputs, output)
        stream = "async compute" if ins.opcode.endswith("-start") else "compute"
        if ins.opcode in ("copy", "copy-start"):
            return self._kernel(stream, 2 * output.nbytes)
        if ins.opcode in ("fusion", "fusion-start"):
            body = self.module.computations[ins.called()[0]]
            return self._kernel(stream, self._fusion_bytes(comp, ins, body),
                                self._computation_gemms(body.name))
        gemms = self._custom_gemms(comp, ins) if ins.opcode == "custom-call" else ()
        return self._kernel(stream, sum(s.nbytes for s in inputs) + output.nbytes, gemms)

    def _kernel(self, stream, nbytes, gemms=()) -> Work:
        memory = nbytes / self.gpu.hbm
        compute = sum(flops / self.rate(p) for p, flops in gemms)
        return Work(self.gpu.kernel_launch + max(memory, compute), stream, tuple(gemms),
                    compute > memory)

    def _host(self, inputs, output) -> Work:
        """A transfer between HBM and pinned host memory: the device's bytes, one way."""
        if output.on_host:
            stream, nbytes = "to host", sum(s.nbytes for s in inputs if not s.on_host)
        else:
            stream, nbytes = "from host", output.nbytes
        rate = self.gpu.host_link / self.gpu.host_link_gpus  # every GPU moves the same bytes
        return Work(nbytes / rate, stream, nbytes=nbytes)

    def _collective(self, ins, kind, size) -> Work:
        """The slowest of its groups: one that straddles a domain boundary crosses the NICs
        where the others stay on NVLink, and the step waits for it."""
        groups = hlo.replica_groups(hlo.wrapped(self.module, ins), self.devices)
        if len(groups[0]) <= 1:
            return Work(0.0, "collectives")
        spans = {(len(g), len({device // self.domain for device in g})) for g in groups}
        seconds = max(self._group_seconds(kind, size, n, d) for n, d in spans)
        return Work(self.gpu.collective_latency + seconds, "collectives")

    def _group_seconds(self, kind, size, n: int, d: int) -> float:
        """Ring bytes per GPU: an all-gather's output (a reduce-scatter's input) S over n GPUs in d
        NVLink domains of m: (d-1)/d * S/m over the NICs, then (m-1)/m * S over NVLink; all-reduce:
        both; all-to-all: (m-1)/n of S over NVLink and (n-m)/n over the NICs at once."""
        m = n // d
        nvlink, network = self.gpu.nvlink, self.gpu.network
        ring = (m - 1) / m * size / nvlink + (d - 1) / d * size / m / network
        if kind == "all-reduce":
            return 2 * ring
        if kind in ("all-to-all", "ragged-all-to-all"):
            return max((m - 1) / n * size / nvlink, (n - m) / n * size / network)
        if kind == "collective-permute":
            return size / (network if d > 1 else nvlink)
        return ring

    def _fusion_bytes(self, comp, ins, body: hlo.Computation) -> float:
        """HBM bytes of a fusion: operands as read (of a stacked buffer the slice it takes; nothing
        of one it updates in place) and what it writes (of an in-place update, the update)."""
        total = 0.0
        for param, operand in zip(body.parameters(), ins.operands):
            users = [u for u in body.instructions if param.name in u.operands]
            # what each user does to the buffer it takes first ("": takes it as another operand)
            uses = {u.opcode if u.operands[0] == param.name else "" for u in users}
            if uses and uses <= SLICING:
                total += sum(u.shape.nbytes for u in users)
            elif uses != {"dynamic-update-slice"}:
                total += comp.by_name[operand].shape.nbytes
        root = body.root
        outputs = [body.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
        written = [body.by_name[o.operands[1]] if o.opcode == "dynamic-update-slice" else o
                   for o in outputs]
        return total + sum(o.shape.nbytes for o in written)

    def _computation_gemms(self, name: str) -> list[tuple[str, float]]:
        if name in self._cache:
            return self._cache[name]
        comp, found = self.module.computations[name], []
        for ins in comp.instructions:
            if ins.opcode == "dot":
                lhs, rhs = (comp.by_name[o].shape for o in ins.operands[:2])
                dims = re.findall(r"\d+", ins.attrs.get("lhs_contracting_dims", ""))
                contracted = math.prod(lhs.dims[int(d)] for d in dims)
                slower = max(precision(lhs.dtype), precision(rhs.dtype), key=_BITS.get)
                found.append((slower, 2.0 * ins.shape.size * contracted))
            elif ins.opcode == "fusion":
                found += self._computation_gemms(ins.called()[0])
            elif ins.opcode == "custom-call":
                found += self._custom_gemms(comp, ins)
        self._cache[name] = found
        return found

    def _custom_gemms(self, comp, ins) -> list[tuple[str, float]]:
        target = ins.attrs.get("custom_call_target", "").strip('"')
        operands = [comp.by_name[o].shape for o in ins.operands]
        out = ins.shape.elements[0] if ins.shape.is_tuple else ins.shape
        if target == "__cudnn$blockScaledDot":  # [b, m, k] x [b, n, k] -> [b, m, n]
            return [(precision(operands[0].dtype), 2.0 * out.size * operands[0].dims[-1])]
        if target in ATTENTION:  # q, k, v as [batch, sequence, heads, head dim]
            config = ins.backend_config().get("cudnn_fmha_backend_config", {})
            scores = math.prod(int(d) for d in config["intermediate_tensor_shape"]["dimensions"])
            qk, v = operands[0].dims[-1], operands[2].dims[-1]
            dims = qk + v if ATTENTION[target] == 2 else 3 * qk + 2 * v
            causal = 0.5 if config.get("mask_type") == "CAUSAL" else 1.0
            return [("bf16", 2.0 * scores * dims * causal)]
        return []


class _Streams:
    """The replay's clock: the compute stream's time, when each other stream is next free,
    what each started async op finishes at."""

    def __init__(self, keep_slices: bool):
        self.now, self.free = 0.0, dict.fromkeys(STREAMS, 0.0)
        self.busy, self.exposed = dict.fromkeys(STREAMS, 0.0), dict.fromkeys(STREAMS[1:], 0.0)
        self.flops, self.gemm_s, self.pending = {}, 0.0, {}
        self.moved = {"to host": 0.0, "from host": 0.0}
        self.slices = [] if keep_slices else None

    def record(self, ins, start, work, loops):
        self.busy[work.stream] += work.seconds
        if work.stream in self.moved:
            self.moved[work.stream] += work.nbytes
        for p, f in work.flops:
            self.flops[p] = self.flops.get(p, 0.0) + f
        if self.slices is not None:
            self.slices.append((work.stream, ins.name, _op_name(ins), start, work.seconds, loops))

    def run(self, ins, work, loops):
        """A synchronous instruction: the compute stream does it (or waits for it)."""
        self.record(ins, self.now, work, loops)
        if work.stream != "compute":
            self.exposed[work.stream] += work.seconds
        elif work.gemm_bound:
            self.gemm_s += work.seconds
        self.now += work.seconds

    def start(self, ins, work, loops):
        begin = max(self.now, self.free[work.stream])
        self.free[work.stream] = begin + work.seconds
        self.pending[ins.name] = (work.stream, begin + work.seconds)
        self.record(ins, begin, work, loops)

    def done(self, start_name):
        stream, finish = self.pending.pop(start_name)
        if finish > self.now:
            self.exposed[stream] += finish - self.now
            self.now = finish


def _op_name(ins: hlo.Instruction) -> str:
    found = re.search(r'op_name="([^"]*)"', ins.attrs.get("metadata", ""))
    return found.group(1) if found else ""


def replay(module: hlo.Module, gpu: Gpu, devices: int, efficiency=None,
           keep_slices: bool = False) -> Replay:
    """One training step of `module` (a scheduled GPU program) on `devices` GPUs of `gpu`."""
    if not module.scheduled:
        raise ValueError("the HLO module is not scheduled: replay the program XLA optimized")
    costs = Costs(module, gpu, devices, efficiency)
    clock = _Streams(keep_slices)
    _walk(module, module.entry, costs, clock, ())
    if clock.pending:
        raise ValueError(f"async work never waited for: {sorted(clock.pending)[:3]}")
    clock.busy["compute"] = clock.now  # the compute stream's time, waits included
    return Replay(clock.now, clock.busy, clock.exposed, clock.flops, clock.gemm_s,
                  clock.slices or [], costs.efficiency, clock.moved)


def _walk(module, comp, costs, clock, loops):
    dones = {i.operands[0]: i for i in comp.instructions if i.opcode.endswith("-done")}
    for ins in comp.instructions:
        op = ins.opcode
        if op in FREE or (op == "custom-call" and "AllocateBuffer" in ins.attrs.get(
                "custom_call_target", "")):
            continue
        if op == "while":
            trips = int(ins.backend_config()["known_trip_count"]["n"])
            body = module.computations[ins.attrs["body"].lstrip("%")]
            for k in range(trips):
                _walk(module, body, costs, clock, (*loops, k))
        elif op in ("call", "conditional"):  # a conditional: its first branch (none here)
            _walk(module, module.computations[ins.called()[0]], costs, clock, loops)
        elif op.endswith("-start"):
            clock.start(ins, costs.of(comp, ins, dones.get(ins.name)), loops)
        elif op.endswith("-done"):
            clock.done(ins.operands[0])
        else:
            clock.run(ins, costs.of(comp, ins), loops)


@dataclasses.dataclass(frozen=True)
class Overlap:
    """What a schedule overlaps: its synchronous collectives and, per async pair, the kernels the
    compute stream issues between its start and its done."""
    synchronous: int
    between: tuple[tuple[str, int], ...]  # (the pair's stream, kernels between start and done)

    def kernels_between(self, stream: str) -> list[int]:
        return [n for s, n in self.between if s == stream]


def overlap(module: hlo.Module, gpu: Gpu, devices: int) -> Overlap:
    """Counted over every computation of the scheduled module, each once."""
    costs, synchronous, between = Costs(module, gpu, devices), 0, []
    for comp in module.computations.values():
        position = {ins.name: k for k, ins in enumerate(comp.instructions)}
        kernels = [ins.opcode not in FREE and not ins.opcode.endswith(("-start", "-done"))
                   for ins in comp.instructions]
        for k, ins in enumerate(comp.instructions):
            if ins.opcode in COLLECTIVES:
                synchronous += 1
            elif ins.opcode.endswith("-done") and ins.operands[0] in position:
                start = comp.by_name[ins.operands[0]]
                stream = costs.of(comp, start, ins).stream
                between.append((stream, sum(kernels[position[start.name] + 1:k])))
    return Overlap(synchronous, tuple(between))


def write_timeline(result: Replay, title: str, path) -> None:
    """The replayed step as a Chrome/Perfetto trace, one track per stream."""
    events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": title}}]
    events += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": k, "args": {"name": s}}
               for k, s in enumerate(STREAMS)]
    events += [{"ph": "X", "pid": 0, "tid": STREAMS.index(stream), "name": name,
                "ts": start * 1e6, "dur": seconds * 1e6,
                "args": {"op_name": op_name, "iterations": list(loops)}}
               for stream, name, op_name, start, seconds, loops in result.slices]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f, separators=(",", ":"))
