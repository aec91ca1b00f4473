"""Proof that a compiled GPU program reads each offloaded activation back from the bytes its
forward pass wrote it to.

An activation offloaded inside a layer scan lives in one host buffer stacked over the layers
(`bf16[L, ...]{...:S(5)}`, made by an `AllocateBuffer` custom call). The forward loop writes
layer i into it (a dynamic-update-slice), the backward loop reads layer L-1-j back in its
iteration j (a dynamic-slice). Two things say which bytes an access touches, both read here:
  - what the program means: the start index the loop passes, evaluated iteration by iteration
    (scalar arithmetic on the loop's counters, carried through the loop state, fusions and
    async computations);
  - what the GPU will address: XLA's descriptor on the slice, `dynamic_slice_config` in its
    backend config (`byte_offset` O and `byte_stride` S, or the same nested as `linear`):
    iteration k of the loop addresses byte O + k x S. A slice without one computes its
    address from the index itself.
The proof holds when every access's descriptor agrees with its index, each layer is written
once and read once, and the backward pass's j-th read is the layer of the forward pass's
(L-1-j)-th write: "read back layer L-1 first". jaxlib 0.10.2 compiles the reads of host buffers
with a forward walk (O = 0, S > 0) while the loop passes L-1-i (openxla/xla #46231): silently
wrong gradients, and the proof says which access and which bytes. A descriptor or a program
shape it does not understand is CANNOT VERIFY, never a pass.

The layer scans' weights in host memory (parameters=host) are read the same way, from the
buffer they arrive in: the forward loop reads layer i, the backward loop layer L-1-j, and
writes each layer's gradient into a stacked host buffer (`prove_walk`)."""

import dataclasses
import operator

from study.programs.hlo import Computation, Instruction, Module, Shape, ints, parse_module

XLA_ISSUE = "openxla/xla #46231"
CHECKED, WRONG, UNVERIFIED = "checked", "WRONG", "CANNOT VERIFY"
_INTEGER = ("pred", "s8", "s16", "s32", "s64", "u8", "u16", "u32", "u64")
_SCALAR = {"add": operator.add, "subtract": operator.sub, "multiply": operator.mul,
           "maximum": max, "minimum": min, "and": operator.and_, "or": operator.or_,
           "xor": operator.xor, "shift-left": operator.lshift, "negate": operator.neg,
           "not": lambda a: int(not a), "select": lambda pred, a, b: a if pred else b,
           "divide": lambda a, b: int(a / b) if b else None,
           "remainder": lambda a, b: a - b * int(a / b) if b else None,
           "clamp": lambda low, x, high: min(max(x, low), high)}
_COMPARE = {"EQ": operator.eq, "NE": operator.ne, "LT": operator.lt, "LE": operator.le,
            "GT": operator.gt, "GE": operator.ge}
_PASS_THROUGH = ("copy", "bitcast", "reshape", "convert", "copy-start", "copy-done")
_CALLS = ("fusion", "call", "fusion-start", "async-start", "custom-call")


class CannotVerify(Exception):
    """The program holds something the proof does not understand."""


@dataclasses.dataclass(frozen=True)
class HostBuffer:
    """A stacked host buffer: its `AllocateBuffer` instruction and shape."""
    name: str
    shape: Shape


@dataclasses.dataclass(frozen=True)
class Loop:
    name: str
    iteration: int  # k: 0 .. trip count - 1


@dataclasses.dataclass(frozen=True)
class Access:
    """One dynamic-slice (read) or dynamic-update-slice (write) of a host buffer, as run."""
    buffer: HostBuffer
    write: bool
    instruction: Instruction  # the slice itself (inside its fusion or async computation)
    start: tuple[int | None, ...]  # the start indices the program passes, evaluated
    sizes: tuple[int, ...]
    sliced: Shape  # the buffer as the slice sees it (its layout gives the byte offsets)
    loops: tuple[Loop, ...]  # enclosing loops, outermost first

    @property
    def where(self) -> str:
        loop = (f", iteration {self.loops[-1].iteration} of loop {self.loops[-1].name}"
                if self.loops else ", outside any loop")
        return f"{self.instruction.name}{loop}"


