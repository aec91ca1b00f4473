"""What a run reads off its own program: the values its traced step tags in each layer scan
and moves to host memory, and the device memory and host buffers of the program XLA compiled
from it (the run's header prints both)."""

import dataclasses
import re
from collections.abc import Iterator

import numpy as np
from jax.extend import core as jex_core

from model import families
from trainer.program import Program

GiB, MiB = 2**30, 2**20


@dataclasses.dataclass(frozen=True)
class Tagged:
    """One `checkpoint_name` site: its value's shape and dtype, and how often it runs."""
    tag: str
    shape: tuple[int, ...]
    dtype: np.dtype
    count: int  # the product of the enclosing scans' lengths: the layer count in a layer scan
    scan: str  # the named scope of the innermost enclosing scan ("" outside any scan)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize  # also a PRNG key's


def sub_jaxprs(eqn) -> Iterator[jex_core.Jaxpr]:
    for param in eqn.params.values():
        for value in param if isinstance(param, (list, tuple)) else (param,):
            if isinstance(value, jex_core.ClosedJaxpr):
                yield value.jaxpr
            elif isinstance(value, jex_core.Jaxpr):
                yield value


def scope(name_stack: str) -> str:
    """The innermost named scope, without autodiff's wrappers: "jvp(moe_layers)" -> "moe_layers"."""
    innermost = name_stack.split("/")[-1]
    while (wrapped := re.fullmatch(r"\w+\((.*)\)", innermost)) is not None:
        innermost = wrapped.group(1)
    return innermost


def walk(jaxpr, count=1, scan="") -> Iterator[tuple[jex_core.JaxprEqn, int, str, dict]]:
    """Every equation, with its run count, enclosing scan's scope and its jaxpr's producers."""
    producers = {}
    for eqn in jaxpr.eqns:
        yield eqn, count, scan, producers
        producers.update({v: eqn for v in eqn.outvars})
        inner, inner_scan = count, scan
        if eqn.primitive.name == "scan":
            inner *= eqn.params["length"]
            inner_scan = scope(str(eqn.source_info.name_stack))
        for sub in sub_jaxprs(eqn):
            yield from walk(sub, inner, inner_scan)


def tagged_in(jaxpr, offloaded: bool = False) -> dict[str, list[Tagged]]:
    """tag -> its `checkpoint_name` sites, in trace order; with `offloaded`, the values a traced
    step moves to host right after them (an offloading policy puts a `device_put` to host there)."""
    found: dict[str, list[Tagged]] = {}
    for eqn, count, scan, producers in walk(jaxpr):
        if offloaded:  # the site is the equation that makes what the device_put moves
            to_host = eqn.primitive.name == "device_put" and any(
                "host" in str(d).lower() for d in eqn.params["devices"])
            eqn = producers.get(eqn.invars[0]) if to_host else None
        if eqn is not None and eqn.primitive.name == "name":
            aval, tag = eqn.invars[0].aval, eqn.params["name"]
            found.setdefault(tag, []).append(Tagged(tag, aval.shape, aval.dtype, count, scan))
    return found


def offloaded(jaxpr) -> dict[str, list[Tagged]]:
    """tag -> the values a traced step moves to host memory right after tagging them."""
    return tagged_in(jaxpr, offloaded=True)


def link_bytes(jaxpr, devices: int) -> tuple[float, float]:
    """Per device, the bytes a traced step moves over the host link, (to host, to the device):
    every `device_put` between the memories (offloaded activations, the state in host memory)
    times its enclosing scans' lengths, a global shape's bytes shared by the `devices`."""
    moved = {"host": 0.0, "device": 0.0}
    for eqn, count, _, _ in walk(jaxpr):
        if eqn.primitive.name != "device_put":
            continue
        for var, space in zip(eqn.invars, eqn.params["devices"]):
            name = str(space).lower()
            way = "host" if "host" in name else "device" if "device" in name else None
            if way and way not in str(getattr(var.aval, "memory_space", "")).lower():
                moved[way] += count * np.prod(var.aval.shape) * var.aval.dtype.itemsize
    return moved["host"] / devices, moved["device"] / devices


def dot_flops(eqn) -> float:
    """FLOPs of one equation's matrix products (0 for any other equation)."""
    if eqn.primitive.name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * np.prod(eqn.outvars[0].aval.shape) * np.prod([lhs[d] for d in contract])
    if eqn.primitive.name == "ragged_dot":  # [m, k] x [groups, k, n]: each row meets one group
        return 2.0 * np.prod(eqn.invars[0].aval.shape) * eqn.invars[1].aval.shape[-1]
    return 0.0


def step_flops(jaxpr, devices: int) -> float:
    """One device's matrix-product FLOPs in a traced step: a global shape's work is spread
    over the `devices`, a shard_map body's is one device's already (kernels that are custom
    calls, cuDNN's attention, are not counted)."""
    def visit(jaxpr, count, share) -> float:
        total = 0.0
        for eqn in jaxpr.eqns:
            total += count * share * dot_flops(eqn)
            inner = count * eqn.params["length"] if eqn.primitive.name == "scan" else count
            for sub in sub_jaxprs(eqn):
                total += visit(sub, inner, 1.0 if eqn.primitive.name == "shard_map" else share)
        return total
    return visit(jaxpr, 1, 1.0 / devices)


