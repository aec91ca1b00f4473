"""preset=auto (runtime/auto.py): the candidates each family's rules give; a candidate over the
budget compiled and never timed; the fastest of given times trained; the neighbours one tag from
the best-ranked preset, each saving recomputation; a real CPU run within its budget; a resume
that takes the checkpoint's choice and measures nothing; nothing fitting, named."""

import json

import jax
import pytest

import configs
from conftest import SMALL, run_cli
from model import deepseek, llama
from offload import activations
from runtime import auto, fit as fits
from runtime import setup as runtime_setup
from runtime.own_program import CompiledMemory, GiB, size_words, step_flops
from trainer.program import UNROLLED_LAYERS, Program
from trainer.target import this_machine

# Every test here compiles the same programs (the session's compilation cache shares them): a
# layer loop (more layers than a CPU program unrolls), whose residuals are what the choice
# weighs, without NVFP4's emulation, which has no part in it and would double each compile.
TINY = ["llama405b-offload", *[w for w in SMALL if not w.startswith("model.n_layers=")],
        f"model.n_layers={UNROLLED_LAYERS + 1}", "quant=none", "preset=auto"]


def test_the_candidates_are_every_preset_of_the_family_and_no_checkpointing():
    names = lambda scans, fixed: [c.name for c in auto.presets(scans, fixed)]  # noqa: E731
    assert names(llama.SCANS, {}) == ["remat", "minimal", "qkv_offload", "minimal_offloaded",
                                      "none"]
    assert names(deepseek.SCANS, {}) == ["remat", "minimal", "qkv_offload", "minimal_offloaded",
                                         "dsv3_offload", "dsv3_device", "none"]
    # A fixed tag is in every candidate (no checkpointing has no tags to fix); placements that
    # come out the same are one candidate: remat with mlpwo kept is not minimal.
    fixed = {"layers.mlpwo": "offload"}
    found = auto.presets(llama.SCANS, fixed)
    assert [c.preset for c in found] == ["remat", "minimal", "qkv_offload", "minimal_offloaded"]
    assert all(c.placement["layers"]["mlpwo"] == "offload" for c in found)
    same = auto.presets(llama.SCANS, {"layers.query_proj": "offload",
                                      "layers.key_proj": "offload", "layers.value_proj": "offload"})
    assert "qkv_offload" not in [c.preset for c in same]  # remat with those is qkv_offload


@pytest.fixture(scope="module")
def tiny():
    """The Llama proxy, tiny, resolved with preset=auto; each placement compiled once."""
    setup = runtime_setup.resolve(TINY[0], TINY[1:], jax.devices())
    target, cache = this_machine(), {}

    def measure(candidate):
        key = json.dumps([candidate.placement, candidate.state], sort_keys=True)
        if key not in cache:
            program = Program(setup.model, runtime_setup.with_state(setup.run, candidate),
                              candidate.placement, target)
            cache[key] = CompiledMemory.of(program.compile_run()), program
        return cache[key]
    return setup, measure


def budget(device: int) -> fits.Budget:
    return fits.Budget(device, 2**40, f"{device} bytes", "host")


def test_a_candidate_over_the_budget_is_compiled_never_timed_and_the_fastest_given_is_chosen(
        tiny):
    setup, measure = tiny
    sizes = {c.name: measure(c)[0].device
             for c in auto.presets(llama.SCANS, {})}
    assert sizes["none"] > min(sizes.values())  # keeping every residual takes more
    limit = sizes["none"] - 1
    timed = []

    def timer(programs):
        timed.extend(programs)
        return [1.0 + (i == len(programs) - 2) * -0.5 for i in range(len(programs))]

    choice, program = auto.choose(setup, budget(limit), measure, timer, lambda _: None)
    compiled = {r.candidate.name: r for r in choice.rows}
    assert "none" in compiled and not compiled["none"].fits and compiled["none"].seconds is None
    fitting = [r for r in choice.rows if r.fits]
    assert len(timed) == len(fitting) and all(r.memory.device <= limit for r in fitting)
    assert choice.chosen == fitting[-2].candidate  # the one given 0.5 s
    assert program is measure(choice.chosen)[1]


def test_the_neighbours_are_one_tag_from_the_best_ranked_preset_and_recompute_less(tiny):
    setup, measure = tiny
    sizes = {c.name: measure(c)[0].device for c in auto.presets(llama.SCANS, {})}
    rows, programs = auto.compiled(setup, budget(sizes["none"] - 1), measure, lambda _: None)
    presets = [r for r in rows if not r.candidate.changes]
    near = rows[len(presets):]
    assert 0 < len(near) <= auto.NEIGHBOURS
    # The best-ranked is minimal or minimal_offloaded (fewest recomputed FLOPs); on a CPU both
    # keep the same tags on the device, and minimal moves nothing to host.
    base = next(r.candidate for r in presets if r.candidate.preset == near[0].candidate.preset)
    assert base.preset == "minimal"
    devices, own = len(jax.devices()), programs[rows.index(next(
        r for r in presets if r.candidate == base))]
    for row, program in zip(near, programs[len(presets):]):
        (key, where), = row.candidate.changes
        scan, _, tag = key.partition(".")
        assert row.candidate.placement == {scan: {**base.placement[scan], tag: where}}
        assert base.placement[scan].get(tag, "remat") != where
        # Keeping a recomputed tag: the traced step does fewer matrix products.
        assert (step_flops(program.traced.jaxpr, devices)
                < step_flops(own.traced.jaxpr, devices))


