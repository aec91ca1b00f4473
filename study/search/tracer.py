"""The placement search's inputs, traced from an experiment's full-scale step (abstract values
over an abstract mesh, as the plan). The search's work (dot FLOPs, all-to-all bytes, the
recompute each tag saves, what the backward pass reads) is traced once, at the experiment's own
micro batch and expert-parallel degree, and scaled to the other micro batches by their tokens;
per device, the expert-parallel degree moves experts, not work (`work_degree`). Each micro
batch's activations are traced apart, and each degree's mesh (its weights per device and the
collectives and all-to-alls' groups) is its own. A leader and a registered row are counted on
traces at their own micro batch and degree. `views` lists every trace a search reads, for
study/plan/traced_step.py's `Pool` to make at once."""

import dataclasses
import functools

from study.plan import memory_plan
from study.programs import jaxpr
from study.search import ranking
from study.plan.traced_step import TracedStep, View, traced_step
from configs import Experiment
from study.hardware.gpus import Gpu
from model import families
from model.config import DeepSeekConfig
from offload import activations
from study.hardware.compile_only import pool_bytes


class Tracer:
    """An experiment traced per micro batch and expert-parallel degree, and the search's inputs.
    Its steps are traced_step()'s, shared by every row of the same model, sequence and mesh."""

    def __init__(self, experiment: Experiment, gpu: Gpu):
        self.model, self.run, self.gpu = experiment.model, experiment.run, gpu
        self.scans = list(families.of(self.model).SCANS)
        self.remat = {s: {} for s in self.scans}
        self.moe = isinstance(self.model, DeepSeekConfig)

    def mesh(self, expert: int) -> tuple[int, int, int]:
        """The experiment's mesh with `expert` devices on the expert axis, fsdp the rest."""
        mesh = dataclasses.replace(self.run.mesh, fsdp=-1, expert=expert)
        return mesh.shape(self.run.mesh.devices)

    def step(self, batch: int, expert: int = 0) -> TracedStep:
        """The step at `batch` and `expert`, its placement, preset and XLA flags cleared: a
        candidate sets its own, and what is traced does not read them."""
        expert = expert or self.run.mesh.expert
        data, fsdp, _ = self.mesh(expert)
        mesh = dataclasses.replace(self.run.mesh, fsdp=fsdp, expert=expert)
        run = dataclasses.replace(self.run, preset="", tag_changes={}, xla_flags={},
                                  per_device_batch=batch, global_batch=0, mesh=mesh)
        return traced_step(self.model, run, (data, fsdp, expert))

    def recompute(self, batch: int, placement: dict, expert: int = 0) -> dict:
        """scan -> (FLOPs, all-to-all bytes) one layer's backward repeats under `placement`."""
        step = self.step(batch, expert)
        base, own = step.work(None), step.work(placement)
        return {s: tuple((getattr(own, f).get((s, "backward"), 0.0)
                          - getattr(base, f).get((s, "backward"), 0.0)) / step.layers[s]
                         for f in ("flops", "exchanged")) for s in self.scans}

    def keeping(self, kept: dict[str, str]) -> dict:
        """The placement recomputing every tag but `kept`'s (scan -> tag), kept on the device."""
        return {**self.remat, **{s: {t: "device"} for s, t in kept.items()}}

    def saved(self, kept: dict[str, str]) -> dict[tuple[str, str], tuple[float, float]]:
        """(scan, tag) -> recompute FLOPs and all-to-all bytes per layer that keeping the tag
        (`kept`: scan -> tag) alone saves, at the experiment's micro batch, per sequence (both
        scale with the tokens). A scan's backward recomputes only its own layers, so one trace
        counts one tag of every scan."""
        batch = self.run.per_device_batch
        remat = self.recompute(batch, self.remat)
        alone = self.recompute(batch, self.keeping(kept))
        return {(s, t): tuple((r - a) / batch for r, a in zip(remat[s], alone[s]))
                for s, t in kept.items()}

    def saving_traces(self) -> list[dict[str, str]]:
        """`savings`' traces, each keeping the i-th tag of every scan that has one (the layer
        inputs aside): as many as the scan with the most tags has."""
        tags = {s: [t for t in tags if t != activations.LAYER_INPUT]
                for s, tags in families.of(self.model).SCANS.items()}
        return [{s: names[i] for s, names in tags.items() if i < len(names)}
                for i in range(max(map(len, tags.values())))]

    @functools.cached_property
    def savings(self) -> dict[tuple[str, str], tuple[float, float]]:
        """`saved` for every tag but the layer inputs."""
        found = {}
        for kept in self.saving_traces():
            found |= self.saved(kept)
        return found

    def work_degree(self, expert: int) -> int:
        """The expert-parallel degree whose traces count the work and activations at `expert`:
        the experiment's own for any degree above 1. Per device, expert parallelism moves
        experts, not work: a device computes its E/P experts on P blocks of C rows each and
        sends P blocks of E/P x C rows, E x C rows whatever P, and keeps the same bytes
        (tests/test_search.py). Without it (1) the experts' GEMMs are computed otherwise:
        traced apart."""
        own = self.run.mesh.expert
        return own if min(own, expert) > 1 else expert

    def base_work(self, batch: int, expert: int, traced: bool) -> tuple[jaxpr.Work, dict]:
        """The gradient's work with every tag kept, and each scan's recompute with every tag
        recomputed, at `batch` and `expert`: traced there, or (not `traced`) the experiment's
        own micro batch's, at `work_degree`, scaled by the tokens as the savings are."""
        at = batch if traced else self.run.per_device_batch
        if not traced:
            expert = self.work_degree(expert)
        none, remat = self.step(at, expert).work(None), self.recompute(at, self.remat, expert)
        if at == batch:
            return none, remat

        def scaled(count: float) -> float:
            return count * batch / at
        flops, exchanged = ({k: scaled(v) for k, v in counts.items()}
                            for counts in (none.flops, none.exchanged))
        return (jaxpr.Work(flops, exchanged, none.positions),
                {s: tuple(map(scaled, r)) for s, r in remat.items()})

    def workload(self, batch: int, expert: int = 0, savings: bool = True) -> ranking.Workload:
        """The search's inputs at one micro batch and expert-parallel degree; without `savings`
        (a candidate counted on its own trace: its work traced at its own micro batch) each
        tag's saving is zero."""
        expert = expert or self.run.mesh.expert
        degree = self.work_degree(expert) if savings else expert  # the degree traced
        step, at_degree = self.step(batch, expert), self.step(batch, degree)
        none, remat = self.base_work(batch, expert, traced=not savings)

        def tag(s: str, v) -> ranking.Tag:
            if v.tag == activations.LAYER_INPUT:
                return ranking.Tag(v.tag, v.nbytes, 0, 0, 0)
            saved = self.savings[s, v.tag] if savings else (0, 0)
            return ranking.Tag(v.tag, v.nbytes, none.positions.get((s, v.tag), 0.0),
                               *(batch * x for x in saved))

        needed = self.needed(degree)
        scans = []
        for s in self.scans:
            n = step.layers[s]
            sites = sorted((v for v in at_degree.sites if v.scan == s and (s, v.tag) in needed),
                           key=lambda v: v.tag != activations.LAYER_INPUT)
            forward, backward = (none.flops.get((s, p), 0.0) / n for p in ("forward", "backward"))
            scans.append(ranking.Scan(s, n, tuple(tag(s, v) for v in sites), forward, backward,
                                      remat[s][0], none.exchanged.get((s, "forward"), 0.0) / n,
                                      remat[s][1], step.gathered_layer_bytes(s), expert))
        planned = self.remat_plan(batch, expert, degree)
        # The layer inputs (each scan's first tag) are the candidate's to place.
        fixed = (planned.peak_estimate - planned.device_optimizer
                 - sum(scan.layers * scan.tags[0].nbytes for scan in scans))
        other = sum(v for (s, _), v in none.flops.items() if s not in self.scans)
        flops = families.of(self.model).training_flops(self.model, batch, self.run.seq)
        return ranking.Workload(batch, tuple(scans), other, fixed, flops, planned.optimizer,
                                self.mesh(expert) if self.moe else None, planned.host_params,
                                planned.link_params)

    def needed(self, expert: int) -> set[tuple[str, str]]:
        """(scan, tag) the backward pass reads: the program's structure, not its sizes, so one
        gradient traced at the experiment's micro batch serves every micro batch."""
        return self.step(self.run.per_device_batch, expert).needed

    def remat_plan(self, batch: int, expert: int, degree: int) -> memory_plan.MemoryPlan:
        """The static plan with every tag recomputed, its activations traced at the
        expert-parallel degree `degree`: its peak without the optimizer state, the optimizer
        state's bytes, and (parameters=host) the layers' weights in host memory and their
        moves."""
        step, at_degree = self.step(batch, expert), self.step(batch, degree)
        lines = [memory_plan.TagLine(v, "remat", True, False) for v in at_degree.sites]
        gpu = self.gpu
        return memory_plan.plan(step, self.remat, lines, pool_bytes(gpu), gpu.host_memory,
                                activations=at_degree)

    def placement(self, candidate: ranking.Candidate) -> dict:
        return {s: candidate.table(s) for s in self.scans}

    def exact(self, candidate: ranking.Candidate, hw: ranking.Hardware) -> ranking.Prediction:
        """`candidate` counted on traces at its own micro batch and degree (`exact_views`)."""
        expert = _degree(candidate)
        return ranking.predict(candidate, self.workload(candidate.batch, expert, savings=False),
                               hw, self.recompute(candidate.batch, self.placement(candidate),
                                                  expert))

    def views(self, batches: list[int], degrees: list[int],
              rows: list[ranking.Candidate]) -> list[View]:
        """Every trace the workloads at `batches` x `degrees` and the `rows` counted exactly
        read; the savings' last (the same step's: traced one after another, they share JAX's
        caches of its shapes)."""
        own = self.run.per_device_batch
        found = [v for row in rows for v in self.exact_views(row)]
        for expert in sorted({self.work_degree(e) for e in degrees}):
            found += [(self.step(own, expert), "needed", ()),
                      *self._work_views(own, expert, [None, self.remat])]
        found += [v for e in degrees for batch in batches
                  for v in self._plan_views(batch, self.work_degree(e))]
        return found + self._work_views(own, 0, [None, self.remat, *map(self.keeping,
                                                                       self.saving_traces())])

    def exact_views(self, candidate: ranking.Candidate) -> list[View]:
        """The traces `candidate`, counted on its own trace, reads."""
        expert = _degree(candidate)
        return [(self.step(self.run.per_device_batch, expert), "needed", ()),
                *self._plan_views(candidate.batch, expert),
                *self._work_views(candidate.batch, expert,
                                  [None, self.remat, self.placement(candidate)])]

    def _work_views(self, batch: int, expert: int, placements: list) -> list[View]:
        return [(self.step(batch, expert), "work", (p,)) for p in placements]

    def _plan_views(self, batch: int, expert: int) -> list[View]:
        return [(self.step(batch, expert), "sites", ()),
                (self.step(batch, expert), "residuals", (self.remat,))]


def _degree(candidate: ranking.Candidate) -> int:
    """A candidate's expert-parallel degree; 0 (the experiment's own) if not searched."""
    return candidate.mesh[2] if candidate.mesh else 0
