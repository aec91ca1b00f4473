"""The compiled GPU program reads each offloaded activation back from the bytes the forward
pass wrote it to (study/programs/addressing.py): proved for the pinned jax on a small scanned stack
compiled for a GPU, refuted on the optimized HLO jax 0.10.2 compiled for the same program
(committed), and each half of the proof (the index the loop passes, XLA's descriptor) shown
able to fail on hand-written programs whose addresses are computed by hand."""

import json
import types

import jax
import jax.numpy as jnp
import pytest

import configs
from study.plan import printed
from configs import ConfigError
from study.hardware.compile_only import compile_only
from study.hardware.gpus import GPUS
from study.plan import memory_plan
from study.programs import addressing, offload_proof
from study.programs.jaxpr import Tagged
from tools import offload_probe
from runtime import backend, setup as runtime_setup
from runtime.own_program import CompiledMemory
from trainer.target import Target

FIXTURES = offload_probe.FIXTURES


@pytest.mark.gpu_compile
@pytest.mark.parametrize("remat3", [False, True], ids=["remat", "remat3"])
@pytest.mark.parametrize("options", [{}, offload_probe.PIPELINED], ids=["plain", "pipelined"])
def test_the_pinned_jax_reads_host_buffers_back_in_reverse_layer_order(options, remat3):
    """Also under JAX's next remat implementation (jax_remat3), which matches policies by the
    class of their answer."""
    devices = compile_only(GPUS["h200"], 1).devices
    jax.config.update("jax_remat3", remat3)
    try:
        hlo = offload_probe.compile_probe(devices, options)
    finally:
        jax.config.update("jax_remat3", False)
    (proof,) = addressing.prove(hlo)
    assert proof.buffer.shape.dims == (offload_probe.LAYERS, offload_probe.ROWS,
                                       offload_probe.WIDTH)
    assert (proof.verdict, proof.detail) == (addressing.CHECKED,
                                             "read back layer 3 first: checked")


@pytest.mark.parametrize("name, walk", [
    ("jax-0.10.2", "read 0 (dynamic_slice.8.1, iteration 0 of loop while.18) means layer 3 "
                   "(the loop passes index 3), but XLA's descriptor byte_offset 0, "
                   "byte_stride +524,288 addresses layer 0"),
    ("jax-0.10.2-pipelined", "read 1 (dynamic_slice.18.1, iteration 0 of loop while.1) means "
                             "layer 2 (the loop passes index 2), but XLA's descriptor "
                             "byte_offset 524,288, byte_stride +524,288 addresses layer 1")])
def test_jax_0_10_2_reads_them_back_walking_forward(name, walk):
    (proof,) = addressing.prove((FIXTURES / f"{name}.hlo").read_text())
    assert proof.verdict == addressing.WRONG
    assert proof.detail.startswith(walk) and addressing.XLA_ISSUE in proof.detail


# Four layers of f32[8] (32 bytes each) in a host buffer: a forward loop writes layer i, a
# backward loop reads layer INDEX with XLA's descriptor READ. Right: 3 - i at 96 - 32 i.
HAND_WRITTEN = """HloModule hand, is_scheduled=true

%forward (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %stack = f32[4,8]{1,0:S(5)} get-tuple-element(%p), index=1
  %zero = f32[] constant(0)
  %row = f32[1,8]{1,0} broadcast(%zero), dimensions={}
  %c0 = s32[] constant(0)
  %written = f32[4,8]{1,0:S(5)} dynamic-update-slice(%stack, %row, %i, %c0), WRITE
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[4,8]{1,0:S(5)}) tuple(%next, %written)
}

%back (q: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %q = (s32[], f32[4,8]{1,0:S(5)}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %held = f32[4,8]{1,0:S(5)} get-tuple-element(%q), index=1
  %last = s32[] constant(3)
  %reverse = s32[] subtract(%last, %j)
  %d0 = s32[] constant(0)
  %read = f32[1,8]{1,0} dynamic-slice(%held, INDEX, %d0), dynamic_slice_sizes={1,8}, READ
  %step = s32[] constant(1)
  %after = s32[] add(%j, %step)
  ROOT %back = (s32[], f32[4,8]{1,0:S(5)}) tuple(%after, %held)
}

%more (c: (s32[], f32[4,8])) -> pred[] {
  %c = (s32[], f32[4,8]{1,0:S(5)}) parameter(0)
  %k = s32[] get-tuple-element(%c), index=0
  %layers = s32[] constant(4)
  ROOT %below = pred[] compare(%k, %layers), direction=LT
}

%more.1 (c.1: (s32[], f32[4,8])) -> pred[] {
  %c.1 = (s32[], f32[4,8]{1,0:S(5)}) parameter(0)
  %k.1 = s32[] get-tuple-element(%c.1), index=0
  %layers.1 = s32[] constant(4)
  ROOT %below.1 = pred[] compare(%k.1, %layers.1), direction=LT
}

ENTRY %main () -> (s32[], f32[4,8]) {
  %stacked = f32[4,8]{1,0:S(5)} custom-call(), custom_call_target="AllocateBuffer"
  %start = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0:S(5)}) tuple(%start, %stacked)
  %fwd = (s32[], f32[4,8]{1,0:S(5)}) while(%init), condition=%more, body=%forward, LOOP4
  %saved = f32[4,8]{1,0:S(5)} get-tuple-element(%fwd), index=1
  %again = (s32[], f32[4,8]{1,0:S(5)}) tuple(%start, %saved)
  ROOT %bwd = (s32[], f32[4,8]{1,0:S(5)}) while(%again), condition=%more.1, body=%back, LOOPTRIP
}
"""
RIGHT_WALK = '{"loop_index":"0","byte_offset":"96","byte_stride":"-32"}'