def test_a_cpu_run_with_preset_auto_trains_a_candidate_within_its_budget(tiny, tmp_path, capsys):
    """A budget the no-checkpointing program does not fit: the run trains another, its table
    in auto.json and the header, its placement in config.json; resumed, it takes that choice
    and compiles no candidate."""
    setup, measure = tiny
    none = measure(auto.Candidate("none", (), None))[0]
    words = [*TINY, "auto_steps=1", f"fit_memory={(none.device - 1) / GiB!r}",
             "checkpoint_every=1"]
    code, out, err = run_cli(words, tmp_path, capsys)
    assert code == 0, err
    run_dir = next(tmp_path.iterdir())
    record = json.loads((run_dir / "auto.json").read_text())
    chosen = next(c for c in record["candidates"] if c["candidate"] == record["chosen"])
    assert chosen["fits"] and chosen["device_bytes"] < none.device
    assert json.loads((run_dir / "config.json").read_text())["placement"] == chosen["placement"]
    assert f"chosen by preset=auto: {record['chosen']}, the fastest of" in out
    assert "timed over 1 step(s) each" in out
    assert "the cpu backend drops host placements" in out
    code, out, err = run_cli([*words, f"resume={run_dir / 'checkpoints' / '1'}"], tmp_path,
                             capsys)
    assert code == 0, err
    assert "preset=auto: compiled" not in out and "the resumed checkpoint's choice" in out
    assert f"chosen by preset=auto: {record['chosen']} (" in out


def test_nothing_fitting_names_the_smallest_candidate(tiny):
    """The run stops with this line before its folder is made (a FitError: one line, exit
    status 2, as tests/test_fit.py holds for the fit scale; train()'s stages:
    tests/test_reading.py)."""
    setup, measure = tiny
    with pytest.raises(fits.FitError) as refused:
        auto.compiled(setup, budget(2**17), measure, lambda _: None)
    sizes = {c.name: measure(c)[0].device for c in auto.presets(llama.SCANS, {})}
    line = str(refused.value)
    assert line.startswith("preset=auto: no candidate fits; the smallest, ")
    named = line.split("the smallest, ")[1].split(",")[0]
    assert sizes[named] == min(sizes.values())
    assert f"needs {size_words(sizes[named])} per device of {2**17} bytes and " in line


def test_an_unknown_preset_is_told_auto_too():
    with pytest.raises(ValueError, match=r"none, auto$"):
        activations.resolve("fastest", {}, llama.SCANS)


def test_the_states_place_is_a_candidate_where_the_run_keeps_part_of_it_on_host():
    """Each part of the state the run keeps on host, unless the command line set it, is tried
    on the device too (the run's own place first); a run with the whole state on the device
    has one place; candidates with the weights on host never drop checkpointing (they need a
    policy), and each candidate's name says what of it is on host."""
    run = configs.RunConfig(optimizer_state="host", parameters="host")
    both, one = (("optimizer_state", "host"), ("parameters", "host")), (
        ("optimizer_state", "host"), ("parameters", "device"))
    assert auto.state_options(run, set()) == [
        both, (("optimizer_state", "device"), ("parameters", "host")), one,
        (("optimizer_state", "device"), ("parameters", "device"))]
    assert auto.state_options(run, {"optimizer_state"}) == [both, one]
    assert auto.state_options(configs.RunConfig(), set()) == [()]
    found = auto.presets(llama.SCANS, {}, [both, one])
    assert {c.state for c in found} == {both, one}
    assert all(c.placement is not None for c in found if c.state == both)
    assert [c.preset for c in found if c.state == one] == [
        c.preset for c in auto.presets(llama.SCANS, {})]
    assert found[0].name == f"{found[0].preset} optimizer_state=host parameters=host"


def test_preset_auto_trains_the_state_where_its_chosen_candidate_keeps_it(tmp_path, capsys):
    """llama70b-8xh200 keeps its optimizer state on host (the experiment's, not the command
    line's): preset=auto compiles and times each preset with the state on host and on the
    device, carrying one state from program to program, and the run trains the chosen one's
    state placement (config.json, the header); resumed, it takes that choice again."""
    words = ["llama70b-8xh200", *SMALL, "preset=auto", "auto_steps=1", "quant=none",
             "checkpoint_every=1", "steps=2"]
    code, out, err = run_cli(words, tmp_path, capsys)
    assert code == 0, err
    run_dir = next(tmp_path.iterdir())
    record = json.loads((run_dir / "auto.json").read_text())
    states = [c["state"]["optimizer_state"] for c in record["candidates"]]
    assert set(states) == {"host", "device"} and states.count("host") == states.count("device")
    assert all(c["median_step_s"] for c in record["candidates"])
    chosen = record["state"]["optimizer_state"]
    assert json.loads((run_dir / "config.json").read_text())["run"]["optimizer_state"] == chosen
    assert f"optimizer state on {chosen}, layers' weights on device" in out
    code, out, err = run_cli([*words, f"resume={run_dir / 'checkpoints' / '1'}"], tmp_path,
                             capsys)
    assert code == 0, err
    assert "the resumed checkpoint's choice" in out
    assert f"optimizer state on {chosen}, layers' weights on device" in out
