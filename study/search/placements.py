"""The placement search's inputs, traced from an experiment, and its report.

    python -m study search EXPERIMENT [device=gb200|b200|h200|h100] [key=value ...]
        [search.batches=1,2,4,8] [search.experts=1,2,4,8] [search.top=10] [search.exact=5]
        [search.verify=0] [search.plot=auto|off]

Every figure comes from the traced full-scale step (abstract values over an abstract mesh, as
the plan) and study/hardware/gpus.py. A MoE model's expert-parallel degrees are traced apart,
each with its own memory, collectives and all-to-alls; the recompute each tag saves is traced at
the experiment's own degree and used for every degree (per device it barely depends on it). The
work is traced at the experiment's own micro batch and scaled to the others by their tokens (a
leader's and a row's, counted exactly, on a trace at its own). The
fast model (study/search/ranking.py) only ranks; `search.verify=N` compiles the best N and the
model's registered rows and ranks those by the replay of their compiled programs
(study/timing/replay.py)."""

import dataclasses
import functools
import gc
from pathlib import Path

import configs
from study.plan import memory_plan, printed
from study.programs import jaxpr
from study.search import ranking
from study.plan.traced_step import TracedStep, traced_step
from study.figures import STUDY_TFLOPS
from configs import LHS, PIPELINED, ConfigError, Experiment
from study.hardware.gpus import GPUS, Gpu
from model import families
from model.config import DeepSeekConfig
from offload import activations
from runtime.own_program import GiB, CompiledMemory
from runtime.setup import resolve_placement
from study.hardware.compile_only import pool_bytes

OPTIONS = {"batches": "", "experts": "", "top": "10", "exact": "5", "verify": "0", "plot": "auto"}
PLOTS = ("auto", "off")  # the picture beside the report, or none


def split_options(args: list[str]) -> tuple[list[str], dict]:
    """(run overrides, search options): `search.<key>=` keys are the search's own."""
    options, rest = dict(OPTIONS), []
    for arg in args:
        key, _, value = arg.partition("=")
        if not key.startswith("search."):
            rest.append(arg)
        elif key[7:] not in OPTIONS:
            raise ConfigError(f"unknown key {key!r}; the search has "
                              f"{', '.join('search.' + k for k in OPTIONS)}")
        else:
            options[key[7:]] = value
    for key in ("top", "exact", "verify"):
        if not options[key].isdigit():
            raise ConfigError(f"search.{key}={options[key]!r}: expected a whole number")
    if options["plot"] not in PLOTS:
        raise ConfigError(f"search.plot={options['plot']!r}: choose one of {', '.join(PLOTS)}")
    return rest, options


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

    def saved(self, kept: dict[str, str]) -> dict[tuple[str, str], tuple[float, float]]:
        """(scan, tag) -> recompute FLOPs and all-to-all bytes per layer that keeping the tag
        (`kept`: scan -> tag) alone saves, at the experiment's micro batch, per sequence (both
        scale with the tokens). A scan's backward recomputes only its own layers, so one trace
        counts one tag of every scan."""
        batch = self.run.per_device_batch
        remat = self.recompute(batch, self.remat)
        alone = self.recompute(batch, {**self.remat, **{s: {t: "device"} for s, t in kept.items()}})
        return {(s, t): tuple((r - a) / batch for r, a in zip(remat[s], alone[s]))
                for s, t in kept.items()}

    @functools.cached_property
    def savings(self) -> dict[tuple[str, str], tuple[float, float]]:
        """`saved` for every tag but the layer inputs: as many traces as the scan with the most
        tags has."""
        tags = {s: [t for t in tags if t != activations.LAYER_INPUT]
                for s, tags in families.of(self.model).SCANS.items()}
        found = {}
        for i in range(max(map(len, tags.values()))):
            found |= self.saved({s: names[i] for s, names in tags.items() if i < len(names)})
        return found

    def base_work(self, batch: int, expert: int, traced: bool) -> tuple[jaxpr.Work, dict]:
        """The gradient's work with every tag kept, and each scan's recompute with every tag
        recomputed, at `batch`: traced there, or (not `traced`) the experiment's own micro
        batch's scaled by the tokens, as the savings are: one trace per expert-parallel degree
        serves every micro batch."""
        at = batch if traced else self.run.per_device_batch
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
        step = self.step(batch, expert)
        none, remat = self.base_work(batch, expert, traced=not savings)

        def tag(s: str, v) -> ranking.Tag:
            if v.tag == activations.LAYER_INPUT:
                return ranking.Tag(v.tag, v.nbytes, 0, 0, 0)
            saved = self.savings[s, v.tag] if savings else (0, 0)
            return ranking.Tag(v.tag, v.nbytes, none.positions.get((s, v.tag), 0.0),
                               *(batch * x for x in saved))

        needed = self.needed(expert)
        scans = []
        for s in self.scans:
            n = step.layers[s]
            sites = sorted((v for v in step.sites if v.scan == s and (s, v.tag) in needed),
                           key=lambda v: v.tag != activations.LAYER_INPUT)
            forward, backward = (none.flops.get((s, p), 0.0) / n for p in ("forward", "backward"))
            scans.append(ranking.Scan(s, n, tuple(tag(s, v) for v in sites), forward, backward,
                                      remat[s][0], none.exchanged.get((s, "forward"), 0.0) / n,
                                      remat[s][1], step.gathered_layer_bytes(s), expert))
        fixed, state = self.remat_plan(batch, expert)
        # The layer inputs (each scan's first tag) are the candidate's to place.
        fixed -= sum(scan.layers * scan.tags[0].nbytes for scan in scans)
        other = sum(v for (s, _), v in none.flops.items() if s not in self.scans)
        flops = families.of(self.model).training_flops(self.model, batch, self.run.seq)
        return ranking.Workload(batch, tuple(scans), other, fixed, flops, state,
                                self.mesh(expert) if self.moe else None)

    def needed(self, expert: int) -> set[tuple[str, str]]:
        """(scan, tag) the backward pass reads: the program's structure, not its sizes, so one
        gradient traced per expert-parallel degree (at the experiment's micro batch) serves
        every micro batch."""
        return self.step(self.run.per_device_batch, expert).needed

    def remat_plan(self, batch: int, expert: int) -> tuple[int, int]:
        """Peak device bytes with every tag recomputed, without the optimizer state, and the
        optimizer state's bytes: the static plan's arithmetic."""
        step = self.step(batch, expert)
        lines = [memory_plan.TagLine(v, "remat", True, False) for v in step.sites]
        gpu = self.gpu
        planned = memory_plan.plan(step, self.remat, lines, pool_bytes(gpu), gpu.host_memory)
        return planned.peak_estimate - planned.device_optimizer, planned.optimizer