class _Interpreter:
    """Runs a module's scalar integer arithmetic and follows its host buffers, recording every
    slice of them; everything else (the tensors) is an unknown value, None."""

    def __init__(self, module: Module):
        self.module = module
        self.accesses: list[Access] = []
        self.relevant: dict[str, bool] = {}
        self.by_name = {i.name: i for c in module.computations.values() for i in c.instructions}

    def run(self) -> list[Access]:
        entry = self.module.entry  # (a GPU run's state in host memory arrives as parameters)
        self.call(entry, [HostBuffer(p.name, p.shape) if p.shape.on_host else None
                          for p in entry.parameters()], ())
        return self.accesses

    def is_relevant(self, name: str) -> bool:
        """Whether running a computation can touch a host buffer or yield a scalar index."""
        if name not in self.relevant:
            self.relevant[name] = False  # (recursion guard)
            comp = self.module.computations[name]
            root = comp.root.shape
            self.relevant[name] = (
                root.is_tuple or (root.dtype in _INTEGER and not root.dims)
                or any(i.opcode == "while" or i.shape.on_host
                       or any(self.by_name[o].shape.on_host for o in i.operands
                              if o in self.by_name)
                       or any(self.is_relevant(c) for c in i.called())
                       for i in comp.instructions))
        return self.relevant[name]

    def call(self, comp: Computation, args: list, loops: tuple):
        env = {}
        for instruction in comp.instructions:
            env[instruction.name] = self.step(instruction, env, args, loops)
        return env[comp.root.name]

    def step(self, i: Instruction, env: dict, args: list, loops: tuple):
        values = [env.get(o) for o in i.operands]
        op = i.opcode
        if op == "parameter":
            return args[i.parameter_number]
        if op == "constant":
            return _scalar_literal(i)
        if op == "get-tuple-element":
            return values[0][int(i.attrs["index"])] if isinstance(values[0], tuple) else None
        if op == "tuple":
            return tuple(values)
        if op in _PASS_THROUGH:
            return values[0] if values and isinstance(values[0], (int, HostBuffer)) else None
        if buffer := _host_buffer(i):
            return buffer
        if op in ("dynamic-slice", "dynamic-update-slice"):
            return self.slice(i, values, loops)
        if op == "while":
            return self.loop(i, values[0], loops)
        if op in ("fusion-done", "async-done"):
            return values[0][1] if isinstance(values[0], tuple) else None
        if op in _CALLS and i.called():
            if not self.is_relevant(i.called()[0]):
                return None
            inner = self.call(self.module.computations[i.called()[0]], values, loops)
            return (tuple(values), inner, None) if op.endswith("-start") else inner
        if op == "conditional" and _holds_buffer(values):
            raise CannotVerify(f"a host buffer passes through conditional {i.name}")
        return _arithmetic(i, values)

    def slice(self, i: Instruction, values: list, loops: tuple):
        buffer, write = values[0], i.opcode == "dynamic-update-slice"
        if isinstance(buffer, HostBuffer):
            starts = values[2:] if write else values[1:]
            sizes = (self.by_name[i.operands[1]].shape.dims if write
                     else ints(i.attrs["dynamic_slice_sizes"].strip("{}")))
            sliced = self.by_name[i.operands[0]].shape
            self.accesses.append(Access(buffer, write, i, tuple(starts), sizes, sliced, loops))
        return buffer if write else None

    def loop(self, i: Instruction, state, loops: tuple):
        body = self.module.computations[i.attrs["body"].lstrip("%")]
        if not _holds_buffer(state) and not self.is_relevant(body.name):
            return None
        trip = i.backend_config().get("known_trip_count", {}).get("n")
        if trip is None:
            raise CannotVerify(f"loop {i.name} has no known trip count")
        for k in range(int(trip)):
            state = self.call(body, [state], (*loops, Loop(i.name, k)))
        return state


