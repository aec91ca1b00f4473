"""Placement search: each candidate's device memory and step time, predicted without a GPU.

A candidate is a micro batch, for MoE models a mesh (the expert axis's degree; fsdp takes the
rest), one placement table per layer scan, an XLA schedule (latency hiding scheduler, pipelined
host offloading) and where the optimizer state lives. Its inputs come from the traced program
(per-tag bytes, dot FLOPs, all-to-all bytes; `jaxpr.work`) and the hardware figures; nothing
here traces or reads an experiment (configs gives only the XLA flags' names).

The fast time model (`predict`; docs/search.md) ranks many candidates; the replay of compiled
programs (study/timing/replay.py) judges the few compiled. Per layer: dot FLOPs (plus the table's
recompute) at the GPU's bf16 rate; offloaded bytes to host and back; FSDP collectives and
expert all-to-alls over NVLink (the NICs for what leaves an NVLink domain). Without the latency
hiding scheduler all of it is exposed; with it, FSDP collectives hide behind the layer's
compute and host copies behind the compute around their tags (`_host_stall`). Expert
all-to-alls feed the GEMMs after them: always exposed."""

import dataclasses
import functools
import itertools
from typing import NamedTuple

import numpy as np

from configs import ASYNC_LIMIT, LHS, PIPELINED

PLACES = ("device", "offload", "remat")
STATES = ("device", "host")  # where the optimizer state lives between steps
EXHAUSTIVE = 20_000  # per micro batch and schedule: search every table up to this many


@dataclasses.dataclass(frozen=True)
class Tag:
    """A tag whose placement changes something, per device and per layer."""
    name: str
    nbytes: int
    position: float  # share of the layer's forward dot FLOPs computed before it
    saved_flops: float  # recompute FLOPs saved by keeping it (traced with only it kept)
    saved_exchange: float  # recomputed all-to-all bytes saved by keeping it


@dataclasses.dataclass(frozen=True)
class Scan:
    """One layer scan at one micro batch, per device and per layer."""
    name: str
    layers: int
    tags: tuple[Tag, ...]  # the layer input first: it can be kept or offloaded, not recomputed
    forward_flops: float  # no checkpointing
    backward_flops: float
    remat_flops: float  # recomputed when nothing but the layer input is kept
    exchange: float  # all-to-all bytes sent per pass, no checkpointing
    remat_exchange: float  # all-to-all bytes the recompute repeats, nothing kept
    weight_bytes: int  # the layer's weights as gathered; its gradients as reduce-scattered
    exchange_group: int = 1  # the devices of one all-to-all (the expert axis)