def row_candidate(tracer: Tracer, row: Experiment) -> ranking.Candidate:
    placement = resolve_placement(row.model, row.run)
    flags = row.run.xla_flags
    schedule = ranking.Schedule(flags.get(LHS) == "true", flags.get(PIPELINED) == "true")
    mesh = tracer.mesh(row.run.mesh.expert) if tracer.moe else None
    return ranking.make_candidate(row.run.per_device_batch, placement, schedule, row.name,
                                  row.run.optimizer_state, mesh)


def hardware(gpu: Gpu, devices: int) -> ranking.Hardware:
    rate = gpu.peaks["bf16"] * gpu.efficiency.get("bf16", 1.0)
    return ranking.Hardware(gpu.name, rate, gpu.nvlink, gpu.host_link, devices, pool_bytes(gpu),
                            gpu.host_memory, gpu.network, gpu.domain_size(devices))


def exact(tracer: Tracer, candidate: ranking.Candidate, hw: ranking.Hardware):
    placement = {s: candidate.table(s) for s in tracer.scans}
    expert = candidate.mesh[2] if candidate.mesh else 0
    return ranking.predict(candidate, tracer.workload(candidate.batch, expert, savings=False),
                           hw, tracer.recompute(candidate.batch, placement, expert))


@dataclasses.dataclass
class Result:
    experiment: Experiment
    hw: ranking.Hardware
    batches: list[int]
    ranked: list[ranking.Prediction]  # every candidate searched, best first
    rows: list[ranking.Prediction]  # the study's rows, exact
    seconds: float


def batches_of(experiment: Experiment, text: str) -> list[int]:
    """Per-device micro batches: given, or every divisor of the experiment's own."""
    if not text:
        n = experiment.run.per_device_batch
        return [b for b in range(1, n + 1) if n % b == 0]
    found = sorted({int(b) if b.strip().isdigit() else 0 for b in text.split(",")})
    if found[0] < 1:
        raise ConfigError(f"search.batches={text!r}: expected whole numbers >= 1, e.g. 1,2,4")
    return found


def experts_of(experiment: Experiment, gpu: Gpu, text: str) -> list[int]:
    """Expert-parallel degrees: given, or for a MoE model its own and every power of two from 2 up
    to one NVLink domain that divides its experts and the devices the data axis leaves. Not 1 unless
    asked: without expert parallelism a GPU computes the experts with `ragged_dot`, which XLA
    expands past any GPU's memory at full scale (docs/search.md), unseen by the fast model."""
    run, model = experiment.run, experiment.model
    per_replica = run.mesh.devices // run.mesh.data
    if not isinstance(model, DeepSeekConfig):
        if text:
            raise ConfigError(f"search.experts={text!r}: {experiment.name} has no routed "
                              "experts to split")
        return [1]
    if not text:
        domain = gpu.domain_size(run.mesh.devices)
        powers = [2**i for i in range(1, per_replica.bit_length())]
        return sorted({run.mesh.expert} | {e for e in powers if e <= domain and not (
            model.n_experts % e or per_replica % e)})
    found = sorted({int(e) if e.strip().isdigit() else 0 for e in text.split(",")})
    if any(e < 1 or model.n_experts % e or per_replica % e for e in found):
        raise ConfigError(f"search.experts={text!r}: each must divide the {model.n_experts} "
                          f"experts and the {per_replica} devices of a data replica")
    return found