FORWARD_WALK = '{"loop_index":"0","byte_offset":"0","byte_stride":"32"}'


def loop(n: str) -> str:
    """A while loop's backend config: its trip count `n` (none when empty)."""
    known = {"known_trip_count": {"n": n}} if n else {}
    return "backend_config=" + json.dumps({**known, "known_init_step": {
        "init": "0", "step": "1"}}, separators=(",", ":"))


def walk(config: str) -> str:
    return 'backend_config={"dynamic_slice_config":%s}' % config


def hand_written(index="%reverse", read=RIGHT_WALK, trip="4"):
    return (HAND_WRITTEN.replace("INDEX", index)
            .replace("WRITE", walk(FORWARD_WALK)).replace("READ", walk(read))
            .replace("LOOP4", loop("4")).replace("LOOPTRIP", loop(trip)))


@pytest.mark.parametrize("index, read, verdict, says", [
    ("%reverse", RIGHT_WALK, addressing.CHECKED, "read back layer 3 first"),
    ("%reverse", '{"loop_index":"0","byte_offset":"0","byte_stride":"0","linear":'
                 '{"byte_offset":"96","byte_stride":"-32"}}', addressing.CHECKED,
     "read back layer 3 first"),  # jaxlib 0.12's nesting of the same walk
    # The descriptor walks forward, the index backward (jaxlib 0.10.2's bug):
    ("%reverse", FORWARD_WALK, addressing.WRONG,
     "read 0 (read, iteration 0 of loop bwd) means layer 3 (the loop passes index 3), but "
     "XLA's descriptor byte_offset 0, byte_stride +32 addresses layer 0"),
    # The descriptor walks backward, the index forward:
    ("%j", RIGHT_WALK, addressing.WRONG, "read 0 (read, iteration 0 of loop bwd) means "
     "layer 0 (the loop passes index 0), but XLA's descriptor byte_offset 96, byte_stride -32 "
     "addresses layer 3"),
    # Both walk forward, in agreement: the reads are not the reverse of the writes.
    ("%j", FORWARD_WALK, addressing.WRONG,
     "the backward pass's read 0 is layer 0, but the forward pass wrote layer 3 at step 3"),
    ("%reverse", '{"loop_index":"0","offset_table":["96"]}', addressing.UNVERIFIED,
     "read: a descriptor this proof does not read"),
    ("%reverse", '{"loop_index":"1","byte_offset":"96","byte_stride":"-32"}',
     addressing.UNVERIFIED, "read, iteration 0 of loop bwd: loop_index 1 of 1 loops"),
])
def test_each_half_of_the_proof_can_fail(index, read, verdict, says):
    (proof,) = addressing.prove(hand_written(index, read))
    assert proof.verdict == verdict and proof.detail.startswith(says), proof.detail