def _holds_buffer(values) -> bool:
    return any(_holds_buffer(v) if isinstance(v, tuple) else isinstance(v, HostBuffer)
               for v in values)


def _host_buffer(i: Instruction) -> HostBuffer | None:
    if (i.opcode == "custom-call" and i.shape.on_host
            and i.attrs.get("custom_call_target") == '"AllocateBuffer"'):
        return HostBuffer(i.name, i.shape)
    return None


def _scalar_literal(i: Instruction):
    if i.shape.dims or i.shape.dtype not in _INTEGER:
        return None
    text = i.literal.strip()
    return {"true": 1, "false": 0}.get(text, int(text) if text.lstrip("-").isdigit() else None)


def _arithmetic(i: Instruction, values: list):
    """Scalar integer arithmetic; None where a value is unknown or not a scalar integer."""
    if i.shape.dims or i.shape.is_tuple or i.shape.dtype not in _INTEGER or None in values:
        return None
    if i.opcode == "compare":
        return int(_COMPARE[i.attrs["direction"]](*values))
    return _SCALAR[i.opcode](*values) if i.opcode in _SCALAR else None


def descriptor(i: Instruction) -> tuple[int, int, int | None] | None:
    """(byte_offset, byte_stride, loop_index) of XLA's descriptor on a slice; None without
    one. jaxlib 0.10.2 writes the walk at the top level, 0.12 nests it as `linear`."""
    config = i.backend_config().get("dynamic_slice_config")
    if config is None:
        return None
    known = {"loop_index", "byte_offset", "byte_stride", "linear"}
    walk = config.get("linear", config)
    if set(config) - known or set(walk) - known:
        raise CannotVerify(f"{i.name}: a descriptor this proof does not read: {config}")
    if "linear" in config and any(int(config.get(k, 0)) for k in ("byte_offset", "byte_stride")):
        raise CannotVerify(f"{i.name}: a descriptor with two walks: {config}")
    loop = config.get("loop_index")
    return (int(walk.get("byte_offset", 0)), int(walk.get("byte_stride", 0)),
            None if loop is None else int(loop))


@dataclasses.dataclass(frozen=True)
class Proof:
    """The verdict on one host buffer (CHECKED, WRONG or UNVERIFIED), and why."""
    buffer: HostBuffer
    verdict: str
    detail: str

    @property
    def holds(self) -> bool:
        return self.verdict == CHECKED

    @property
    def summary(self) -> str:
        """A few words for a placement list."""
        return self.detail if self.holds else f"ADDRESSING {self.verdict}"


def _meant(access: Access) -> int:
    """The byte offset the program means: start indices clamped as XLA clamps them, times the
    byte strides of the buffer's layout; one whole layer, or CannotVerify."""
    shape = access.sliced
    if None in access.start:
        raise CannotVerify(f"{access.where}: a start index the proof cannot evaluate")
    if shape.dims != access.buffer.shape.dims or access.sizes != (1, *shape.dims[1:]):
        raise CannotVerify(f"{access.where}: a slice that is not one whole layer "
                           f"({list(access.sizes)} of {list(shape.dims)})")
    starts = [min(max(s, 0), d - n) for s, d, n in zip(access.start, shape.dims, access.sizes)]
    return sum(s * b for s, b in zip(starts, shape.byte_strides()))


def _addressed(access: Access, meant: int) -> tuple[int, str]:
    """(the byte offset the GPU addresses, how): XLA's descriptor at this iteration, or the
    index itself where the slice has none."""
    found = descriptor(access.instruction)
    if found is None:
        return meant, "no descriptor: the kernel computes the address from the index"
    offset, stride, loop = found
    words = f"XLA's descriptor byte_offset {offset:,}, byte_stride {stride:+,}"
    if loop is None:
        if stride:
            raise CannotVerify(f"{access.where}: a stride without a loop in {words}")
        return offset, words
    if loop != 0 or not access.loops:  # loop_index 0 is the innermost loop (XLA's tests)
        raise CannotVerify(f"{access.where}: loop_index {loop} of {len(access.loops)} loops")
    return offset + access.loops[-1].iteration * stride, words