def search_without_gc(works: dict, hw: ranking.Hardware) -> list[ranking.Prediction]:
    """`ranking.search` over both LHS schedules, Python's cyclic collector paused: its hundreds
    of thousands of candidates hold no cycles, and every collection would walk them all."""
    gc.disable()
    try:
        return ranking.search(works, hw, [ranking.Schedule(True), ranking.Schedule(True, True)])
    finally:
        gc.enable()


def run_search(experiment: Experiment, gpu: Gpu, options: dict, clock) -> Result:
    """Search `experiment`'s placements on `gpu`s; the top `exact` fitting candidates and
    the study's rows get their recompute counted from their own trace."""
    started = clock()
    run = experiment.run
    tracer = Tracer(experiment, gpu)
    hw = hardware(gpu, run.mesh.devices)
    # The registered rows of this model, sequence and mesh: the study's and any searched one.
    rows = [row_candidate(tracer, e) for e in configs.EXPERIMENTS.values()
            if (e.model, e.run.seq, e.run.mesh) == (experiment.model, run.seq, run.mesh)]
    batches = batches_of(experiment, options["batches"])
    degrees = experts_of(experiment, gpu, options["experts"])
    works = {(b, e): tracer.workload(b, e) for b in batches for e in degrees}
    ranked = search_without_gc(works, hw)
    # Count the leaders' recompute on their own traces until the leaders are all counted so.
    while (todo := [p for p in ranked[:int(options["exact"])] if p.fits and not p.exact]):
        ranked = ranking.rank([exact(tracer, p.candidate, hw) if p in todo else p for p in ranked])
    return Result(experiment, hw, batches, ranked, [exact(tracer, c, hw) for c in rows],
                  clock() - started)


def placement_text(candidate: ranking.Candidate, scans) -> str:
    """Per scan: the tags kept on device (D) and offloaded (H); the rest are recomputed (the
    layer input, kept on device unless offloaded, is named only when offloaded)."""
    parts = []
    for scan in scans:
        table = candidate.table(scan)
        kept = [t for t, p in table.items() if p == "device" and t != activations.LAYER_INPUT]
        moved = [t for t, p in table.items() if p == "offload"]
        parts.append(f"{scan}: D[{' '.join(kept)}] H[{' '.join(moved)}]")
    if candidate.optimizer_state == "host":
        parts.append("AdamW moments on host")
    if candidate.mesh is not None:
        parts.insert(0, f"EP {candidate.mesh[2]} x FSDP {candidate.mesh[1]}")
    return "; ".join(parts)


def _line(p: ranking.Prediction, rank: str, scans) -> str:
    c, t = p.candidate, p.terms
    study = STUDY_TFLOPS.get(c.row)
    return (f"{rank:>5} {c.batch:>3} {str(c.schedule):<14}{p.device_bytes / GiB:>8.1f}"
            f"{p.host_bytes / GiB:>8.1f}{p.step_s:>8.2f}{p.tflops:>9.0f}"
            f"{'' if study is None else f'{study:.0f}':>7}{t.recompute_s:>8.2f}{t.host_s:>7.2f}"
            f"{t.link_s:>7.2f}  {'fits' if p.fits else 'NO':<5}{'' if p.exact else '~':<2}"
            f"{c.row or placement_text(c, scans)}")