# HAND_WRITTEN with several host buffers, as XLA compiles several offloaded tags of one layer
# scan: carried through one forward loop that writes layer i of each and one backward loop
# that reads each with its own slice. Per buffer k: GET (its element of the loop state),
# WRITE, READ (with its own INDEX and descriptor); STATE: the loop state's shape.
SEVERAL = """HloModule several, is_scheduled=true

%forward (p: STATE) -> STATE {
  %p = STATE parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  GET(stack, p)
  %zero = f32[] constant(0)
  %row = f32[1,8]{1,0} broadcast(%zero), dimensions={}
  %c0 = s32[] constant(0)
  WRITE
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = STATE tuple(%next, EACH(written))
}

%back (q: STATE) -> STATE {
  %q = STATE parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  GET(held, q)
  %last = s32[] constant(3)
  %reverse = s32[] subtract(%last, %j)
  %d0 = s32[] constant(0)
  READ
  %step = s32[] constant(1)
  %after = s32[] add(%j, %step)
  ROOT %back = STATE tuple(%after, EACH(held))
}

%more (c: STATE) -> pred[] {
  %c = STATE parameter(0)
  %k = s32[] get-tuple-element(%c), index=0
  %layers = s32[] constant(4)
  ROOT %below = pred[] compare(%k, %layers), direction=LT
}

ENTRY %main () -> STATE {
  ALLOCATE
  %start = s32[] constant(0)
  %init = STATE tuple(%start, EACH(stacked))
  %fwd = STATE while(%init), condition=%more, body=%forward, LOOP4
  GET(saved, fwd)
  %again = STATE tuple(%start, EACH(saved))
  ROOT %bwd = STATE while(%again), condition=%more, body=%back, LOOP4
}
"""
STACK = "f32[4,8]{1,0:S(5)}"


def several_buffers(reads: list[tuple[str, str]]) -> str:
    """SEVERAL with one host buffer per (index, read descriptor) of `reads`."""
    each = range(len(reads))

    def lines(line):  # one line per buffer, indented as the computations are
        return "\n  ".join(line(k) for k in each)

    text = SEVERAL
    for name, tuple_ in (("stack", "p"), ("held", "q"), ("saved", "fwd")):
        text = text.replace(f"GET({name}, {tuple_})", lines(
            lambda k: f"%{name}.{k} = {STACK} get-tuple-element(%{tuple_}), index={k + 1}"))
    for name in ("written", "held", "stacked", "saved"):
        text = text.replace(f"EACH({name})", ", ".join(f"%{name}.{k}" for k in each))
    return (text.replace("WRITE", lines(
                lambda k: f"%written.{k} = {STACK} dynamic-update-slice(%stack.{k}, %row, %i, "
                          f"%c0), {walk(FORWARD_WALK)}"))
            .replace("READ", lines(
                lambda k: f"%read.{k} = f32[1,8]{{1,0}} dynamic-slice(%held.{k}, {reads[k][0]}, "
                          f"%d0), dynamic_slice_sizes={{1,8}}, {walk(reads[k][1])}"))
            .replace("ALLOCATE", lines(
                lambda k: f'%stacked.{k} = {STACK} custom-call(), '
                          f'custom_call_target="AllocateBuffer"'))
            .replace("STATE", f"(s32[], {', '.join([STACK] * len(reads))})")
            .replace("LOOP4", loop("4")))


RIGHT = ("%reverse", RIGHT_WALK)
FORWARD_READS = {  # two ways to read layer 0 back first instead of layer 3:
    "descriptor": (("%reverse", FORWARD_WALK), "read 0 (read.{k}, iteration 0 of loop bwd) "
                   "means layer 3 (the loop passes index 3), but XLA's descriptor byte_offset "
                   "0, byte_stride +32 addresses layer 0"),
    "index and descriptor": (("%j", FORWARD_WALK), "the backward pass's read 0 is layer 0, "
                             "but the forward pass wrote layer 3 at step 3"),
}


@pytest.mark.parametrize("how", list(FORWARD_READS))
@pytest.mark.parametrize("wrong", [0, 1, 2])
def test_of_several_host_buffers_only_the_one_read_walking_forward_is_wrong(wrong, how):
    """Three host buffers in one program, every one read back layer 3 first but one: the
    proof flags that one, by name, and checks the others (a verdict per buffer, from that
    buffer's own accesses)."""
    read, says = FORWARD_READS[how]
    reads = [read if k == wrong else RIGHT for k in range(3)]
    proofs = addressing.prove(several_buffers(reads))
    assert [p.buffer.name for p in proofs] == ["stacked.0", "stacked.1", "stacked.2"]
    for k, proof in enumerate(proofs):
        if k == wrong:
            assert proof.verdict == addressing.WRONG, proof.detail
            assert proof.detail.startswith(says.format(k=k)), proof.detail
        else:
            assert (proof.verdict, proof.detail) == (addressing.CHECKED,
                                                     "read back layer 3 first: checked")