class _Wrong(Exception):
    """An access whose bytes are not the ones the program means (the Proof's detail)."""


def _layers(buffer: HostBuffer, accesses: list[Access]) -> list[int]:
    """The layer each access touches, in the order run, where the GPU addresses the bytes the
    program means (else _Wrong, which says which access and which bytes)."""
    size = buffer.shape.nbytes // buffer.shape.dims[0]  # one layer's bytes
    layers, done = [], {True: 0, False: 0}
    for access in accesses:
        meant = _meant(access)
        addressed, how = _addressed(access, meant)
        kind = "write" if access.write else "read"
        if addressed != meant:
            raise _Wrong(f"{kind} {done[access.write]} ({access.where}) means layer "
                         f"{meant // size} (the loop passes index {access.start[0]}), but {how} "
                         f"addresses layer {addressed / size:g}: the GPU would {kind} another "
                         f"layer's bytes ({XLA_ISSUE})")
        done[access.write] += 1
        layers.append(meant // size)
    return layers


def prove_buffer(buffer: HostBuffer, accesses: list[Access]) -> Proof:
    layers = buffer.shape.dims[0]
    try:
        touched = _layers(buffer, accesses)
    except _Wrong as e:
        return Proof(buffer, WRONG, str(e))
    writes = [n for n, a in zip(touched, accesses) if a.write]
    reads = [n for n, a in zip(touched, accesses) if not a.write]
    if sorted(writes) != list(range(layers)) or sorted(reads) != list(range(layers)):
        raise CannotVerify(f"{len(writes)} writes and {len(reads)} reads of {layers} layers, "
                           "not one each")
    for j, (read, written) in enumerate(zip(reads, reversed(writes))):
        if read != written:
            return Proof(buffer, WRONG, (
                f"the backward pass's read {j} is layer {read}, but the forward pass wrote "
                f"layer {written} at step {layers - 1 - j}: not the reverse of the writes"))
    return Proof(buffer, CHECKED, f"read back layer {layers - 1} first: checked")


def prove_walk(buffer: HostBuffer, accesses: list[Access], walk: list[tuple[bool, int]],
               what: str) -> Proof:
    """A layer scan's state in host memory (parameters=host): its first accesses are `walk`,
    (write, layer) in order (e.g. the forward pass reading its weights layer 0 first, then the
    backward pass layer L-1 first), each where the GPU addresses the bytes the program means;
    every later one reads (the update's), its addressing checked too. `what`: the walk in
    words."""
    try:
        touched = _layers(buffer, accesses)
    except _Wrong as e:
        return Proof(buffer, WRONG, str(e))
    done = [(a.write, n) for a, n in zip(accesses, touched)]
    if done[:len(walk)] != walk or any(write for write, _ in done[len(walk):]):
        shown = ", ".join(f"{'write' if w else 'read'} {n}" for w, n in done)
        return Proof(buffer, WRONG, f"not {what}: the program's accesses are {shown}")
    return Proof(buffer, CHECKED, f"{what}: checked")


def accesses(hlo: str) -> list[Access]:
    """Every access to an optimized GPU program's host buffers (those it allocates, and the
    state that arrives in host memory), as run (or CannotVerify)."""
    return _Interpreter(parse_module(hlo)).run()


def prove(hlo: str) -> list[Proof]:
    """A verdict per stacked host buffer of an optimized GPU program (its HLO text)."""
    module = parse_module(hlo)
    buffers = [b for c in module.computations.values() for i in c.instructions
               if (b := _host_buffer(i))]
    if not buffers:
        return []
    try:
        accesses = _Interpreter(module).run()
    except CannotVerify as e:
        return [Proof(b, UNVERIFIED, str(e)) for b in buffers]
    proofs = []
    for buffer in buffers:
        try:
            proofs.append(prove_buffer(buffer, [a for a in accesses if a.buffer == buffer]))
        except CannotVerify as e:
            proofs.append(Proof(buffer, UNVERIFIED, str(e)))
    return proofs