def report_lines(result: Result, top: int) -> list[str]:
    hw, e = result.hw, result.experiment
    scans = list(families.of(e.model).SCANS)
    lines = [
        f"placement search: {e.name} on {hw.devices} x {hw.name}, micro batches "
        f"{','.join(map(str, result.batches))}; {len(result.ranked)} candidates, "
        f"{sum(p.fits for p in result.ranked)} fit {hw.capacity / GiB:.1f} GiB "
        f"(JAX's pool) and {hw.host_capacity / GiB:.0f} GiB host; {result.seconds:.1f} s",
        f"fast time model (ranking only; search.verify=N replays the compiled programs): dot "
        f"FLOPs at {hw.rate / 1e12:,.0f} TFLOP/s (the {hw.name}'s bf16 rate, "
        "study/hardware/gpus.py), "
        f"NVLink {hw.nvlink / 1e9:.0f} GB/s, host link {hw.host_link / 1e9:.0f} GB/s each way",
        "GiB per device; TFLOP/s/device by MaxText's formula; seconds per step: recompute, and "
        "exposed host transfers and NVLink collectives; ~: recompute summed per tag (the rest "
        "counted on their own trace)",
        f"{'rank':>5} {'mb':>3} {'schedule':<14}{'device':>8}{'host':>8}{'step s':>8}"
        f"{'TFLOP/s':>9}{'study':>7}{'recomp':>8}{'host s':>7}{'link s':>7}  "
        "fit   placement (D device, H host; the rest recomputed)"]
    lines += [_line(p, str(i + 1), scans) for i, p in enumerate(result.ranked[:top])]
    lines += ["the study's rows (and registered rows of this model), counted on their traces:"]
    lines += [_line(p, "row", scans) for p in result.rows]
    lines += ["Pareto front (least device memory for the throughput):"]
    lines += [_line(p, "pareto", scans) for p in ranking.pareto(result.ranked + result.rows)]
    return lines + best_lines(result, scans)


def best_lines(result: Result, scans) -> list[str]:
    best = result.ranked[0]
    if not best.fits:
        return ["no candidate fits"]
    measured = [p for p in result.rows if p.candidate.row in STUDY_TFLOPS]
    lines = []
    if measured:
        row = max(measured, key=lambda p: STUDY_TFLOPS[p.candidate.row])
        lines.append(f"best: {best.tflops:,.0f} TFLOP/s/device predicted, "
                     f"{best.tflops / row.tflops - 1:+.1%} over the study's best row "
                     f"{row.candidate.row} as predicted ({row.tflops:,.0f}; measured "
                     f"{STUDY_TFLOPS[row.candidate.row]:,.0f} on GB200)")
    lines += printed.host_pool_warning(best.host_bytes, GPUS[result.hw.name])
    return lines + ["run it: python train.py " + " ".join(
        [result.experiment.name, *ranking.overrides(best.candidate, scans)])]


def run_overrides(prediction: ranking.Prediction, model) -> list[str]:
    return ranking.overrides(prediction.candidate, list(families.of(model).SCANS))


@dataclasses.dataclass
class Verified:
    """A candidate or registered row compiled for its GPUs and its step replayed."""
    prediction: ranking.Prediction  # the fast model's
    compiled: CompiledMemory
    replayed: object  # study.timing.predicted_step.StepPrediction
    what: str  # the row's name, or the candidate's overrides


def verified_lines(found: list[Verified], capacity: int) -> list[str]:
    """Ranked by the replay of each compiled program; the fast model's figures beside it."""
    lines = ["verified: compiled for the GPUs and replayed (study/timing/replay.py), best first",
             f"{'replayed':>9}{'fast':>7}{'study':>7}{'device':>8}{'host':>7}  fit   what "
             "(TFLOP/s/device; GiB per device as compiled)"]
    for v in sorted(found, key=lambda v: -v.replayed.tflops):
        study = STUDY_TFLOPS.get(v.what)
        lines.append(f"{v.replayed.tflops:>9,.0f}{v.prediction.tflops:>7,.0f}"
                     f"{'' if study is None else f'{study:,.0f}':>7}"
                     f"{v.compiled.device / GiB:>8.1f}{v.compiled.host / GiB:>7.1f}  "
                     f"{'fits' if v.compiled.device <= capacity else 'NO':<6}{v.what}")
    return lines


def write_plot(result: Result, out_dir: str) -> str:
    """Every fitting candidate, the study's rows and the Pareto front as a PNG beside the runs."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "picture: none (matplotlib is not installed: pip install -e '.[plot]')"
    path = Path(out_dir) / f"search-{result.experiment.name}-{result.hw.name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fits = [p for p in result.ranked if p.fits]
    figure, axes = plt.subplots(figsize=(8, 5))
    dots = axes.scatter([p.device_bytes / GiB for p in fits], [p.tflops for p in fits], s=6,
                        c=[p.host_bytes / GiB for p in fits], cmap="viridis", alpha=0.5)
    figure.colorbar(dots, label="host GiB per device")
    front = ranking.pareto(result.ranked + result.rows)
    axes.plot([p.device_bytes / GiB for p in front], [p.tflops for p in front], "k-",
              label="Pareto front")
    for p in result.rows:
        axes.scatter(p.device_bytes / GiB, p.tflops, marker="x", color="red")
        axes.annotate(p.candidate.row, (p.device_bytes / GiB, p.tflops), fontsize=7)
    axes.axvline(result.hw.capacity / GiB, color="grey", linestyle=":", label="JAX's pool")
    axes.set(xlabel="device GiB (predicted)", ylabel="TFLOP/s/device (predicted)",
             title=f"{result.experiment.name} on {result.hw.devices} x {result.hw.name}")
    axes.legend()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return f"picture: {path}"
