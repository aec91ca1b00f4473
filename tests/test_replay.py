"""The step-time replay (study/timing/replay.py) on small hand-written scheduled HLO modules whose
timelines follow by hand from the GPU's figures, and on a compiled program against the dot
FLOPs of its trace."""

import dataclasses
import json

import pytest

from study.programs import hlo
from study.timing import predicted_step, replay
from study.hardware.gpus import GPUS

N = 1 << 20  # elements of the f32 vectors below: 4 MiB each
MiB = 2**20
# An H100 with round figures and no fixed costs, so each time is bytes / rate or FLOPs / rate.
GPU = dataclasses.replace(GPUS["h100"], nvlink=100e9, network=10e9, nvlink_domain=8,
                          host_link=50e9, host_link_gpus=1, collective_latency=0.0,
                          kernel_launch=0.0, efficiency={})
ADD = f"""%add_f (p0: f32[{N}], p1: f32[{N}]) -> f32[{N}] {{
  %p0 = f32[{N}]{{0}} parameter(0)
  %p1 = f32[{N}]{{0}} parameter(1)
  ROOT %add = f32[{N}]{{0}} add(%p0, %p1)
}}
"""
ADD_S = 12 * MiB / GPU.hbm  # the add kernel: two 4 MiB reads, one 4 MiB write
EIGHT = "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}"


def module(entry: str, *computations: str) -> hlo.Module:
    lines = "\n".join(f"  {line}" for line in entry.strip().splitlines())
    return hlo.parse_module("HloModule m, is_scheduled=true\n\n" + "\n".join(computations)
                            + f"\nENTRY %main (a: f32[{N}]) -> f32[{N}] {{\n{lines}\n}}\n")


def step(entry: str, *computations: str, gpu=GPU, devices=8, **kw) -> replay.Replay:
    return replay.replay(module(entry, *computations), gpu, devices, **kw)


def gathered(nvlink: float) -> replay.Replay:
    """An all-gather of 4 MiB over 8 GPUs issued before the add, waited for after it."""
    return step(f"""
%a = f32[{N}]{{0}} parameter(0)
%w = f32[{N // 8}]{{0}} bitcast(%a)
%ag = (f32[{N // 8}]{{0}}, f32[{N}]{{0}}) all-gather-start(%w), {EIGHT}
%sum = f32[{N}]{{0}} fusion(%a, %a), kind=kLoop, calls=%add_f
%agd = f32[{N}]{{0}} all-gather-done(%ag)
ROOT %out = f32[{N}]{{0}} fusion(%sum, %agd), kind=kLoop, calls=%add_f
""", ADD, gpu=dataclasses.replace(GPU, nvlink=nvlink))


def test_a_collective_hides_behind_the_compute_it_overlaps_or_is_exposed():
    ring = 7 / 8 * 4 * MiB  # bytes each GPU receives in a ring all-gather of 4 MiB over 8
    hidden = gathered(nvlink=10 * ring / ADD_S)  # a tenth of the add's time
    assert hidden.step_s == pytest.approx(2 * ADD_S, rel=1e-9)
    assert hidden.exposed["collectives"] == 0
    exposed = gathered(nvlink=ring / (5 * ADD_S))  # five times the add's time
    assert exposed.step_s == pytest.approx(5 * ADD_S + ADD_S, rel=1e-9)
    assert exposed.exposed["collectives"] == pytest.approx(4 * ADD_S, rel=1e-9)
    assert exposed.critical() == "exposed collectives"


def test_a_synchronous_collective_is_all_exposed():
    result = step(f"""
%a = f32[{N}]{{0}} parameter(0)
%w = f32[{N // 8}]{{0}} bitcast(%a)
ROOT %ag = f32[{N}]{{0}} all-gather(%w), {EIGHT}
""", gpu=dataclasses.replace(GPU, collective_latency=20e-6))
    assert result.step_s == pytest.approx(20e-6 + 7 / 8 * 4 * MiB / 100e9, rel=1e-9)
    assert result.exposed["collectives"] == pytest.approx(result.step_s, rel=1e-9)