def test_several_host_buffers_all_read_back_in_reverse_are_all_checked():
    proofs = addressing.prove(several_buffers([RIGHT] * 3))
    assert [p.verdict for p in proofs] == [addressing.CHECKED] * 3


def test_what_it_cannot_follow_is_never_a_pass():
    (unknown_trip,) = addressing.prove(hand_written(trip=""))
    assert unknown_trip.verdict == addressing.UNVERIFIED
    assert unknown_trip.detail == "loop bwd has no known trip count"
    (three_reads,) = addressing.prove(hand_written(trip="3"))
    assert three_reads.verdict == addressing.UNVERIFIED
    assert three_reads.detail.startswith("4 writes and 3 reads of 4 layers")


def test_host_buffers_map_to_their_tags_and_a_stray_one_is_an_error():
    value = Tagged("query_proj", (8,), jnp.dtype(jnp.float32), 4, "layers")
    found = offload_proof.compiled_host_buffers(hand_written(), [value])
    assert list(found) == [("layers", "query_proj")] and found["layers", "query_proj"].holds
    with pytest.raises(offload_proof.PlacementError, match="no offloaded tag"):
        offload_proof.compiled_host_buffers(hand_written(), [])


def test_the_study_reports_a_step_that_reads_the_wrong_bytes():
    """What the study's compile says of the placement list of jax 0.10.2's program: a line
    naming the tag, the bytes it reads and the XLA issue; a program it cannot verify is
    reported as such, never as checked."""
    (wrong,) = addressing.prove((FIXTURES / "jax-0.10.2.hlo").read_text())
    value = Tagged("query_proj", (256, 512), jnp.dtype(jnp.float32), 4, "layers")
    lines = [memory_plan.TagLine(value, "offload", True, True, True, wrong)]
    (problem,) = printed.addressing_problems(lines)
    assert problem.startswith("layers query_proj: addressing WRONG: read 0")
    assert "openxla/xla #46231" in problem and printed.placement_lines(lines)[-1] == problem
    (unverified,) = addressing.prove(hand_written(trip=""))
    lines = [memory_plan.TagLine(value, "offload", True, True, True, unverified)]
    assert printed.placement_lines(lines)[-1] == ("layers query_proj: addressing CANNOT VERIFY: "
                                                  "loop bwd has no known trip count")


def _reads_walking_forward(policy, weights, x):
    """The probe's gradient as a jax that reads each offloaded layer's activation back from
    another layer would give it: the layers' gradients in the wrong order."""
    got = backend._probe_gradient(None, weights, x)
    return got if policy is None else got[::-1]


@pytest.mark.gpu_compile
def test_the_probes_offloading_program_keeps_its_value_in_host_memory():
    """Guards the class: a check that compares a thing with itself (the probe's offloading
    program keeping its tag on the device, so that host_reads_in_order compares a device
    gradient with a device gradient and passes on any jax), visible only in a GPU program
    (CPUs keep host placements on the device). The probe's own gradient with each policy
    host_reads_in_order gives it, compiled for one compile-only H200: offloading, its tag of
    every layer ([layers, 8, 128] f32, 4 x 4 KiB) is one stacked buffer in host memory, read
    back in reverse layer order, and all the compiled program's host bytes; kept, nothing is
    in host memory."""
    given = []

    def recorded(policy, weights, x):
        given.append((policy, jax.typeof(weights).shape, jax.typeof(x).shape))
        return backend._probe_gradient(policy, weights, x)

    assert backend.host_reads_in_order(recorded)
    (kept, shape, x_shape), (offloading, *_) = given
    devices = compile_only(GPUS["h200"], 1).devices
    replicated = jax.sharding.NamedSharding(jax.sharding.Mesh(devices[:1], ("x",)),
                                            jax.sharding.PartitionSpec())
    for policy, proofs, host in ((kept, 0, 0), (offloading, 1, 4 * shape[0] * 8 * 128)):
        compiled = jax.jit(backend._probe_gradient, static_argnums=0).trace(
            policy, *(jax.ShapeDtypeStruct(s, jnp.float32, sharding=replicated)
                      for s in (shape, x_shape))).lower().compile()
        found = addressing.prove(compiled.as_text())
        assert len(found) == proofs and all(p.verdict == addressing.CHECKED for p in found)
        assert all(p.buffer.shape.dims == (shape[0], 8, 128) for p in found)
        assert CompiledMemory.of(compiled).host == host


