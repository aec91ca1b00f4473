"""The placement search's fast model: its memory against the static plan and the study's memory
facts, its terms on a hand-computed case, its overrides against the table they name. Its step
times only rank candidates; the replay of compiled programs judges them (tests/test_replay.py,
study/compiling/step_times.py). Every figure comes from the traced full-scale step (abstract
values: nothing compiled or allocated)."""

import collections
import dataclasses
import functools
import itertools
import operator

import pytest

import configs
from study.search import placements as ps
from study.__main__ import main as study_main
from study.hardware.gpus import GPUS, gpu_of
from study.plan import memory_plan
from study.search import candidates, ranking
from study.search.tracer import Tracer
from study.plan import traced_step as traced_step_module
from study.plan.traced_step import Pool, TracedStep, freeze
from runtime import setup as runtime_setup


def predicted(name: str, device: str = "gb200") -> ranking.Prediction:
    """A study row as the search predicts it on 128 GPUs of `device`, counted on its trace."""
    row = configs.get(name)
    tracer = Tracer(row, gpu_of(row.name))
    hw = ps.hardware(GPUS[device], 128)
    return tracer.exact(ps.row_candidate(tracer, row), hw)


def test_deepseek_memory_facts():
    """The study: its selected tensors kept on device fit at micro batch 2, not at 8;
    offloaded, micro batch 8 fits."""
    fits = {n: predicted(n).fits for n in ("deepseek671b-device", "deepseek671b-device-mb8",
                                           "deepseek671b-offload")}
    assert fits == {"deepseek671b-device": True, "deepseek671b-device-mb8": False,
                    "deepseek671b-offload": True}


@pytest.mark.parametrize("name", ["deepseek671b-device-mb8", "deepseek671b-offload",
                                  "llama405b-offload-pipelined"])
def test_predicted_memory_is_the_static_plans(name):
    """The search's per-tag arithmetic gives the study plan's peak for the row whose on-device tags
    cost the most, and for the rows that pipeline their host transfers (one layer's offloaded
    tensors more on the device)."""
    row = configs.get(name)
    tables = runtime_setup.resolve_placement(row.model, row.run)
    planned = memory_plan.full_scale(row, gpu_of(row.name), tables)
    assert (planned.pipelined > 0) == (name != "deepseek671b-device-mb8")
    assert predicted(row.name).device_bytes == planned.peak_estimate


def test_the_layer_weights_on_host_are_the_static_plans_and_cross_the_host_link():
    """parameters=host (the run's: not searched): the search's memory for a row is the static
    plan's, device and host, and its exposed host transfers grow by the weights' traced bytes
    to the device over an H100's host link (an upper bound: the update's cannot hide, the
    layers' fetches might)."""
    row = configs.get("llama405b-offload")
    on_host = dataclasses.replace(row, run=dataclasses.replace(row.run, parameters="host"))
    tracer, hw = Tracer(on_host, gpu_of(row.name)), ps.hardware(GPUS["h100"], 128)
    found = tracer.exact(ps.row_candidate(tracer, on_host), hw)
    planned = memory_plan.full_scale(on_host, gpu_of(row.name),
                                     runtime_setup.resolve_placement(row.model, row.run))
    assert planned.host_params > 0
    assert (found.device_bytes, found.host_bytes) == (planned.peak_estimate, planned.host_peak)
    plain = predicted(row.name, "h100")
    assert found.terms.host_s - plain.terms.host_s == pytest.approx(
        planned.link_params[0] / hw.host_link, rel=1e-9)
    assert found.terms.compute_s == pytest.approx(plain.terms.compute_s, rel=1e-9)


def test_an_all_to_all_crosses_the_nics_only_for_what_leaves_its_nvlink_domain():
    """Seconds per byte, by hand: 4 GPUs of a domain of 8 send 3/4 of the bytes over NVLink;
    16 GPUs in two domains send 7/16 over NVLink while 8/16 cross the NICs at once."""
    hw = ranking.Hardware("x", 1.0, nvlink=100.0, host_link=1.0, devices=16, capacity=0,
                          host_capacity=0, network=10.0, domain=8)
    assert hw.all_to_all_s(1) == 0
    assert hw.all_to_all_s(4) == pytest.approx(3 / 4 / 100)
    assert hw.all_to_all_s(16) == pytest.approx(max(7 / 16 / 100, 8 / 16 / 10))