def recomputed_flops(program) -> float:
    """Per device, the matrix-product FLOPs a step's checkpoint policies recompute: its traced
    step's less those of the same step traced without checkpointing (nothing compiled)."""
    if not program.options.policies:
        return 0.0
    plain = Program(program.model, program.run, None, program.target)
    devices = len(program.target.devices)
    return step_flops(program.traced.jaxpr, devices) - step_flops(plain.traced.jaxpr, devices)


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """One device's memory in a compiled program, as XLA's `memory_analysis()` gives it."""
    arguments: int
    outputs: int
    aliased: int  # outputs written over donated arguments
    temporaries: int
    host: int  # in pinned host memory: offloaded activations, the optimizer state on host

    @classmethod
    def of(cls, compiled) -> "CompiledMemory":
        stats = compiled.memory_analysis()
        host = (stats.host_argument_size_in_bytes + stats.host_output_size_in_bytes
                - stats.host_alias_size_in_bytes + stats.host_temp_size_in_bytes)
        return cls(stats.argument_size_in_bytes, stats.output_size_in_bytes,
                   stats.alias_size_in_bytes, stats.temp_size_in_bytes, host)

    @property
    def device(self) -> int:
        """What the program holds in device memory at once (XLA's peak counts host buffers too)."""
        return self.arguments + self.outputs - self.aliased + self.temporaries


@dataclasses.dataclass(frozen=True)
class Readings:
    """What a run reads off its own program, once (the header, the step lines and the summary
    use them): the values it offloads, its compiled memory, its FLOPs per device and step."""
    offloaded: dict[str, list[Tagged]]
    compiled: CompiledMemory
    flops: float  # the model's, by MaxText's formula (model/llama.py, deepseek.py)
    recomputed: float  # the matrix products its checkpoint policies compute again
    link: tuple[float, float]  # bytes over the host link per step, to host and back

    @property
    def host_planned(self) -> int:
        """Offloaded bytes per device and step, as the traced step moves them."""
        return sum(v.nbytes * v.count for sites in self.offloaded.values() for v in sites)


def read(program: Program) -> Readings:
    """`program`'s readings; its step compiled already."""
    model, per_device = program.model, program.batch_size / len(program.target.devices)
    return Readings(offloaded(program.traced.jaxpr), CompiledMemory.of(program.step),
                    families.of(model).training_flops(model, per_device, program.run.seq),
                    recomputed_flops(program),
                    link_bytes(program.traced.jaxpr, len(program.target.devices)))


# A stacked host buffer of a compiled GPU program: `bf16[L, ...]{...:S(5)}` (memory space 5,
# pinned host), made by an AllocateBuffer custom call.
_HOST_BUFFER = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*S\(5\)\} custom-call\(\), "
                          r'custom_call_target="AllocateBuffer"')
DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
               "s32": "int32", "i32": "int32"}  # as HLO (s32) and StableHLO (i32) print them


def size_words(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n / 1024:.0f} KiB"


def unplaced_lines(offloaded: dict[str, list[Tagged]], tag_changes) -> list[str]:
    """A line per `placement.<tag>=offload` change the traced step offloads nothing of: the
    backward pass never reads that tag, so no placement of it changes anything."""
    moved = {(v.scan, v.tag) for sites in offloaded.values() for v in sites}
    moved_tags = {tag for _, tag in moved}
    return [f"placement.{key}=offload places nothing: the backward pass never reads it "
            "(python -m study plan EXPERIMENT lists what it reads)"
            for key, where in tag_changes.items() if where == "offload"
            and (tuple(key.rsplit(".", 1)) not in moved if "." in key else key not in moved_tags)]


def placement_lines(offloaded: dict[str, list[Tagged]], hlo_text: str | None) -> list[str]:
    """Per offloaded tag (per scan) its value per layer and device, and where the compiled
    program keeps it: a stacked host buffer (GPU), or device memory (CPUs drop host placements)."""
    buffers = [(tuple(int(d) for d in dims.split(",") if d), DTYPE_NAMES.get(dtype, dtype))
               for dtype, dims in _HOST_BUFFER.findall(hlo_text or "")]
    out = []
    for value in sorted((v for sites in offloaded.values() for v in sites),
                        key=lambda v: (v.scan, v.tag)):
        stacked = ((value.count, *value.shape), str(value.dtype))
        if hlo_text is None:
            where = "device memory: this backend drops host placements"
        elif stacked in buffers:
            buffers.remove(stacked)
            where = f"host memory, stacked over {value.count} layers"
        else:
            where = "NOT in host memory in the compiled program"
        shape, size = "x".join(map(str, value.shape)), size_words(value.nbytes)
        out.append(f"{value.scan:<13}{value.tag:<20}{shape:<22}{size:>9}  {where}")
    return out