@dataclasses.dataclass(frozen=True)
class Workload:
    batch: int
    scans: tuple[Scan, ...]
    other_flops: float  # dots outside the layer scans (LM head, loss), both passes
    fixed_bytes: int  # weights, gradients, what outlives the layers, one layer's backward
    model_flops: float  # MaxText's count, for TFLOP/s/device
    state_bytes: int = 0  # the AdamW moments: on the device or in host memory, as chosen
    mesh: tuple[int, int, int] | None = None  # (data, fsdp, expert) when the mesh is searched
    # The run's parameters=host (not searched: every candidate has the run's): the layer scans'
    # weights in host memory (out of `fixed_bytes`, as their gradients), and their bytes over
    # the host link per step, (host -> device, device -> host), traced (the static plan's).
    host_weights: int = 0
    weights_link: tuple[int, int] = (0, 0)


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    rate: float  # dot FLOP/s
    nvlink: float  # bytes/s each way
    host_link: float  # bytes/s each way
    devices: int  # in the FSDP collectives
    capacity: int  # device memory JAX takes
    host_capacity: int  # host memory per GPU
    network: float = 0.0  # bytes/s each way per GPU between NVLink domains
    domain: int = 0  # GPUs per NVLink domain (study/hardware/gpus.py: Gpu.domain_size); 0: all

    @functools.cache  # asked once per scan of every candidate
    def all_to_all_s(self, group: int) -> float:
        """Seconds per byte of an all-to-all over groups of `group` consecutive devices, the
        slowest group's: NVLink within one domain, the NICs at once for the rest (as
        study/timing/replay.py costs it). A group narrower than a domain may still straddle two."""
        if group <= 1:
            return 0.0
        devices = max(group, self.devices)
        domain = self.domain or devices  # 0: all in one
        spans = {(first + group - 1) // domain - first // domain + 1
                 for first in range(0, devices, group)}  # the domains each group touches
        if max(spans) > 1 and not self.network:
            return float("inf")  # a group that leaves its domain, with no NIC figure
        return max(max((group // d - 1) / group / self.nvlink,
                       (group - group // d) / group / self.network if d > 1 else 0.0)
                   for d in spans)


@dataclasses.dataclass(frozen=True)
class Schedule:
    lhs: bool
    pipelined: bool = False

    def __str__(self) -> str:
        return "LHS+pipelined" if self.pipelined else ("LHS" if self.lhs else "no LHS")


@dataclasses.dataclass(frozen=True)
class Candidate:
    batch: int
    placement: tuple  # ((scan, ((tag, place), ...)), ...): hashable; absent tags are remat
    schedule: Schedule
    row: str = ""  # the study row it is, if any
    optimizer_state: str = "device"  # or "host" (offload/optimizer_state.py)
    mesh: tuple[int, int, int] | None = None  # (data, fsdp, expert), when searched

    def table(self, scan: str) -> dict:
        return dict(dict(self.placement).get(scan, ()))


def frozen_table(table: dict) -> tuple:
    """One scan's table as a candidate holds it: sorted, its recomputed tags left out."""
    return tuple(sorted((t, p) for t, p in table.items() if p != "remat"))


def make_candidate(batch: int, placement: dict, schedule: Schedule, row: str = "",
                   optimizer_state: str = "device", mesh=None) -> Candidate:
    frozen = tuple((s, frozen_table(table)) for s, table in sorted(placement.items()))
    return Candidate(batch, frozen, schedule, row, optimizer_state, mesh)


@dataclasses.dataclass(frozen=True)
class Terms:
    """A candidate's (or one scan's) share of memory and time; sums over scans."""
    device: float = 0.0
    host: float = 0.0
    prefetch: float = 0.0  # one layer's offloaded bytes (pipelining fetches them a layer early)
    compute_s: float = 0.0
    recompute_s: float = 0.0
    host_s: float = 0.0  # exposed host transfers
    link_s: float = 0.0  # exposed NVLink collectives

    def __add__(self, other: "Terms") -> "Terms":
        # Numbers, or arrays of them (study/search/candidates.py adds whole fronts at once).
        return Terms(self.device + other.device, self.host + other.host,
                     np.maximum(self.prefetch, other.prefetch), self.compute_s + other.compute_s,
                     self.recompute_s + other.recompute_s, self.host_s + other.host_s,
                     self.link_s + other.link_s)


@dataclasses.dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    terms: Terms
    device_bytes: float
    host_bytes: float
    step_s: float
    tflops: float  # MaxText's model FLOPs / step / device, in TFLOP/s
    fits: bool
    exact: bool  # recompute counted from this table's own trace (else summed per tag)


def _host_stall(copies: list, pass_s: float, forward: bool, pipelined: bool) -> float:
    """Seconds one layer's pass waits for its host copies, (tag position, seconds) each, one
    at a time on the link."""
    if pipelined or not copies:  # pipelined: each copy has the whole neighbouring layer
        return max(0.0, sum(n for _, n in copies) - pass_s)
    if forward:  # each copy starts once its tag exists and must land by the layer's end
        link = 0.0
        for position, n in sorted(copies):
            link = max(link, position * pass_s) + n
        return max(0.0, link - pass_s)
    link = stall = 0.0  # all start with the layer's backward, needed as it reaches each tag
    for position, n in sorted(copies, reverse=True):
        link += n
        stall = max(stall, link - (1 - position) * pass_s)
    return stall


def place(scan: Scan, placed: dict, tag: Tag) -> str:
    """A tag's placement; a table without the layer input keeps it on the device."""
    return placed.get(tag.name, "device" if tag is scan.tags[0] else "remat")


def scan_terms(scan: Scan, placed: dict, sched: Schedule, hw: Hardware,
               recompute: tuple[float, float]) -> Terms:
    """One scan's memory and time under a placement and the recompute it costs one layer."""
    flops, exchange = recompute
    kept = sum(t.nbytes for t in scan.tags if place(scan, placed, t) == "device")
    moved = [t for t in scan.tags if place(scan, placed, t) == "offload"]
    offloaded = sum(t.nbytes for t in moved)
    forward_s = scan.forward_flops / hw.rate
    backward_s = (scan.backward_flops + flops) / hw.rate
    gather = scan.weight_bytes * (hw.devices - 1) / hw.devices / hw.nvlink  # a ring collective
    exchange_s = (2 * scan.exchange + exchange) * hw.all_to_all_s(scan.exchange_group)
    if sched.lhs:
        copies = [(t.position, t.nbytes / hw.host_link) for t in moved]
        host = (_host_stall(copies, forward_s, True, sched.pipelined)
                + _host_stall(copies, backward_s, False, sched.pipelined))
        link = max(0.0, gather - forward_s) + max(0.0, 2 * gather - backward_s) + exchange_s
    else:
        host, link = 2 * offloaded / hw.host_link, 3 * gather + exchange_s
    n = scan.layers
    return Terms(device=n * kept, host=n * offloaded,
                 prefetch=offloaded if sched.pipelined else 0.0,
                 compute_s=n * (forward_s + backward_s), recompute_s=n * flops / hw.rate,
                 host_s=n * host, link_s=n * link)


def estimated_recompute(scan: Scan, placed: dict) -> tuple[float, float]:
    """Recompute of a table as the all-remat recompute less each kept tag's own saving."""
    kept = [t for t in scan.tags if placed.get(t.name, "remat") != "remat"]
    return (max(0.0, scan.remat_flops - sum(t.saved_flops for t in kept)),
            max(0.0, scan.remat_exchange - sum(t.saved_exchange for t in kept)))


def predict(candidate: Candidate, work: Workload, hw: Hardware, recompute=None) -> Prediction:
    """`recompute`: scan -> (FLOPs, all-to-all bytes) per layer from the table's own trace;
    None sums each kept tag's traced saving instead."""
    terms = Terms()
    for scan in work.scans:
        placed = candidate.table(scan.name)
        own = recompute[scan.name] if recompute else estimated_recompute(scan, placed)
        terms = terms + scan_terms(scan, placed, candidate.schedule, hw, own)
    return finish(candidate, work, hw, terms, recompute is not None)


class Figures(NamedTuple):
    """A candidate's (or, as arrays, many candidates') figures from its summed terms."""
    terms: Terms  # host_s with the optimizer state's transfers, if on host
    device: float  # bytes
    host: float
    step_s: float
    tflops: float  # MaxText's model FLOPs / step / device, in TFLOP/s
    fits: bool


def finish(candidate: Candidate, work: Workload, hw: Hardware, terms: Terms,
           exact: bool) -> Prediction:
    return Prediction(candidate, *figures(terms, work, hw, candidate.optimizer_state == "host"),
                      exact)


def figures(terms: Terms, work: Workload, hw: Hardware, state_on_host: bool) -> Figures:
    """A candidate's figures from its summed `terms`: numbers, or arrays of them (one candidate
    each), by the same arithmetic."""
    device = work.fixed_bytes + terms.device + terms.prefetch
    host = terms.host
    moments = work.state_bytes if state_on_host else 0
    if not state_on_host:
        device = device + work.state_bytes
    if held := work.host_weights + moments:  # the state in host memory between steps
        # The static plan's host peak: the state (updated in place), the weights' gradients
        # and the activations. After the
        # backward pass each layer's moments come from host and go back, both directions at
        # once, with little compute to hide behind; so the weights' moves (an upper bound:
        # under LHS the layers' own fetches may hide behind their compute).
        host = held + work.host_weights + terms.host
        to_device, to_host = work.weights_link
        link_s = max(to_device + moments, to_host + moments) / hw.host_link
        terms = dataclasses.replace(terms, host_s=terms.host_s + link_s)
    step = terms.compute_s + work.other_flops / hw.rate + terms.host_s + terms.link_s
    fits = (device <= hw.capacity) & (host <= hw.host_capacity)
    return Figures(terms, device, host, step, work.model_flops / step / 1e12, fits)


def scan_tables(scan: Scan, exhaustive: bool) -> list[dict]:
    """Placements of one scan: every one, or (`exhaustive` False) the tags ordered by
    recompute FLOPs saved per byte kept, the first j on the device and the next k offloaded:
    where bytes are scarce, the tags that buy the most recompute per byte go first."""
    first, rest = scan.tags[0], scan.tags[1:]
    if exhaustive:
        options = [dict(zip([t.name for t in rest], c))
                  for c in itertools.product(PLACES, repeat=len(rest))]
    else:
        order = sorted(rest, key=lambda t: t.saved_flops / max(t.nbytes, 1), reverse=True)
        options = [{t.name: "device" for t in order[:j]}
                  | {t.name: "offload" for t in order[j:j + k]}
                  for j in range(len(order) + 1) for k in range(len(order) - j + 1)]
    return [{first.name: p, **t} for p in ("device", "offload") for t in options]


def front(options: list) -> list:
    """The (table, Terms) pairs no other beats or equals in every additive term, ties kept once."""
    keys = np.array([(a.device, a.host, a.prefetch, a.compute_s + a.host_s + a.link_s)
                     for _, a in options])
    keys, first = np.unique(keys, axis=0, return_index=True)
    kept = []
    for start in range(0, len(keys), 256):  # in chunks: n x n comparisons at once is n^2 bytes
        chunk = keys[start:start + 256, None, :]
        beaten = ((keys[None] <= chunk).all(-1) & (keys[None] < chunk).any(-1)).any(-1)
        kept += [options[first[start + i]] for i in np.flatnonzero(~beaten)]
    return kept


def overrides(candidate: Candidate, scans: list[str]) -> list[str]:
    """The `key=value` overrides that run a candidate: every placement spelled out."""
    out = ["preset=remat", f"per_device_batch={candidate.batch}", "global_batch=0",
           f"optimizer_state={candidate.optimizer_state}"]
    if candidate.mesh is not None:
        out += [f"mesh.{a}={n}" for a, n in zip(("data", "fsdp", "expert"), candidate.mesh)]
    for scan in scans:
        out += [f"placement.{scan}.{t}={p}" for t, p in candidate.table(scan).items()]
    sched = candidate.schedule
    flags = {LHS: str(sched.lhs).lower(), PIPELINED: str(sched.pipelined).lower()}
    if sched.lhs:  # the study's LHS rows: more async copies in flight beside collectives
        flags[ASYNC_LIMIT] = "8"
    return out + [f"xla_flags.{k}={v}" for k, v in flags.items()]