def test_an_all_to_all_costs_the_group_that_straddles_a_domain_boundary():
    """Guards the class (with tests/test_replay.py's straddling groups): a group judged inside
    an NVLink domain because it is narrower than one. 144 GB200s in two domains of 72, groups
    of 16: 64-79 has 8 GPUs on each side, so 7/16 of the bytes over NVLink while 8/16 cross
    the NICs; groups of 8 tile the domains. 24 GPUs in domains of 8, groups of 6: 6-11 has 2
    and 4 (m = 6 // 2 = 3, as the replay takes it): 2/6 over NVLink, 3/6 over the NICs."""
    def hardware(devices: int, domain: int) -> ranking.Hardware:
        return ranking.Hardware("x", 1.0, nvlink=100.0, host_link=1.0, devices=devices,
                                capacity=0, host_capacity=0, network=10.0, domain=domain)

    assert hardware(144, 72).all_to_all_s(16) == pytest.approx(max(7 / 16 / 100, 8 / 16 / 10))
    assert hardware(144, 72).all_to_all_s(8) == pytest.approx(7 / 8 / 100)
    assert hardware(24, 8).all_to_all_s(6) == pytest.approx(max(2 / 6 / 100, 3 / 6 / 10))


# (GPU, data, fsdp, expert) -> the degrees searched by default, by hand: every power of two
# from 2 up to the NVLink domain the devices fill (study/hardware/gpus.py: domain_size) that divides
# the 256 experts and a data replica's devices, and the row's own.
DEGREES = [(("gb200", 1, 8, 8), [2, 4, 8, 16, 32, 64]),  # 64 GB200s: one domain of 64
           (("gb200", 2, 4, 4), [2, 4, 8, 16]),  # 32 GB200s, 2 replicas of 16
           (("gb200", 1, 18, 8), [2, 4, 8, 16]),  # 144 GB200s: domains of 72
           (("h200", 1, 4, 2), [2, 4, 8]),  # one 8-GPU host: one domain of 8
           (("h200", 1, 4, 4), [2, 4, 8])]  # 16 H200s: two domains of 8


@pytest.mark.parametrize("mesh, degrees", DEGREES,
                         ids=[f"{d * f * e} {g} data {d}" for (g, d, f, e), _ in DEGREES])
def test_the_searched_expert_degrees_at_other_cluster_sizes(mesh, degrees):
    """Guards the class: the degrees' bounds (the domain, the replica, the powers of two)
    off by one power of two, which the study's 128 GB200s (domains of 64) cannot show."""
    device, data, fsdp, expert = mesh
    row = configs.get("deepseek671b-offload")
    row = dataclasses.replace(row, run=dataclasses.replace(
        row.run, mesh=configs.MeshConfig(data, fsdp, expert)))
    assert ps.experts_of(row, GPUS[device], "") == degrees


def test_the_search_tries_expert_parallel_degrees_and_its_overrides_rebuild_the_mesh():
    """A MoE model's degrees: every power of two from 2 to one NVLink domain that divides the
    experts and the devices (and only those asked for when given); a dense model has none.
    A candidate at another degree runs as that mesh, with its tables."""
    row = configs.get("deepseek671b-offload")
    # 128 GB200s: domains of 64
    assert ps.experts_of(row, GPUS["gb200"], "") == [2, 4, 8, 16, 32, 64]
    assert ps.experts_of(row, GPUS["gb200"], "16,4") == [4, 16]
    for bad in ("3", "0", "512", "two"):
        with pytest.raises(configs.ConfigError):
            ps.experts_of(row, GPUS["gb200"], bad)
    assert ps.experts_of(configs.get("llama405b-offload"), GPUS["gb200"], "") == [1]
    with pytest.raises(configs.ConfigError):
        ps.experts_of(configs.get("llama405b-offload"), GPUS["gb200"], "2")
    tables = {"dense_layers": {"mlpwi_0": "offload"}, "moe_layers": {"moe_mlpwi_0": "device"}}
    candidate = ranking.make_candidate(4, tables, ranking.Schedule(True), mesh=(1, 32, 4))
    setup = runtime_setup.resolve(row.name, ranking.overrides(candidate, list(tables)),
                                  full=True)
    assert setup.run.mesh.shape(128) == (1, 32, 4) and setup.run.per_device_batch == 4
    assert setup.placement == tables