def test_a_gpu_run_refuses_a_jax_that_reads_the_wrong_bytes(monkeypatch):
    """What train.py does before step 1 on GPUs when the run offloads (runtime/setup.py's
    check_machine): its probe compares a scan's gradient with one offloaded tag against the
    gradient kept on the device, and a jax that fails it stops the run in one line naming the
    XLA issue and the first fixed jax. The probe passes here (a CPU keeps the offloaded value
    where it is) and fails on gradients read back in the wrong layer order. Where nothing is
    offloaded and on a CPU, no probe runs (compile-only GPUs never run check_machine: no
    step runs there)."""
    assert backend.host_reads_in_order()
    assert not backend.host_reads_in_order(_reads_walking_forward)
    gpu = Target("gpu", (9, 0), ("an H200",))

    def program(target):
        return types.SimpleNamespace(target=target, run=configs.RunConfig())

    monkeypatch.setattr(backend, "host_reads_in_order", lambda: False)
    with pytest.raises(ConfigError, match="wrong layers") as refused:
        runtime_setup.check_machine(program(gpu), offloads=True)
    assert "openxla/xla #46231" in str(refused.value) and "jax 0.11.1" in str(refused.value)
    monkeypatch.setattr(backend, "host_reads_in_order",
                        lambda: pytest.fail("the probe ran"))
    for target, offloads in [(gpu, False), (Target("cpu", None, ("a CPU",)), True)]:
        runtime_setup.check_machine(program(target), offloads)


# parameters=host: a layer scan's weights (four layers of f32[8]) arrive in host memory (an
# entry parameter); the forward loop reads layer i, the backward loop reads layer INDEX with
# XLA's descriptor READ and writes the gradient of layer 3 - j into a host buffer, which the
# update reads after the loop (here layer 0, outside any loop).
WEIGHTS = """HloModule weights, is_scheduled=true

%forward (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %weights = f32[4,8]{1,0:S(5)} get-tuple-element(%p), index=1
  %c0 = s32[] constant(0)
  %fetched = f32[1,8]{1,0} dynamic-slice(%weights, %i, %c0), dynamic_slice_sizes={1,8}, FETCH
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[4,8]{1,0:S(5)}) tuple(%next, %weights)
}

%bk (q: (s32[], f32[4,8], f32[4,8])) -> (s32[], f32[4,8], f32[4,8]) {
  %q = (s32[], f32[4,8]{1,0:S(5)}, f32[4,8]{1,0:S(5)}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %held = f32[4,8]{1,0:S(5)} get-tuple-element(%q), index=1
  %grads = f32[4,8]{1,0:S(5)} get-tuple-element(%q), index=2
  %last = s32[] constant(3)
  %reverse = s32[] subtract(%last, %j)
  %d0 = s32[] constant(0)
  %read = f32[1,8]{1,0} dynamic-slice(%held, INDEX, %d0), dynamic_slice_sizes={1,8}, READ
  %written = f32[4,8]{1,0:S(5)} dynamic-update-slice(%grads, %read, %reverse, %d0), WRITE
  %step = s32[] constant(1)
  %after = s32[] add(%j, %step)
  ROOT %back = (s32[], f32[4,8]{1,0:S(5)}, f32[4,8]{1,0:S(5)}) tuple(%after, %held, %written)
}

%up (u: (s32[], f32[4,8], f32[4,8])) -> (s32[], f32[4,8], f32[4,8]) {
  %u = (s32[], f32[4,8]{1,0:S(5)}, f32[4,8]{1,0:S(5)}) parameter(0)
  %n = s32[] get-tuple-element(%u), index=0
  %ws = f32[4,8]{1,0:S(5)} get-tuple-element(%u), index=1
  %gs = f32[4,8]{1,0:S(5)} get-tuple-element(%u), index=2
  %e0 = s32[] constant(0)
  %w1 = f32[1,8]{1,0} dynamic-slice(%ws, %n, %e0), dynamic_slice_sizes={1,8}, FETCH
  %g1 = f32[1,8]{1,0} dynamic-slice(%gs, %n, %e0), dynamic_slice_sizes={1,8}, FETCH
  %new = f32[1,8]{1,0} add(%w1, %g1)
  %put = f32[4,8]{1,0:S(5)} dynamic-update-slice(%ws, %new, %n, %e0), FETCH
  %inc = s32[] constant(1)
  %n1 = s32[] add(%n, %inc)
  ROOT %r = (s32[], f32[4,8]{1,0:S(5)}, f32[4,8]{1,0:S(5)}) tuple(%n1, %put, %gs)
}

%more (c: (s32[], f32[4,8])) -> pred[] {
  %c = (s32[], f32[4,8]{1,0:S(5)}) parameter(0)
  %k = s32[] get-tuple-element(%c), index=0
  %layers = s32[] constant(4)
  ROOT %below = pred[] compare(%k, %layers), direction=LT
}

%m.1 (c.1: (s32[], f32[4,8], f32[4,8])) -> pred[] {
  %c.1 = (s32[], f32[4,8]{1,0:S(5)}, f32[4,8]{1,0:S(5)}) parameter(0)
  %k.1 = s32[] get-tuple-element(%c.1), index=0
  %layers.1 = s32[] constant(4)
  ROOT %below.1 = pred[] compare(%k.1, %layers.1), direction=LT
}

ENTRY %main (w: f32[4,8]) -> f32[4,8] {
  %w = f32[4,8]{1,0:S(5)} parameter(0)
  %start = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0:S(5)}) tuple(%start, %w)
  %fwd = (s32[], f32[4,8]{1,0:S(5)}) while(%init), condition=%more, body=%forward, LOOP4
  %gradient = f32[4,8]{1,0:S(5)} custom-call(), custom_call_target="AllocateBuffer"
  %in = (s32[], f32[4,8]{1,0:S(5)}, f32[4,8]{1,0:S(5)}) tuple(%start, %w, %gradient)
  %bwd = (s32[], f32[4,8]{1,0:S(5)}, f32[4,8]{1,0:S(5)}) while(%in), condition=%m.1, body=%bk, LOOP4
  %held.1 = f32[4,8]{1,0:S(5)} get-tuple-element(%bwd), index=1
  %grads = f32[4,8]{1,0:S(5)} get-tuple-element(%bwd), index=2
  %g = (s32[], f32[4,8]{1,0:S(5)}, f32[4,8]{1,0:S(5)}) tuple(%start, %held.1, %grads)
  %upd = (s32[], f32[4,8]{1,0:S(5)}, f32[4,8]{1,0:S(5)}) while(%g), condition=%m.1, body=%up, LOOP4
  ROOT %updated = f32[4,8]{1,0:S(5)} get-tuple-element(%upd), index=1
}
"""


