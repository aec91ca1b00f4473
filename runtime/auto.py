"""preset=auto (docs/placement.md, "Chosen on your machine"): the run trains the fastest
placement that fits this machine, measured, not predicted. Its candidates are every preset of
the family, then a few placements one tag away from the best-ranked of them, that tag picked by
what the traced step says of it (the matrix-product FLOPs keeping it saves, its bytes); each is
compiled for the run's devices, those over the budget dropped (runtime/fit.py's `Budget`), the
rest timed for `auto_steps` steps after one warm-up, with the run's batch, and the fastest
trained. The run folder's auto.json keeps the table; a resume takes the checkpoint's choice."""

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from model import families
from offload import activations
from runtime.fit import STATE, Budget, FitError
from runtime.own_program import (CompiledMemory, link_bytes, offloaded, size_words, step_flops,
                                 tagged_in)
from trainer.program import Program

NEIGHBOURS = 4  # placements one tag away from the best-ranked preset, compiled and timed too


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A placement to try: a preset and its tag changes (the run's own, then its own one), and
    where the state's parts lie (`state`: each of STATE, device or host)."""
    preset: str
    changes: tuple[tuple[str, str], ...]  # (placement.<key>, where), the run's first
    placement: dict | None  # resolved: scan -> {tag: where}; None: checkpointing off
    state: tuple[tuple[str, str], ...] = ()  # (part, where); () : as the run has it

    @property
    def name(self) -> str:
        on_host = [f"{part}=host" for part, where in self.state if where == "host"]
        return " ".join([self.preset, *(f"{k}={v}" for k, v in self.changes), *on_host])


def state_options(run, fixed: set[str]) -> list[tuple[tuple[str, str], ...]]:
    """Where the state may lie in preset=auto's candidates: each part the run keeps in host
    memory (a fit put it there, or the experiment) tried on the device too, unless the command
    line set it (`fixed`); the run's own placement first. [()] where nothing is on host."""
    free = [p for p in STATE if getattr(run, p) == "host" and p not in fixed]
    if not free:
        return [()]
    options = [tuple((p, getattr(run, p)) for p in STATE)]
    for moved in range(1, 2 ** len(free)):  # every subset of the free parts back on device
        back = {p for i, p in enumerate(free) if moved >> i & 1}
        options.append(tuple((p, "device" if p in back else getattr(run, p))
                             for p in STATE))
    return options


@dataclasses.dataclass(frozen=True)
class Row:
    """A candidate compiled: its memory, whether it fits, its median step (None: not timed)."""
    candidate: Candidate
    memory: CompiledMemory
    fits: bool
    seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class Choice:
    """What preset=auto chose: the candidates' table, or (`recorded`) a resumed checkpoint's."""
    chosen: Candidate
    rows: tuple[Row, ...] = ()
    budget: Budget | None = None
    steps: int = 0
    seconds: float = 0.0
    recorded: bool = False

    def words(self) -> str:
        if self.recorded:
            return f"chosen by preset=auto: {self.chosen.name} (the resumed checkpoint's choice)"
        return (f"chosen by preset=auto: {self.chosen.name}, the fastest of "
                f"{sum(r.seconds is not None for r in self.rows)} timed over {self.steps} "
                f"step(s) each ({len(self.rows)} compiled; auto.json)")

    def record(self) -> dict:
        """auto.json, and what a checkpoint keeps of it."""
        return {"chosen": self.chosen.name, "preset": self.chosen.preset,
                "changes": dict(self.chosen.changes), "placement": self.chosen.placement,
                "state": dict(self.chosen.state),
                "steps_timed": self.steps, "seconds": round(self.seconds, 3),
                "budget": None if self.budget is None else {
                    "device": self.budget.device, "host": self.budget.host,
                    "device_words": self.budget.device_words,
                    "host_words": self.budget.host_words},
                "candidates": [{"candidate": r.candidate.name, "placement": r.candidate.placement,
                                "state": dict(r.candidate.state),
                                "device_bytes": r.memory.device, "host_bytes": r.memory.host,
                                "fits": r.fits, "median_step_s": r.seconds} for r in self.rows]}


def presets(scan_tags: dict, fixed: dict, states=((),)) -> list[Candidate]:
    """Every preset of the family (and no checkpointing, unless tags are fixed or weights are
    on host: parameters=host needs a policy), the run's `fixed` tag changes over each, with
    each of `states`; placements that come out the same counted once."""
    found = []
    for state in states:
        seen = []
        weights_on_host = ("parameters", "host") in state
        names = [*activations.presets_for(scan_tags),
                 *([] if fixed or weights_on_host else [activations.NO_CHECKPOINT])]
        for name in names:
            try:
                placement = (None if name == activations.NO_CHECKPOINT
                             else activations.resolve(name, fixed, scan_tags))
            except ValueError:  # a preset naming tags this family does not have
                continue
            if placement not in seen:
                seen.append(placement)
                found.append(Candidate(name, tuple(fixed.items()), placement, state))
    return found


def _is_fixed(scan: str, tag: str, fixed: dict) -> bool:
    return tag in fixed or f"{scan}.{tag}" in fixed


def neighbours(best: Candidate, program: Program, memory: CompiledMemory, budget: Budget,
               fixed: dict) -> list[Candidate]:
    """Up to NEIGHBOURS placements one tag from `best` (its program and compiled memory), each
    a tag it recomputes kept (on device, or offloaded) or one it offloads kept on device: those
    whose bytes fit what the budget leaves, by the FLOPs keeping the tag saves (that placement's
    step traced against `best`'s), then the host bytes it stops moving."""
    devices, jaxpr = len(program.target.devices), program.traced.jaxpr
    sites, moved_sites = tagged_in(jaxpr), offloaded(jaxpr)
    base = step_flops(jaxpr, devices)
    room_device, room_host = budget.device - memory.device, budget.host - memory.host
    scored = []
    for scan, table in best.placement.items():
        for tag in families.of(program.model).SCANS[scan]:
            where = table.get(tag, "device" if tag == activations.LAYER_INPUT else "remat")
            if _is_fixed(scan, tag, fixed) or where == "device":
                continue
            # The tag's bytes per device and step, its global shape's share of this device
            # (only to skip what cannot fit: the compile decides); offloaded, what the step
            # moves (none where the backward pass does not read the tag).
            size = sum(v.nbytes * v.count for v in (moved_sites if where == "offload" else sites
                                                    ).get(tag, []) if v.scan == scan) / devices
            changed = {**best.placement, scan: {**table, tag: "device"}}
            if where == "offload":  # kept on device: no FLOPs saved, its transfers saved
                moves = [("device", 0.0, size)] if 0 < size <= room_device else []
            else:
                kept = Program(program.model, program.run, changed, program.target).traced
                # (program.run has best's state: the FLOPs do not depend on it)
                saved = base - step_flops(kept.jaxpr, devices)
                moves = [(w, saved, 0.0) for w, room in (("device", room_device),
                                                          ("offload", room_host))
                         if saved > 0 and size <= room]
            for to, saved, moved in moves:
                placement = {**best.placement, scan: {**table, tag: to}}
                scored.append(((saved, moved, to == "device"), Candidate(
                    best.preset, (*best.changes, (f"{scan}.{tag}", to)), placement,
                    best.state)))
    scored.sort(key=lambda s: s[0], reverse=True)
    return [candidate for _, candidate in scored[:NEIGHBOURS]]


def compiled(setup, budget: Budget, measure: Callable, say: Callable[[str], None]
             ) -> tuple[list[Row], list[Program]]:
    """Every candidate compiled (`measure(candidate)` -> (CompiledMemory, Program)), a line
    each as it is, and their programs: the presets with each place of the state
    (`state_options`), then the neighbours of the best-ranked fitting one by its traced step
    (the fewest FLOPs recomputed, then the fewest bytes moved over the host link, then the
    least device memory). FitError where none fits, naming the smallest."""
    scan_tags, fixed = families.of(setup.model).SCANS, dict(setup.run.tag_changes)
    said = {w.partition("=")[0] for w in setup.args}
    rows, programs = [], []

    def compile_(candidate: Candidate) -> None:
        memory, program = measure(candidate)
        programs.append(program)
        rows.append(Row(candidate, memory, budget.fits(memory)))
        say(f"preset=auto: compiled {candidate.name}: {size_words(memory.device)} per device, "
            f"{size_words(memory.host)} in host memory: "
            f"{'fits' if rows[-1].fits else 'over the budget, not timed'}")

    for candidate in presets(scan_tags, fixed, state_options(setup.run, said)):
        compile_(candidate)
    if not any(r.fits for r in rows):
        smallest = min(rows, key=lambda r: budget.load(r.memory))
        raise FitError(f"preset=auto: no candidate fits; the smallest, {smallest.candidate.name},"
                       f" needs {size_words(smallest.memory.device)} per device of "
                       f"{budget.device_words} and {size_words(smallest.memory.host)} in host "
                       f"memory of {budget.host_words}")

    def rank(i: int):
        jaxpr = programs[i].traced.jaxpr
        return step_flops(jaxpr, 1), sum(link_bytes(jaxpr, 1)), rows[i].memory.device

    best = min((i for i, r in enumerate(rows) if r.fits), key=rank)
    program, candidate = programs[best], rows[best].candidate
    if candidate.placement is not None:
        for near in neighbours(candidate, program, rows[best].memory, budget, fixed):
            compile_(near)
    return rows, programs


def step_seconds(programs: list[Program], tokens, steps: int) -> list[float]:
    """Each program's median step over `steps` steps after one warm-up, on one state (made
    once, carried from program to program: the placement does not change its shape; moved,
    untimed, where a program keeps a part of it in the other memory) and the run's `tokens`.
    The programs take turns, a step each, so that what else the machine does meanwhile falls
    on all of them alike."""
    state, batch = programs[0].init_state(), programs[0].batch(tokens)
    spent = [[] for _ in programs]
    for _ in range(steps + 1):  # the first round: each program's warm-up, not counted
        for program, times in zip(programs, spent):
            state = jax.block_until_ready(jax.device_put(
                state, jax.tree.map(lambda a: a.sharding, program.state_shapes)))
            started = time.perf_counter()
            state, metrics = program.step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - started)
    return [statistics.median(times[1:]) for times in spent]