def test_search_finds_at_least_the_study_and_its_overrides_rebuild_the_table():
    row = configs.get("llama405b-offload")
    result = ps.run_search(row, gpu_of(row.name), {**ps.OPTIONS, "batches": "2", "exact": "1",
                                                   "workers": "0"},
                           lambda: 0.0)
    best = result.ranked[0]
    assert best.fits and best.exact
    assert best.tflops >= max(p.tflops for p in result.rows  # rows searched alike: mb 2
                              if p.fits and p.candidate.batch == 2)
    # The leader's recompute summed per tag equals its own trace's count.
    estimate = ranking.predict(best.candidate, Tracer(row, gpu_of(row.name)).workload(2),
                               result.hw)
    assert estimate.step_s == pytest.approx(best.step_s, rel=1e-9)
    setup = runtime_setup.resolve(row.name, ps.run_overrides(best, row.model), full=True)
    assert setup.placement == {"layers": best.candidate.table("layers")}


def test_one_trace_counts_the_saving_of_a_tag_in_each_scan_as_its_own_trace_would():
    """The search keeps one tag of every scan in one trace: each scan's backward recomputes only
    its own layers, so each tag saves what it saves traced alone."""
    row = configs.get("deepseek671b-offload")
    tracer = Tracer(row, gpu_of(row.name))
    kept = {"dense_layers": "mlpwi_0", "moe_layers": "moe_mlpwi_0"}
    together = tracer.saved(kept)
    assert all(flops > 0 for flops, _ in together.values())
    for scan, tag in kept.items():
        assert together[scan, tag] == tracer.saved({scan: tag})[scan, tag]


@pytest.mark.parametrize("name", ["llama405b-offload", "deepseek671b-offload"])
def test_the_work_scaled_from_the_rows_micro_batch_is_that_traced_at_another(name):
    """The search traces the gradient's work (every tag kept, every tag recomputed) at the
    experiment's micro batch and expert-parallel degree and scales it by the tokens to the
    others: at full scale it is what a trace at micro batch 1 counts, the all-to-alls' bytes
    too, and for DeepSeek at expert-parallel degree 2 (the row's is 8): the workload, memory
    included, is the one traced there but for the tags' savings (traced at the row's alone)."""
    row = configs.get(name)
    tracer = Tracer(row, gpu_of(row.name))
    expert = 2 if tracer.moe else 1
    assert row.run.per_device_batch > 1 and row.run.mesh.expert in (1, 8)
    (scaled, scaled_remat), (traced, traced_remat) = (
        tracer.base_work(1, expert, traced) for traced in (False, True))
    assert scaled.positions == traced.positions
    for got, want in ((scaled.flops, traced.flops), (scaled.exchanged, traced.exchanged),
                      (scaled_remat, traced_remat)):
        assert got.keys() == want.keys()
        assert all(got[k] == pytest.approx(want[k], rel=1e-12) for k in want), (got, want)
    assert traced.exchanged or name.startswith("llama")
    if tracer.moe:
        tracer.savings = collections.defaultdict(lambda: (0.0, 0.0))  # none, both ways
        got, want = (_leaves(tracer.workload(1, expert, savings)) for savings in (True, False))
        assert [x for x in got if isinstance(x, str)] == [x for x in want if isinstance(x, str)]
        assert [x for x in got if not isinstance(x, str)] == pytest.approx(
            [x for x in want if not isinstance(x, str)], rel=1e-12)
        assert tracer.workload(1, expert).mesh == tracer.mesh(expert)


def _leaves(value) -> list:
    """A dataclass's (or tuple's) fields, nested ones flattened: numbers and names."""
    if dataclasses.is_dataclass(value) or isinstance(value, tuple):
        items = dataclasses.astuple(value) if dataclasses.is_dataclass(value) else value
        return [leaf for item in items for leaf in _leaves(item)]
    return [value]


