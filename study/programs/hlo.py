"""Optimized HLO text (`compiled.as_text()`, or `--xla_dump_to`'s `*after_optimizations.txt`),
parsed as far as this project reads it: computations, their instructions in schedule order
(`is_scheduled=true`: the order is the execution order), shapes with layouts and memory spaces,
operands, called computations and attributes. No JAX import: a committed HLO file is read the
same way as a fresh compile."""

import dataclasses
import functools
import json
import math
import re

import numpy as np

HOST_MEMORY_SPACE = 5  # S(5): pinned host memory on XLA's GPU backend
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32,
         "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
         "c64": 64, "c128": 128, "f4e2m1fn": 4, "f8e8m0fnu": 8}
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](?:\{([^}]*)\})?")


def _bits(dtype: str) -> int:
    return 8 if dtype.startswith("f8") else _BITS.get(dtype, 0)  # token[], opaque: no bytes


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


@dataclasses.dataclass(frozen=True)
class Shape:
    """An array shape (`dtype`, `dims`, `minor_to_major` layout, memory space) or a tuple."""
    dtype: str = ""
    dims: tuple[int, ...] = ()
    minor_to_major: tuple[int, ...] = ()
    memory_space: int = 0
    elements: tuple["Shape", ...] | None = None  # a tuple's element shapes

    @property
    def is_tuple(self) -> bool:
        return self.elements is not None

    @property
    def on_host(self) -> bool:
        return self.memory_space == HOST_MEMORY_SPACE

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        """Bytes of the array (sub-byte types packed), or of every element of a tuple."""
        if self.is_tuple:
            return sum(e.nbytes for e in self.elements)
        return -(-self.size * _bits(self.dtype) // 8)

    def byte_strides(self) -> tuple[int, ...]:
        """Bytes between neighbours along each dimension, from the layout (dense, whole bytes)."""
        order = self.minor_to_major or tuple(reversed(range(len(self.dims))))
        strides, step = [0] * len(self.dims), _bits(self.dtype) // 8
        for dim in order:
            strides[dim] = step
            step *= self.dims[dim]
        return tuple(strides)


def _split_top(text: str, sep: str = ",") -> list[str]:
    """`text` split at `sep` outside brackets and quotes (unbalanced brackets: ValueError)."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and ch in "([{":
            depth += 1
        elif not quoted and ch in ")]}":
            depth -= 1
        elif not quoted and depth == 0 and ch == sep:
            parts.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in {text[:80]!r}")
    tail = text[start:].strip()
    return parts + [tail] if tail else parts


def parse_shape(text: str) -> Shape:
    text = re.sub(r"/\*.*?\*/", "", text).strip()
    if text.startswith("("):
        return Shape(elements=tuple(parse_shape(t) for t in _split_top(text[1:-1])))
    match = _ARRAY.fullmatch(text)
    if match is None:
        return Shape(dtype=text)  # token[] and the like
    dtype, dims, layout = match.groups()
    order, _, extras = (layout or "").partition(":")
    space = re.search(r"S\((\d+)\)", extras)
    return Shape(dtype, ints(dims), ints(order), int(space.group(1)) if space else 0)


@dataclasses.dataclass
class Instruction:
    name: str
    shape: Shape
    opcode: str
    operands: list[str]  # instruction names; literals (a constant's value) are in `literal`
    attrs: dict[str, str]
    literal: str = ""
    root: bool = False

    def called(self) -> list[str]:
        """Computations this instruction runs (fusions, async starts, calls, loops)."""
        keys = ("calls", "to_apply", "condition", "body", "branch_computations")
        return [name for key in keys if key in self.attrs
                for name in re.findall(r"%?([\w.\-]+)", self.attrs[key].strip("{}"))]

    def backend_config(self) -> dict:
        text = self.attrs.get("backend_config", "")
        try:
            return json.loads(text) if text.startswith("{") else {}
        except json.JSONDecodeError:
            return {}

    @property
    def parameter_number(self) -> int:
        return int(self.literal)


@dataclasses.dataclass
class Computation:
    name: str
    instructions: list[Instruction]
    entry: bool = False

    @property
    def root(self) -> Instruction:
        return next(i for i in self.instructions if i.root)

    @functools.cached_property
    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}

    def parameters(self) -> list[Instruction]:
        return sorted((i for i in self.instructions if i.opcode == "parameter"),
                      key=lambda i: i.parameter_number)


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    scheduled: bool

    @property
    def entry(self) -> Computation:
        return next(c for c in self.computations.values() if c.entry)


def parse_instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    root, name, rest = match.groups()
    # rest: SHAPE opcode(OPERANDS), key=value, ... (XLA separates them by single spaces)
    shape, call, *attributes = _split_top(rest, " ")
    opcode, _, args = call.removesuffix(",").partition("(")
    operands, literal = [], ""
    for arg in _split_top(re.sub(r"/\*.*?\*/", "", args.removesuffix(")"))):
        if arg.startswith("%"):
            operands.append(arg[1:])
        elif re.fullmatch(r"[\w.\-]+", arg) and opcode not in ("constant", "parameter"):
            operands.append(arg)  # operands printed without their sigil
        else:
            literal = arg
    attrs = {key.strip(): value.strip() for key, _, value in
             (item.partition("=") for item in _split_top(" ".join(attributes)))}
    return Instruction(name, parse_shape(shape), opcode, operands, attrs, literal, bool(root))


def parse_module(text: str) -> Module:
    computations, current, scheduled = {}, None, False
    for line in text.splitlines():
        if line.startswith("HloModule "):
            scheduled = "is_scheduled=true" in line
        elif current is None:
            if match := _COMPUTATION.match(line):
                current = Computation(match.group(2), [], entry=bool(match.group(1)))
        elif line.startswith("}"):
            computations[current.name] = current
            current = None
        elif (instruction := parse_instruction(line)) is not None:
            current.instructions.append(instruction)
    return Module(computations, scheduled)


def wrapped(module: "Module", instruction: Instruction) -> Instruction:
    """The instruction that does the work: for a generic async start (an all-to-all is issued
    that way), the root of the computation it wraps, which has the attributes."""
    if instruction.opcode == "async-start":
        return module.computations[instruction.called()[0]].root
    return instruction


def kind(module: "Module", instruction: Instruction) -> str:
    return wrapped(module, instruction).opcode.removesuffix("-start")


def replica_groups(instruction: Instruction, devices: int) -> list[list[int]]:
    """The device groups of a collective, from any of the forms XLA prints: `{}` (all),
    `{{0,1},{2,3}}`, iota `[2,4]<=[4,2]T(1,0)` and jax 0.12's `mesh['a'=2,'b'=4] {'b'}`."""
    text = instruction.attrs.get("replica_groups", "{}")
    if text in ("{}", "{{}}"):
        return [list(range(devices))]
    if text.startswith("{"):
        return [list(ints(g)) for g in re.findall(r"\{([\d,]+)\}", text)]
    if text.startswith("mesh["):
        mesh, _, over = text.partition("]")
        sizes = {a: int(n) for a, n in re.findall(r"'([^']+)'=(\d+)", mesh)}
        chosen = re.findall(r"'([^']+)'", over)  # a group varies these axes, the rest fixed
        order = [k for k, a in enumerate(sizes) if a not in chosen]
        order += [list(sizes).index(a) for a in chosen]
        ids = np.arange(math.prod(sizes.values())).reshape(list(sizes.values()))
        return ids.transpose(order).reshape(-1, math.prod(sizes[a] for a in chosen)).tolist()
    shape, dims, perm = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text).groups()
    ids = np.arange(math.prod(ints(dims))).reshape(ints(dims))
    if perm:
        ids = ids.transpose(ints(perm))
    return ids.reshape(ints(shape)).tolist()