def agreed(index: int) -> int:
    """Process 0's pick, in every process (their timings differ a little)."""
    if jax.process_count() == 1:
        return index
    return int(multihost_utils.broadcast_one_to_all(np.int32(index)))


def choose(setup, budget: Budget, measure: Callable, timer: Callable, say: Callable[[str], None]
           ) -> tuple[Choice, Program]:
    """The fastest fitting candidate and its compiled program: compiled (`measure`), the
    fitting ones timed (`timer(programs)` -> median seconds each), the table said."""
    started = time.perf_counter()
    rows, programs = compiled(setup, budget, measure, say)
    fitting = [i for i, r in enumerate(rows) if r.fits]
    times = dict(zip(fitting, timer([programs[i] for i in fitting])))
    rows = [dataclasses.replace(r, seconds=times.get(i)) for i, r in enumerate(rows)]
    chosen = fitting[agreed(min(range(len(fitting)), key=lambda k: times[fitting[k]]))]
    choice = Choice(rows[chosen].candidate, tuple(rows), budget, setup.run.auto_steps,
                    time.perf_counter() - started)
    for line in table(choice, programs[chosen].target.platform):
        say(line)
    return choice, programs[chosen]


def table(choice: Choice, platform: str) -> list[str]:
    b = choice.budget
    lines = [f"preset=auto: {len(choice.rows)} candidates compiled, "
             f"{sum(r.fits for r in choice.rows)} within the budget (per device "
             f"{b.device_words}; host {b.host_words}), each timed over {choice.steps} steps "
             f"after one warm-up; {choice.seconds:.1f} s",
             f"{'candidate':<56}{'device':>10}{'host':>10}  {'fits':<5}{'median step':>12}"]
    for r in choice.rows:
        step = "" if r.seconds is None else f"{r.seconds * 1e3:,.1f} ms"
        mark = "  <- chosen" if r.candidate == choice.chosen else ""
        lines.append(f"{r.candidate.name:<56}{size_words(r.memory.device):>10}"
                     f"{size_words(r.memory.host):>10}  {'yes' if r.fits else 'no':<5}"
                     f"{step:>12}{mark}")
    if platform != "gpu":
        lines.append(f"(the {platform} backend drops host placements: offload runs as device "
                     "here, so the timing ranks recomputation only)")
    return lines