def test_views_traced_in_a_worker_process_are_those_traced_here(monkeypatch):
    """A Pool's worker (a spawned process, its own trace cache) traces what this one does."""
    monkeypatch.setattr(traced_step_module, "_STEPS", {})  # nothing traced yet
    row = configs.get("llama405b-offload")
    tracer = Tracer(row, gpu_of(row.name))
    views = tracer.exact_views(ps.row_candidate(tracer, row))[1:4]
    assert [name for _, name, _ in views] == ["sites", "residuals", "work"]
    with Pool(1) as pool:
        pool.executor.submit(int).result()  # started: it takes the first views
        assert pool.trace(views) >= 1
    for step, name, placements in views:
        alone = TracedStep(step.model, step.run, step.mesh_shape)  # no cache shared
        value = getattr(alone, name)
        assert step._traced[name, *map(freeze, placements)] == (
            value(*placements) if placements else value), name


def test_a_late_tag_waits_for_the_link_unless_pipelined():
    tag = ranking.Tag("late", nbytes=10, position=0.9, saved_flops=0, saved_exchange=0)
    scan = ranking.Scan("s", 1, (ranking.Tag("in", 1, 0, 0, 0), tag), forward_flops=10,
                        backward_flops=20, remat_flops=0, exchange=0, remat_exchange=0,
                        weight_bytes=0)
    hw = ranking.Hardware("x", rate=1.0, nvlink=1.0, host_link=1.0, devices=2, capacity=100,
                          host_capacity=100)
    table = {"late": "offload"}
    plain = ranking.scan_terms(scan, table, ranking.Schedule(True), hw, (0, 0))
    piped = ranking.scan_terms(scan, table, ranking.Schedule(True, True), hw, (0, 0))
    off = ranking.scan_terms(scan, table, ranking.Schedule(False), hw, (0, 0))
    # Forward: ready at 9 s of 10, 10 s to copy: 9 s late. Backward: needed 2 s in, 8 s late.
    assert plain.host_s == pytest.approx(9 + 8)
    assert piped.host_s == 0 and piped.prefetch == 10
    assert off.host_s == 20