def test_a_collective_that_leaves_its_nvlink_domain_crosses_the_nics():
    """16 GPUs in two NVLink domains of 8: an all-gather first exchanges 1/8 of the output with
    the peer in the other domain (half of it arrives: 1/16 of S over the NIC), then gathers
    inside the domain (7/8 of S over NVLink); an all-to-all sends 8/16 of S to the other
    domain over the NICs while 7/16 of S moves over NVLink."""
    group = "{{" + ",".join(map(str, range(16))) + "}}"
    gather = step(f"""
%a = f32[{N}]{{0}} parameter(0)
%w = f32[{N // 16}]{{0}} bitcast(%a)
ROOT %ag = f32[{N}]{{0}} all-gather(%w), replica_groups={group}, dimensions={{0}}
""", devices=16)
    S = 4 * MiB
    assert gather.step_s == pytest.approx(S / 16 / 10e9 + 7 / 8 * S / 100e9, rel=1e-9)
    exchange = step(f"""
%a = f32[{N}]{{0}} parameter(0)
ROOT %x = f32[{N}]{{0}} all-to-all(%a), replica_groups={group}, dimensions={{0}}
""", devices=16)
    assert exchange.step_s == pytest.approx(max(7 / 16 * S / 100e9, 8 / 16 * S / 10e9), rel=1e-9)


# An all-to-all issued as XLA issues the expert exchange: a generic async start wrapping it,
# its groups in jax 0.12's mesh form (the mesh's last axis), 16 GPUs in domains of 8; and one
# the partitioner adds (is_spmd_generated) over every device.
MESH = "replica_groups=mesh['fsdp'=4,'expert'=4]"
EXCHANGES = f"""%exchange (p: f32[{N}]) -> f32[{N}] {{
  %p = f32[{N}]{{0}} parameter(0)
  ROOT %x = f32[{N}]{{0}} all-to-all(%p), channel_id=1, {MESH} {{'expert'}}, dimensions={{0}}
}}
%reshard (q: f32[{N}]) -> f32[{N}] {{
  %q = f32[{N}]{{0}} parameter(0)
  ROOT %y = f32[{N}]{{0}} all-to-all(%q), channel_id=2, {MESH} {{'fsdp','expert'}}, """ \
    f"""dimensions={{0}}, frontend_attributes={{is_spmd_generated="true"}}
}}
"""
EXCHANGED = f"""
%a = f32[{N}]{{0}} parameter(0)
%s = ((f32[{N}]{{0}}), f32[{N}]{{0}}) async-start(%a), calls=%exchange
%d = f32[{N}]{{0}} async-done(%s)
%s2 = ((f32[{N}]{{0}}), f32[{N}]{{0}}) async-start(%d), calls=%reshard
ROOT %d2 = f32[{N}]{{0}} async-done(%s2)
"""


def test_an_async_all_to_all_is_costed_over_its_own_groups():
    """The exchange over groups of 4 consecutive GPUs stays inside a domain of 8: 3/4 of S over
    NVLink; the resharding over all 16 sends half of S over the NICs (as in the test above)."""
    S = 4 * MiB
    result = step(EXCHANGED, EXCHANGES, devices=16)
    assert result.busy["collectives"] == pytest.approx(
        3 / 4 * S / 100e9 + max(7 / 16 * S / 100e9, 8 / 16 * S / 10e9), rel=1e-9)


