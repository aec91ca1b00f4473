"""The placement search, as run, and its report.

    python -m study search EXPERIMENT [device=gb200|b200|h200|h100] [key=value ...]
        [search.batches=1,2,4,8] [search.experts=1,2,4,8] [search.top=10] [search.exact=5]
        [search.verify=0] [search.plot=auto|off] [search.workers=auto|N]

Every figure comes from the traced full-scale step (study/search/tracer.py) and
study/hardware/gpus.py, traced in `search.workers` processes beside this one (auto: one per
further CPU). The fast model (study/search/ranking.py) only ranks; `search.verify=N` compiles
the best N and the model's registered rows and ranks those by the replay of their compiled
programs (study/timing/replay.py)."""

import contextlib
import dataclasses
import gc
from pathlib import Path

import configs
from study.plan import printed
from study.plan.traced_step import Pool, workers_available
from study.search import candidates, ranking
from study.search.tracer import Tracer
from configs import LHS, PIPELINED, STUDY_TFLOPS, ConfigError, Experiment
from study.hardware.gpus import GPUS, Gpu
from model import families
from model.config import DeepSeekConfig
from offload import activations
from runtime.own_program import GiB, CompiledMemory
from runtime.setup import resolve_placement
from study.hardware.compile_only import pool_bytes

OPTIONS = {"batches": "", "experts": "", "top": "10", "exact": "5", "verify": "0", "plot": "auto",
           "workers": "auto"}
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
        if not configs.whole(options[key]):
            raise ConfigError(f"search.{key}={options[key]!r}: expected a whole number")
    if options["plot"] not in PLOTS:
        raise ConfigError(f"search.plot={options['plot']!r}: choose one of {', '.join(PLOTS)}")
    if options["workers"] != "auto" and not configs.whole(options["workers"]):
        raise ConfigError(f"search.workers={options['workers']!r}: expected auto or a whole number")
    return rest, options


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


@dataclasses.dataclass
class Result:
    experiment: Experiment
    hw: ranking.Hardware
    batches: list[int]
    ranked: candidates.Ranked  # every candidate searched, best first
    rows: list[ranking.Prediction]  # the study's rows, exact
    seconds: float


def batches_of(experiment: Experiment, text: str) -> list[int]:
    """Per-device micro batches: given, or every divisor of the experiment's own."""
    if not text:
        n = experiment.run.per_device_batch
        return [b for b in range(1, n + 1) if n % b == 0]
    found = sorted({int(b) if configs.whole(b.strip()) else 0 for b in text.split(",")})
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
    found = sorted({int(e) if configs.whole(e.strip()) else 0 for e in text.split(",")})
    if any(e < 1 or model.n_experts % e or per_replica % e for e in found):
        raise ConfigError(f"search.experts={text!r}: each must divide the {model.n_experts} "
                          f"experts and the {per_replica} devices of a data replica")
    return found


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic collector off: tracing makes millions of objects, few in cycles, and each
    full collection would walk every trace kept so far."""
    gc.disable()
    try:
        yield
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
    workers = workers_available() if options["workers"] == "auto" else int(options["workers"])
    with collector_paused(), Pool(workers) as pool:
        pool.trace(tracer.views(batches, degrees, rows))
        works = {(b, e): tracer.workload(b, e) for b in batches for e in degrees}
        ranked = candidates.search(works, hw, [ranking.Schedule(True),
                                               ranking.Schedule(True, True)])
        # Count the leaders' recompute on their own traces until the leaders are all so counted.
        while (todo := [i for i, p in enumerate(ranked[:int(options["exact"])])
                        if p.fits and not p.exact]):
            pool.trace([v for i in todo for v in tracer.exact_views(ranked[i].candidate)])
            ranked.replace({i: tracer.exact(ranked[i].candidate, hw) for i in todo})
        counted = [tracer.exact(c, hw) for c in rows]
    return Result(experiment, hw, batches, ranked, counted, clock() - started)


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
        f"{result.ranked.fits.sum()} fit {hw.capacity / GiB:.1f} GiB "
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
    lines += [_line(p, "pareto", scans) for p in result.ranked.pareto(result.rows)]
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
    ranked = result.ranked
    fits = ranked.fitting()
    figure, axes = plt.subplots(figsize=(8, 5))
    dots = axes.scatter(ranked.device[fits] / GiB, ranked.tflops[fits], s=6,
                        c=ranked.host[fits] / GiB, cmap="viridis", alpha=0.5)
    figure.colorbar(dots, label="host GiB per device")
    front = result.ranked.pareto(result.rows)
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