def test_bad_search_option_is_one_line_and_status_2(capsys):
    assert study_main(["search", "llama405b-offload", "search.top=many"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "search.top" in err[0]
    assert study_main(["search", "llama405b-offload", "search.nope=1"]) == 2


def _case_scan(name: str, layers: int, tags, batch: int) -> ranking.Scan:
    return ranking.Scan(name, layers, tuple(ranking.Tag(t, n * batch, at, f * batch, x * batch)
                                            for t, n, at, f, x in tags),
                        forward_flops=40.0 * batch, backward_flops=80.0 * batch,
                        remat_flops=300.0 * batch, exchange=2.0 * batch,
                        remat_exchange=1.0 * batch, weight_bytes=5, exchange_group=2)


# (tag, bytes, position, recompute FLOPs saved, all-to-all bytes saved) per sequence.
CASE_DENSE = [("decoder_layer_input", 4, 0, 0, 0), ("q", 3, 0.2, 90, 0),
              ("kv", 2, 0.3, 40, 0), ("out", 4, 0.6, 60, 0)]
CASE_MOE = [("decoder_layer_input", 4, 0, 0, 0), ("wi", 6, 0.3, 120, 0.5),
            ("wo", 5, 0.8, 100, 0.4)]
D, H = "device", "offload"
# The search's ranking of the case below, as it ranked it before its candidates were built
# faster (frozen tables, Terms added field by field): best first, (batch, dense table, moe
# table, schedule, step s); every leader keeps the AdamW state on the device.
CASE_LEADERS = [
    (1, {"decoder_layer_input": D, "kv": H, "out": D, "q": D}, {"decoder_layer_input": H,
     "wi": D, "wo": D}, "LHS", 20.305),
    (1, {"decoder_layer_input": D, "kv": D, "out": D, "q": H}, {"decoder_layer_input": H,
     "wi": D, "wo": D}, "LHS+pipelined", 20.465),
    (1, {"decoder_layer_input": D, "kv": D, "out": D, "q": H}, {"decoder_layer_input": H,
     "wi": D, "wo": D}, "LHS", 20.625),
    (1, {"decoder_layer_input": H, "kv": D, "out": D, "q": D}, {"decoder_layer_input": H,
     "wi": D, "wo": D}, "LHS", 20.865),
    (1, {"decoder_layer_input": D, "out": D, "q": D}, {"decoder_layer_input": H, "wi": D,
     "wo": D}, "LHS", 20.865)]


def _known_case(capacity: int = 250) -> tuple[candidates.Ranked, ranking.Hardware]:
    works = {b: ranking.Workload(b, (_case_scan("dense", 2, CASE_DENSE, b),
                                     _case_scan("moe", 6, CASE_MOE, b)), other_flops=20.0 * b,
                                 fixed_bytes=100, model_flops=1e15 * b, state_bytes=60)
             for b in (1, 2)}
    hw = ranking.Hardware("x", rate=100.0, nvlink=20.0, host_link=5.0, devices=4,
                          capacity=capacity, host_capacity=120)
    schedules = [ranking.Schedule(True), ranking.Schedule(True, True)]
    return candidates.search(works, hw, schedules), hw


def test_the_search_ranks_a_known_case_as_it_always_has():
    """Two scans (a dense and an expert one, all-to-alls over 2 devices), micro batches 1 and
    2, both LHS schedules, device memory scarce: the candidates, how many fit, and the five
    leaders in their order with their step times, fixed (a faster search must rank alike)."""
    ranked, hw = _known_case()
    assert (len(ranked), sum(p.fits for p in ranked)) == (2100, 1344)
    leaders = [(p.candidate.batch, p.candidate.table("dense"), p.candidate.table("moe"),
                str(p.candidate.schedule), p.candidate.optimizer_state, p.fits)
               for p in ranked[:5]]
    assert leaders == [(b, dense, moe, sched, "device", True)
                       for b, dense, moe, sched, _ in CASE_LEADERS]
    assert [p.step_s for p in ranked[:5]] == pytest.approx([s for *_, s in CASE_LEADERS],
                                                           rel=1e-12)


def _ranked_as_python_would(predictions: list) -> list:
    """The ranking's rule as one sort of Prediction objects (stable: equals keep their order)."""
    return sorted(predictions, key=lambda p: (not p.fits, -round(p.tflops, 1), p.device_bytes,
                                              p.host_bytes))


def test_the_candidates_ranked_as_arrays_are_those_made_one_by_one_ranked_by_one_sort():
    """The known case's every candidate made one at a time (the fronts' product, as the search
    once built them) and sorted in Python: the same candidates, figures and order as the arrays'
    ranking; after replacing three leaders, the same as re-sorting the list; the same Pareto."""
    ranked, hw = _known_case()
    found = []
    for block in ranked.blocks:
        for combo in itertools.product(*block.fronts):
            terms = functools.reduce(operator.add, (t for _, t in combo))
            placement = tuple(sorted(frozen for frozen, _ in combo))
            found += [ranking.finish(ranking.Candidate(block.work.batch, placement, block.sched,
                                                       "", state), block.work, hw, terms, False)
                      for state in ranking.STATES]
    expected = _ranked_as_python_would(found)
    assert list(ranked) == expected
    by_rank = ranked.order
    assert ranked.device[by_rank].tolist() == [p.device_bytes for p in expected]
    assert ranked.tflops[by_rank].tolist() == [p.tflops for p in expected]
    assert ranked.fits[by_rank].tolist() == [p.fits for p in expected]
    assert ranked.host[by_rank].tolist() == [p.host_bytes for p in expected]

    better = {0: 0.5, 3: 2.0, 700: 40.0}  # step time scaled: a leader falls, others rise
    changed = {i: dataclasses.replace(expected[i], step_s=expected[i].step_s * f,
                                      tflops=expected[i].tflops / f, exact=True)
               for i, f in better.items()}
    ranked.replace(changed)
    assert list(ranked) == _ranked_as_python_would([changed.get(i, p)
                                                    for i, p in enumerate(expected)])

    # Rows after the candidates: one as small as the smallest fitting one and faster (on the
    # front, after it), one as fast as the front's fastest and larger (not on it).
    smallest = min((p for p in ranked if p.fits), key=lambda p: p.device_bytes)
    rows = [dataclasses.replace(smallest, tflops=smallest.tflops * 1.01),
            dataclasses.replace(ranked[0], device_bytes=ranked[0].device_bytes + 1)]
    fits = sorted((p for p in list(ranked) + rows if p.fits),
                  key=lambda p: (p.device_bytes, -p.tflops))
    front = [p for i, p in enumerate(fits) if all(p.tflops > q.tflops for q in fits[:i])]
    assert ranked.pareto(rows) == front and len(front) > 2 and rows[0] in front
    assert rows[1] not in front


def test_no_candidate_fits_no_front():
    ranked, _ = _known_case(capacity=0)
    assert not ranked.fits.any() and ranked.pareto([]) == []