def test_the_compile_output_tells_the_expert_exchanges_inside_one_domain_from_the_rest():
    """By the mesh's device ids: in order, each exchange group of 4 is one domain's; with the
    ids interleaved (device 2k and 2k+1 in other domains) the same groups cross."""
    text = ("HloModule m, is_scheduled=true\n\n" + EXCHANGES + f"\nENTRY %main (a: f32[{N}]) "
            f"-> f32[{N}] {{\n" + EXCHANGED.strip() + "\n}\n")
    gpu = dataclasses.replace(GPU, nvlink_domain=8)
    found = predicted_step.exchange_groups(hlo.parse_module(text), gpu, list(range(16)))
    assert found["expert"] == {"count": 1, "sizes": [4], "domain": 8, "crossing": []}
    assert found["resharding"]["count"] == 1 and found["resharding"]["sizes"] == [16]
    assert found["resharding"]["crossing"] == [tuple(range(16))]
    interleaved = [8 * (k % 2) + k // 2 for k in range(16)]
    crossing = predicted_step.exchange_groups(hlo.parse_module(text), gpu,
                                              interleaved)["expert"]["crossing"]
    assert len(crossing) == 4 and crossing[0] == (0, 8, 1, 9)
    assert "each inside one NVLink domain" in predicted_step.exchange_line(found)


def expert_exchange(fsdp: int, expert: int) -> str:
    """An all-to-all over the mesh's expert axis: groups of `expert` consecutive devices."""
    return f"""
%a = f32[{N}]{{0}} parameter(0)
ROOT %x = f32[{N}]{{0}} all-to-all(%a), channel_id=1, replica_groups=mesh['fsdp'={fsdp},""" \
        f"""'expert'={expert}] {{'expert'}}, dimensions={{0}}
"""


# (GPU, fsdp, expert) -> the exchange groups that leave an NVLink domain, by hand. 144 GB200s
# fill two NVL72 domains of 72: a group of 16 at 64-79 straddles the boundary at 72 though it
# is narrower than a domain; groups of 8 tile a domain. 128 GB200s are two domains of 64, so
# 64-79 is inside the second (not cut at 72). 24 H100s in domains of 8: groups of 6 at 6-11
# and 12-17 straddle, 0-5 and 18-23 do not.
STRADDLING = [(("gb200", 9, 16), [tuple(range(64, 80))]), (("gb200", 18, 8), []),
              (("gb200", 8, 16), []), (("h100", 4, 6), [tuple(range(6, 12)),
                                                       tuple(range(12, 18))])]


@pytest.mark.parametrize("mesh, crossing", STRADDLING,
                         ids=[f"{n * e} {g} in groups of {e}" for (g, n, e), _ in STRADDLING])
def test_a_group_that_straddles_a_domain_boundary_crosses_it(mesh, crossing):
    """Guards the class: an all-to-all group judged inside one NVLink domain by its size (or
    its span, or the NVLink fabric's width instead of the domains the devices fill) rather
    than by the domain of each of its devices; the study's sizes (groups of 8 in domains of 64)
    cannot tell these apart."""
    name, fsdp, expert = mesh
    found = predicted_step.exchange_groups(module(expert_exchange(fsdp, expert)), GPUS[name],
                                           list(range(fsdp * expert)))["expert"]
    assert found["crossing"] == crossing


def test_an_all_to_all_waits_for_its_slowest_group():
    """The replay's cost of an exchange whose groups differ: 24 GPUs in domains of 8, groups
    of 6. Inside one domain (0-5) 5/6 of S moves over NVLink; 6-11 has 2 GPUs in one domain
    and 4 in the next (m = 6 // 2 = 3, as for a group of 6 in two halves): 2/6 of S over
    NVLink while 3/6 crosses the NICs. The step waits for the slowest group."""
    S = 4 * MiB
    result = step(expert_exchange(4, 6), devices=24)
    assert result.step_s == pytest.approx(max(2 / 6 * S / 100e9, 3 / 6 * S / 10e9), rel=1e-9)


def host_copy(host_link: float, gpus_per_link: int = 1) -> replay.Replay:
    """4 MiB copied to pinned host memory while the add runs."""
    return step(f"""
%a = f32[{N}]{{0}} parameter(0)
%v = f32[{N}]{{0}} bitcast(%a)
%c = (f32[{N}]{{0:S(5)}}, f32[{N}]{{0}}, u32[]) copy-start(%v)
%sum = f32[{N}]{{0}} fusion(%a, %a), kind=kLoop, calls=%add_f
%cd = f32[{N}]{{0:S(5)}} copy-done(%c)
ROOT %t = (f32[{N}]{{0}}, f32[{N}]{{0:S(5)}}) tuple(%sum, %cd)
""", ADD, gpu=dataclasses.replace(GPU, host_link=host_link, host_link_gpus=gpus_per_link))


def test_a_host_copy_shorter_than_the_compute_it_overlaps_is_hidden_a_longer_one_not():
    short = host_copy(host_link=4 * MiB / (0.5 * ADD_S))
    assert short.step_s == pytest.approx(ADD_S, rel=1e-9)
    assert short.busy["to host"] == pytest.approx(0.5 * ADD_S, rel=1e-9)
    long = host_copy(host_link=4 * MiB / (2 * ADD_S))
    assert long.step_s == pytest.approx(2 * ADD_S, rel=1e-9)
    assert long.exposed["to host"] == pytest.approx(ADD_S, rel=1e-9)
    # Two GPUs on one host link (a Grace and its two GPUs): each gets half of it.
    shared = host_copy(host_link=4 * MiB / (2 * ADD_S), gpus_per_link=2)
    assert shared.step_s == pytest.approx(4 * ADD_S, rel=1e-9)


def test_copies_one_way_queue_on_one_link_the_two_directions_run_at_once():
    out = f"(f32[{N}]{{0:S(5)}}, f32[{N}]{{0}}, u32[]) copy-start(%v)"
    back = f"(f32[{N}]{{0}}, f32[{N}]{{0:S(5)}}, u32[]) copy-start(%h)"
    one_way = step(f"""
%a = f32[{N}]{{0}} parameter(0)
%v = f32[{N}]{{0}} bitcast(%a)
%c1 = {out}
%c2 = {out}
%d1 = f32[{N}]{{0:S(5)}} copy-done(%c1)
%d2 = f32[{N}]{{0:S(5)}} copy-done(%c2)
ROOT %t = (f32[{N}]{{0:S(5)}}, f32[{N}]{{0:S(5)}}) tuple(%d1, %d2)
""")
    copy_s = 4 * MiB / 50e9
    assert one_way.step_s == pytest.approx(2 * copy_s, rel=1e-9)
    both_ways = step(f"""
%a = f32[{N}]{{0}} parameter(0)
%v = f32[{N}]{{0}} bitcast(%a)
%h = f32[{N}]{{0:S(5)}} parameter(1)
%c1 = {out}
%c2 = {back}
%d1 = f32[{N}]{{0:S(5)}} copy-done(%c1)
%d2 = f32[{N}]{{0}} copy-done(%c2)
ROOT %t = (f32[{N}]{{0:S(5)}}, f32[{N}]{{0}}) tuple(%d1, %d2)
""")
    assert both_ways.step_s == pytest.approx(copy_s, rel=1e-9)
    assert both_ways.busy["from host"] == pytest.approx(copy_s, rel=1e-9)


# A loop body: one add kernel per trip.
BODY = f"""%body (s: (s32[], f32[{N}])) -> (s32[], f32[{N}]) {{
  %s = (s32[], f32[{N}]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[{N}]{{0}} get-tuple-element(%s), index=1
  %y = f32[{N}]{{0}} fusion(%x, %x), kind=kLoop, calls=%add_f
  ROOT %r = (s32[], f32[{N}]{{0}}) tuple(%i, %y)
}}
"""


def test_a_while_loop_runs_its_body_its_known_trip_count_times():
    trips = 'backend_config={"known_trip_count":{"n":"5"}}'
    result = step(f"""
%a = f32[{N}]{{0}} parameter(0)
%zero = s32[] constant(0)
%init = (s32[], f32[{N}]{{0}}) tuple(%zero, %a)
%loop = (s32[], f32[{N}]{{0}}) while(%init), condition=%cond, body=%body, {trips}
ROOT %out = f32[{N}]{{0}} get-tuple-element(%loop), index=1
""", ADD, BODY, keep_slices=True)
    assert result.step_s == pytest.approx(5 * ADD_S, rel=1e-9)
    assert [s[5] for s in result.slices] == [(k,) for k in range(5)]  # the iterations


# A loop body as a layer of parameters=host: its weights (4 MiB) from host memory, its new
# weights back.
HOST_BODY = f"""%host_body (s: (s32[], f32[{N}])) -> (s32[], f32[{N}]) {{
  %s = (s32[], f32[{N}]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[{N}]{{0}} get-tuple-element(%s), index=1
  %h = f32[{N}]{{0:S(5)}} copy(%x)
  %y = f32[{N}]{{0}} copy(%h)
  ROOT %r = (s32[], f32[{N}]{{0}}) tuple(%i, %y)
}}
"""


def test_the_bytes_over_the_host_link_are_counted_each_way_every_trip():
    """The replay counts the bytes each host copy moves, per direction, once per loop trip
    (a layer's weights over the host link, as parameters=host moves them). Synchronous
    copies: all exposed."""
    trips = 'backend_config={"known_trip_count":{"n":"5"}}'
    result = step(f"""
%a = f32[{N}]{{0}} parameter(0)
%zero = s32[] constant(0)
%init = (s32[], f32[{N}]{{0}}) tuple(%zero, %a)
%loop = (s32[], f32[{N}]{{0}}) while(%init), condition=%cond, body=%host_body, {trips}
ROOT %out = f32[{N}]{{0}} get-tuple-element(%loop), index=1
""", HOST_BODY)
    assert result.moved == {"to host": 5 * 4 * MiB, "from host": 5 * 4 * MiB}
    assert result.step_s == pytest.approx(10 * 4 * MiB / GPU.host_link, rel=1e-9)
    assert result.exposed["to host"] == pytest.approx(5 * 4 * MiB / GPU.host_link, rel=1e-9)


def gemm(m: int, k: int, n: int, dtype: str = "bf16") -> str:
    return f"""%gemm (x: {dtype}[{m},{k}], y: {dtype}[{k},{n}]) -> f32[{m},{n}] {{
  %x = {dtype}[{m},{k}]{{1,0}} parameter(0)
  %y = {dtype}[{k},{n}]{{1,0}} parameter(1)
  ROOT %d = f32[{m},{n}]{{1,0}} dot(%x, %y), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""


@pytest.mark.parametrize("efficiency", [1.0, 0.5])
def test_a_gemm_costs_its_flops_at_the_rate_of_its_precision(efficiency):
    entry = """
%a = f32[1048576]{0} parameter(0)
%x = bf16[4096,4096]{1,0} parameter(1)
%y = bf16[4096,4096]{1,0} parameter(2)
ROOT %d = f32[4096,4096]{1,0} fusion(%x, %y), kind=kCustom, calls=%gemm
"""
    result = step(entry, gemm(4096, 4096, 4096), efficiency={"bf16": efficiency})
    flops = 2 * 4096**3
    assert result.flops == {"bf16": flops}
    assert result.step_s == pytest.approx(flops / (989e12 * efficiency), rel=1e-9)
    assert result.gemm_s == result.step_s
    # The same GEMM too thin for its FLOPs to matter costs its bytes at HBM rate.
    thin = step(entry.replace("4096,4096]{1,0} parameter(2)", "4096,16]{1,0} parameter(2)")
                .replace("ROOT %d = f32[4096,4096]", "ROOT %d = f32[4096,16]"),
                gemm(4096, 4096, 16))
    assert thin.step_s == pytest.approx((4096 * 4096 * 2 + 4096 * 16 * 6) / GPU.hbm, rel=1e-9)


def test_a_kernel_reads_the_slice_of_a_stacked_buffer_and_writes_an_update_in_place():
    """A layer loop reads one layer of its stacked weights and writes one layer of its
    stacked activations: the kernel's bytes are those slices, not the whole buffers."""
    fused = f"""%layer (stack: f32[64,{N}], x: f32[{N}], i: s32[]) -> f32[64,{N}] {{
  %stack = f32[64,{N}]{{1,0}} parameter(0)
  %x = f32[{N}]{{0}} parameter(1)
  %i = s32[] parameter(2)
  %zero = s32[] constant(0)
  %row = f32[1,{N}]{{1,0}} bitcast(%x)
  ROOT %u = f32[64,{N}]{{1,0}} dynamic-update-slice(%stack, %row, %i, %zero)
}}
%read (stack: f32[64,{N}], i: s32[]) -> f32[1,{N}] {{
  %stack = f32[64,{N}]{{1,0}} parameter(0)
  %i = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %s = f32[1,{N}]{{1,0}} dynamic-slice(%stack, %i, %zero), dynamic_slice_sizes={{1,{N}}}
}}
"""
    result = step(f"""
%a = f32[{N}]{{0}} parameter(0)
%stack = f32[64,{N}]{{1,0}} parameter(1)
%i = s32[] parameter(2)
%w = f32[64,{N}]{{1,0}} fusion(%stack, %a, %i), kind=kLoop, calls=%layer
ROOT %r = f32[1,{N}]{{1,0}} fusion(%w, %i), kind=kLoop, calls=%read
""", fused)
    # the update: 4 MiB read, 4 MiB written (and 4 B of index); the slice: 4 MiB each way
    assert result.step_s == pytest.approx((16 * MiB + 8) / GPU.hbm, rel=1e-9)


def test_replica_groups_in_every_printed_form():
    def groups(text, devices=8):
        return hlo.replica_groups(hlo.Instruction("x", hlo.Shape(), "all-gather", [],
                                                  {"replica_groups": text}), devices)
    assert groups("{}") == [list(range(8))]
    assert groups("{{0,1},{2,3}}") == [[0, 1], [2, 3]]
    assert groups("[2,4]<=[4,2]T(1,0)") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups("mesh['data'=2,'fsdp'=4] {'fsdp'}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups("mesh['data'=2,'fsdp'=4] {'data'}") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_the_timeline_is_a_chrome_trace_with_one_track_per_stream(tmp_path):
    result = gathered(nvlink=1e9)
    replay.write_timeline(
        replay.replay(module("""
%a = f32[1048576]{0} parameter(0)
ROOT %s = f32[1048576]{0} fusion(%a, %a), kind=kLoop, calls=%add_f
""", ADD), GPU, 8, keep_slices=True), "t", tmp_path / "timeline.json")
    trace = json.loads((tmp_path / "timeline.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == set(replay.STREAMS)
    [kernel] = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert kernel["name"] == "s" and kernel["dur"] == pytest.approx(ADD_S * 1e6)
    assert result.slices == []  # kept only when asked for


def test_an_unscheduled_module_is_refused():
    with pytest.raises(ValueError, match="not scheduled"):
        replay.replay(hlo.parse_module("HloModule m\n"), GPU, 8)


# The same GPU with a kernel launch gap and an NCCL latency, each unlike any other time here:
# every kernel (on the compute and async compute streams) pays the gap once per run; a
# collective pays the latency instead, a host transfer (a copy engine, no kernel) neither.
LAUNCH = 2e-6
LATENCY = 1e-6
LAUNCHING = dataclasses.replace(GPU, kernel_launch=LAUNCH, collective_latency=LATENCY)
KERNEL_S = LAUNCH + ADD_S  # the add kernel with its launch gap


def test_every_kernel_pays_the_launch_gap_and_transfers_and_collectives_do_not():
    """Synchronous work only: the step is the sum of its instructions, each by hand."""
    trips = 'backend_config={"known_trip_count":{"n":"3"}}'
    result = step(f"""
%a = f32[{N}]{{0}} parameter(0)
%x = bf16[4096,4096]{{1,0}} parameter(1)
%sum = f32[{N}]{{0}} fusion(%a, %a), kind=kLoop, calls=%add_f
%plain = f32[{N}]{{0}} add(%sum, %a)
%moved = f32[{N}]{{0}} copy(%plain)
%out = f32[{N}]{{0:S(5)}} copy(%moved)
%w = f32[{N // 8}]{{0}} bitcast(%moved)
%ag = f32[{N}]{{0}} all-gather(%w), {EIGHT}
%zero = s32[] constant(0)
%init = (s32[], f32[{N}]{{0}}) tuple(%zero, %ag)
%loop = (s32[], f32[{N}]{{0}}) while(%init), condition=%cond, body=%body, {trips}
%d = f32[4096,4096]{{1,0}} fusion(%x, %x), kind=kCustom, calls=%gemm
ROOT %t = (f32[{N}]{{0:S(5)}}, f32[4096,4096]{{1,0}}) tuple(%out, %d)
""", ADD, BODY, gemm(4096, 4096, 4096), gpu=LAUNCHING)
    to_host = 4 * MiB / 50e9  # no gap: the host link's rate alone
    gather = LATENCY + 7 / 8 * 4 * MiB / 100e9  # the latency, no gap
    gemm_s = LAUNCH + 2 * 4096**3 / 989e12
    kernels = (KERNEL_S  # the fused add
               + KERNEL_S  # the unfused add: the same bytes
               + LAUNCH + 8 * MiB / GPU.hbm  # the copy on the device: 4 MiB each way
               + 3 * KERNEL_S  # the loop's add, a gap per iteration
               + gemm_s)
    assert result.step_s == pytest.approx(kernels + to_host + gather, rel=1e-9)
    assert result.busy["compute"] == pytest.approx(result.step_s, rel=1e-9)
    assert result.gemm_s == pytest.approx(gemm_s, rel=1e-9)
    assert result.exposed == pytest.approx({"collectives": gather, "to host": to_host,
                                            "from host": 0, "async compute": 0}, rel=1e-9)
    assert result.busy["to host"] == pytest.approx(to_host, rel=1e-9)
    assert result.busy["collectives"] == pytest.approx(gather, rel=1e-9)


def five_streams(gather_s: float) -> replay.Replay:
    """Work started on each of the four other streams at t = 0, then one add, the four waits
    (in the order below) and a last add: an all-gather of `gather_s` (latency included), 4 MiB
    to host in 1.5 adds, 8 MiB from host in 3 adds, and a copy on the device (the async
    compute stream: its launch gap and 8 MiB at HBM rate, shorter than an add)."""
    add_s = KERNEL_S
    host_link = 4 * MiB / (1.5 * add_s)
    nvlink = 7 / 8 * 4 * MiB / (gather_s - LATENCY)
    gpu = dataclasses.replace(LAUNCHING, host_link=host_link, nvlink=nvlink)
    outs = f"(f32[{N}]{{0}}, f32[{N}]{{0:S(5)}}, f32[{2 * N}]{{0}}, f32[{N}]{{0}})"
    return step(f"""
%a = f32[{N}]{{0}} parameter(0)
%h = f32[{2 * N}]{{0:S(5)}} parameter(1)
%w = f32[{N // 8}]{{0}} bitcast(%a)
%ag = (f32[{N // 8}]{{0}}, f32[{N}]{{0}}) all-gather-start(%w), {EIGHT}
%v = f32[{N}]{{0}} bitcast(%a)
%out = (f32[{N}]{{0:S(5)}}, f32[{N}]{{0}}, u32[]) copy-start(%v)
%in = (f32[{2 * N}]{{0}}, f32[{2 * N}]{{0:S(5)}}, u32[]) copy-start(%h)
%cp = (f32[{N}]{{0}}, f32[{N}]{{0}}, u32[]) copy-start(%a)
%sum = f32[{N}]{{0}} fusion(%a, %a), kind=kLoop, calls=%add_f
%agd = f32[{N}]{{0}} all-gather-done(%ag)
%outd = f32[{N}]{{0:S(5)}} copy-done(%out)
%ind = f32[{2 * N}]{{0}} copy-done(%in)
%cpd = f32[{N}]{{0}} copy-done(%cp)
%last = f32[{N}]{{0}} fusion(%sum, %agd), kind=kLoop, calls=%add_f
ROOT %t = {outs} tuple(%last, %outd, %ind, %cpd)
""", ADD, gpu=gpu)


@pytest.mark.parametrize("gather_adds, exposed", [
    # Hidden behind the first add; to host waited for from 1 to 1.5 adds, from host to 3.
    (0.5, {"collectives": 0, "to host": 0.5, "from host": 1.5, "async compute": 0}),
    # Waited for to 2.5 adds: to host has finished by then, from host waited for to 3.
    (2.5, {"collectives": 1.5, "to host": 0, "from host": 0.5, "async compute": 0}),
], ids=["collective hidden", "collective exposed"])
def test_each_stream_is_busy_with_its_own_work_and_exposed_only_where_compute_waits(
        gather_adds, exposed):
    """Busy and exposed seconds per stream, in adds (an add kernel with its launch gap): the
    step is 3 adds of waiting and work, then the last add, either way."""
    add_s = KERNEL_S
    result = five_streams(gather_adds * add_s)
    assert result.step_s == pytest.approx(4 * add_s, rel=1e-9)
    assert result.busy == pytest.approx({
        "compute": 4 * add_s, "collectives": gather_adds * add_s, "to host": 1.5 * add_s,
        "from host": 3 * add_s, "async compute": LAUNCH + 8 * MiB / GPU.hbm}, rel=1e-9)
    assert result.exposed == pytest.approx({k: v * add_s for k, v in exposed.items()},
                                           rel=1e-9, abs=1e-15)