@pytest.mark.parametrize("index, read, verdict, says", [
    ("%reverse", RIGHT_WALK, addressing.CHECKED,
     "the forward pass reads layer 0 first, the backward pass layer 3 first, the update reads "
     "and writes each over, layer 0 first: checked"),
    # The descriptor walks forward, the index backward (openxla/xla #46231, for the weights):
    ("%reverse", FORWARD_WALK, addressing.WRONG,
     "read 4 (read, iteration 0 of loop bwd) means layer 3 (the loop passes index 3), but "
     "XLA's descriptor byte_offset 0, byte_stride +32 addresses layer 0"),
    # Both walk forward, in agreement: the backward pass's layers get layer 0's weights first.
    ("%j", FORWARD_WALK, addressing.WRONG,
     "not the forward pass reads layer 0 first, the backward pass layer 3 first, the update "
     "reads and writes each over, layer 0 first: the program's accesses are read 0, read 1, "
     "read 2, read 3, read 0, read 1, read 2, read 3, read 0, write 0,"),
])
def test_weights_in_host_memory_are_read_forward_then_backward(index, read, verdict, says):
    """parameters=host: the proof of a layer scan's weights and gradient in host memory
    (offload_proof.compiled_layer_weights), each half able to fail as the activations' can;
    the gradient, written in the backward order, checks whatever the weights' reads do."""
    hlo = (WEIGHTS.replace("INDEX", index).replace("READ", walk(read))
           .replace("FETCH", walk(FORWARD_WALK)).replace("WRITE", walk(RIGHT_WALK))
           .replace("LOOP4", loop("4")))
    (weight,) = offload_proof.compiled_layer_weights(hlo, {"layers": {"w": ((4, 8), "float32")}})
    assert (weight.scan, weight.name, weight.weights.buffer.name) == ("layers", "w", "w")
    assert weight.weights.verdict == verdict and weight.weights.detail.startswith(says), (
        weight.weights.detail)
    assert (weight.gradient.buffer.name, weight.gradient.verdict, weight.gradient.detail) == (
        "gradient", addressing.CHECKED, "the backward pass writes layer 3 first: checked")
