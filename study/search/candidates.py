"""Every candidate of a placement search, ranked. There are too many to make an object each
(docs/search.md): their figures are summed, finished and ranked as arrays (ranking.figures, the
one candidate's arithmetic on arrays), and a Prediction is made only for a candidate read (the
leaders, the Pareto front), from its scans' terms as `ranking.predict` would."""

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence

import numpy as np

from study.search.ranking import (EXHAUSTIVE, STATES, Candidate, Hardware, Prediction, Schedule,
                                  Terms, estimated_recompute, figures, finish, front,
                                  frozen_table, scan_tables, scan_terms)

FIGURES = ("device", "host", "tflops", "fits")  # what ranks a candidate, held per candidate


class Block:
    """One micro batch (and mesh) and schedule: every combination of its scans' fronts (the last
    scan's varying fastest, as itertools.product), each with the optimizer state on the device,
    then on host. `fronts`: per scan, ((scan, frozen table), Terms) pairs."""

    def __init__(self, work, hw: Hardware, sched: Schedule, fronts: list[list[tuple]]):
        self.work, self.hw, self.sched, self.fronts = work, hw, sched, fronts
        self.shape = tuple(map(len, fronts))

    def __len__(self) -> int:
        return math.prod(self.shape) * len(STATES)

    def figures(self) -> dict[str, np.ndarray]:
        """FIGURES of every candidate, in order: each scan's terms as arrays along its own axis,
        added as Terms add (in scan order) and finished as one candidate is."""
        axes = []
        for k, scan_front in enumerate(self.fronts):
            columns = np.array([dataclasses.astuple(terms) for _, terms in scan_front], float).T
            shape = [1] * len(self.fronts)
            shape[k] = -1
            axes.append(Terms(*(c.reshape(shape) for c in columns)))
        summed = functools.reduce(operator.add, axes)
        summed = Terms(*(np.broadcast_to(v, self.shape).ravel()
                         for v in dataclasses.astuple(summed)))
        per_state = [figures(summed, self.work, self.hw, state == "host") for state in STATES]
        return {name: np.stack([getattr(f, name) for f in per_state], axis=1).ravel()
                for name in FIGURES}

    def prediction(self, i: int) -> Prediction:
        combo, state = divmod(i, len(STATES))
        picks = [scan_front[int(j)] for scan_front, j in
                 zip(self.fronts, np.unravel_index(combo, self.shape))]
        placement = tuple(sorted(frozen for frozen, _ in picks))
        terms = functools.reduce(operator.add, (t for _, t in picks))
        return finish(Candidate(self.work.batch, placement, self.sched, "", STATES[state],
                                self.work.mesh), self.work, self.hw, terms, False)


class Ranked(Sequence):
    """Every candidate, best first: fitting first, then by throughput (TFLOP/s/device, to 0.1,
    compares micro batches); among equals the most device memory left (static plans miss NCCL's
    and cuDNN's), then host; then as found (a stable sort)."""

    def __init__(self, blocks: list[Block]):
        self.blocks = blocks
        self.starts = np.cumsum([0] + [len(b) for b in blocks])
        found = [b.figures() for b in blocks]
        self.device, self.host, self.tflops, self.fits = (
            np.concatenate([f[name] for f in found]) for name in FIGURES)
        self.rounded = np.array([round(t, 1) for t in self.tflops.tolist()])  # Python's rounding
        self.replaced: dict[int, Prediction] = {}
        self.order = np.arange(len(self.tflops))
        self._rank()

    def _rank(self):
        o = self.order  # ties keep their present order
        self.order = o[np.lexsort((self.host[o], self.device[o], -self.rounded[o], ~self.fits[o]))]

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, at):
        if isinstance(at, slice):
            return [self._made(int(i)) for i in self.order[at]]
        return self._made(int(self.order[at]))

    def _made(self, i: int) -> Prediction:
        if i in self.replaced:
            return self.replaced[i]
        block = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.blocks[block].prediction(i - int(self.starts[block]))

    def replace(self, better: dict[int, Prediction]):
        """The predictions at ranks `better`'s keys replaced (e.g. counted on their own trace),
        and all ranked again."""
        for rank, p in better.items():
            i = int(self.order[rank])
            self.replaced[i] = p
            self.device[i], self.host[i], self.tflops[i], self.fits[i] = (
                p.device_bytes, p.host_bytes, p.tflops, p.fits)
            self.rounded[i] = round(float(p.tflops), 1)  # Python's, as above
        self._rank()

    def fitting(self) -> np.ndarray:
        """The fitting candidates' indices into the figures, best first."""
        return self.order[self.fits[self.order]]

    def pareto(self, more: list[Prediction]) -> list[Prediction]:
        """The fitting candidates and `more` (after them) that no other beats on both device
        memory and throughput, by device memory (a stable sort: the first of equals)."""
        kept, extra = self.fitting(), [p for p in more if p.fits]
        device = np.concatenate([self.device[kept], [p.device_bytes for p in extra]])
        tflops = np.concatenate([self.tflops[kept], [p.tflops for p in extra]])
        by_device = np.lexsort((-tflops, device))
        best = np.maximum.accumulate(tflops[by_device])
        better = np.ones(len(by_device), bool)  # than every one before it: the first, or none
        better[1:] = tflops[by_device][1:] > best[:-1]
        on_front = by_device[better]
        return [self._made(int(kept[i])) if i < len(kept) else extra[i - len(kept)]
                for i in on_front.tolist()]


def search(works: dict, hw: Hardware, schedules: list[Schedule]) -> Ranked:
    """Every candidate over `works` (per micro batch and mesh) and `schedules`, ranked; recompute
    summed per tag, each scan's dominated placements pruned first (Terms add up over scans)."""
    blocks = []
    for work in works.values():
        exhaustive = max(2 * 3 ** (len(s.tags) - 1) for s in work.scans) <= EXHAUSTIVE
        per_scan = {s.name: scan_tables(s, exhaustive) for s in work.scans}
        for sched in schedules:
            fronts = [[((s.name, frozen_table(t)), a) for t, a in front(
                [(t, scan_terms(s, t, sched, hw, estimated_recompute(s, t)))
                 for t in per_scan[s.name]])] for s in work.scans]
            blocks.append(Block(work, hw, sched, fronts))
    return Ranked(blocks)
