"""The fit scale (runtime/fit.py) on 8 CPU devices with a budget (fit_memory=): the layer count
a run takes is the largest whose compiled program fits and one more does not, each checked by
compiling those programs here, apart from the search; the reductions where the fewest layers do
not fit; the header; a resume; a comparison's common fit; its bad input."""

import functools
import json
import re

import jax
import pytest

import configs
import train
from conftest import run_cli
from runtime import backend, fit as fits
from runtime import setup as runtime_setup
from runtime.comparison import FIT_LINE
from runtime.own_program import GiB, CompiledMemory, size_words
from trainer.program import Program
from trainer.target import this_machine

# The study's Llama row at fit scale, its layer narrowed so that a CPU compiles and runs it.
LLAMA = ["scale=fit", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=16", "model.d_ff=128", "seq=32", "quant=none"]
SMALL_VOCAB = [*LLAMA, "model.vocab=512"]
# DeepSeek's, its MLA and experts as narrow; the 256 routed experts and their top-8 kept.
DEEPSEEK = ["scale=fit", "model.d_model=64", "model.n_heads=2", "model.q_lora_rank=16",
            "model.kv_lora_rank=16", "model.qk_nope_dim=8", "model.qk_rope_dim=8",
            "model.v_head_dim=8", "model.d_ff=64", "model.moe_d_ff=16", "model.vocab=512",
            "seq=32", "per_device_batch=1"]


@functools.cache
def _compiled(name: str, words: tuple[str, ...]) -> CompiledMemory:
    setup = runtime_setup.resolve(name, ["fit_memory=1000", *words], jax.devices())
    return CompiledMemory.of(Program(setup.model, setup.run, setup.placement,
                                     this_machine()).compile_run())


def compiled(name: str, words: list[str]) -> CompiledMemory:
    """The memory of `name`'s step with `words`, compiled here for this machine's devices (at
    fit scale, its layer count given: no budget applies); once per worker (tests share them)."""
    return _compiled(name, tuple(words))


def between(a: int, b: int) -> str:
    """fit_memory= halfway between two byte counts."""
    return f"fit_memory={(a + b) / 2 / GiB!r}"


def layers(n: int) -> list[str]:
    return [f"model.n_layers={n}"]


def test_a_fit_run_trains_the_most_layers_whose_compiled_program_fits(tmp_path, capsys):
    """A budget halfway between the programs of 5 and 6 layers: the run trains 5, and its
    header says what was kept and reduced, the machine, the budget, and the bytes of 5 and 6
    layers; the run folder records the fit; a few compiles find it."""
    five, six = (compiled("llama405b-offload", [*SMALL_VOCAB, *layers(n)]) for n in (5, 6))
    assert five.device < six.device
    code, out, err = run_cli(["llama405b-offload", *SMALL_VOCAB, between(five.device, six.device),
                              "steps=2"], tmp_path, capsys)
    assert code == 0, err
    assert "FIT -- the experiment's own layers, as many as fit this machine" in out
    assert ("kept: the experiment's layer, sequence, micro batch per device, dtypes, NVFP4, "
            "placement and XLA flags (below), with the command line's model.d_model=64 "
            "model.n_heads=4 model.n_kv_heads=2 model.head_dim=16 model.d_ff=128 seq=32 "
            "quant=none model.vocab=512; reduced: layers 5 of 126\n") in out
    assert "machine: 8 x cpu; budget per device " in out
    assert re.search(r"budget per device \d+ \wiB \(fit_memory=[\d.e-]+ GiB\)", out)
    assert (f"5 layers take {size_words(five.device)} per device and 0 KiB in host memory "
            f"(compiled); one more layer does not fit: {size_words(six.device)}") in out
    assert int(re.search(r"found in (\d+) compiles", out)[1]) <= 5
    (run_dir,) = tmp_path.glob("llama405b-offload-fit-*")
    config = json.loads((run_dir / "config.json").read_text())
    assert config["fit"] == {"model.n_layers": "5"} and config["model"]["n_layers"] == 5
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["compiled_device_bytes"] == five.device


def test_a_resumed_fit_run_takes_its_checkpoints_fit_without_a_search(tmp_path, capsys):
    five, six = (compiled("llama405b-offload", [*SMALL_VOCAB, *layers(n)]) for n in (5, 6))
    args = ["llama405b-offload", *SMALL_VOCAB, between(five.device, six.device), "steps=3"]
    assert run_cli([*args, "checkpoint_every=2"], tmp_path, capsys)[0] == 0
    (step,) = tmp_path.glob("llama405b-offload-fit-*/checkpoints/2")
    code, out, err = run_cli([*args, f"resume={step}"], tmp_path, capsys)
    assert code == 0, err
    assert "reduced: layers 5 of 126" in out and "found in" not in out
    assert "the checkpoint's (resumed), checked in 1 compile: 5 layers" in out
    assert "resumed from" in out and "step 3/3" in out


def test_a_layer_count_past_the_fit_is_one_line_naming_how_many_fit(tmp_path, capsys):
    five, six = (compiled("llama405b-offload", [*SMALL_VOCAB, *layers(n)]) for n in (5, 6))
    seven = compiled("llama405b-offload", [*SMALL_VOCAB, *layers(7)])
    code, out, err = run_cli(["llama405b-offload", *SMALL_VOCAB, *layers(7),
                              between(five.device, six.device)], tmp_path, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: model.n_layers=7 does not fit: {size_words(seven.device)} "
                          "per device of ") and err.endswith("; 5 layers fit\n")
    assert not list(tmp_path.iterdir())


def test_a_budget_below_the_fewest_layers_is_one_line_naming_what_a_layer_needs(
        tmp_path, capsys):
    """Below the program of two layers (each layer scan keeps two: fewer are not offloaded),
    with the vocabulary the command line set: one line, what one more layer needs (the
    difference of the programs of 2 and 3 layers, compiled here), exit 2, nothing written."""
    two, three = (compiled("llama405b-offload", [*SMALL_VOCAB, *layers(n)]) for n in (2, 3))
    code, out, err = run_cli(["llama405b-offload", *SMALL_VOCAB,
                              f"fit_memory={two.device / 2 / GiB!r}"], tmp_path, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: even 2 layers do not fit: {size_words(two.device)} per "
                          "device of ")
    assert f"one layer needs {size_words(three.device - two.device)} per device" in err
    assert not list(tmp_path.iterdir())


def test_where_two_layers_do_not_fit_the_vocabulary_is_reduced(capsys):
    """A budget halfway between the programs of two layers with 4,096 and 5,120 words of
    vocabulary (and below the experiment's 128,256): the fit takes 4,096 (a CPU keeps no
    optimizer state in host memory to move), then as many layers as fit with it: that many
    fit and one more do not, compiled here."""
    small, large = (compiled("llama405b-offload", [*LLAMA, *layers(2), f"model.vocab={v}"])
                    for v in (4096, 5120))
    budget = between(small.device, large.device)
    assert train.main(["fit", "llama405b-offload", *LLAMA, budget]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    count = int(re.search(r"model.n_layers=(\d+)", line)[1])
    assert line.endswith(f"model.n_layers={count} model.vocab=4096"), line
    limit = (small.device + large.device) / 2
    assert compiled("llama405b-offload", [*LLAMA, *layers(count), "model.vocab=4096"]).device \
        <= limit < compiled("llama405b-offload",
                            [*LLAMA, *layers(count + 1), "model.vocab=4096"]).device


def test_where_two_moe_layers_do_not_fit_the_routed_experts_are_reduced(capsys):
    """DeepSeek on 8 CPU devices (its expert degree, 8) at its fewest layers, set here (4:
    its dense layers first, two, then two MoE ones): a budget halfway between that program
    with 24 and with 32 routed experts (steps of 8: the groups and the expert axis divide
    them; 16 the fewest, two per group) takes 24, top-8 and the expert width kept."""
    fewest = [*DEEPSEEK, *layers(4)]
    small, large = (compiled("deepseek671b-offload", [*fewest, "model.n_dense_layers=2",
                                                      f"model.n_experts={e}"]).device
                    for e in (24, 32))
    assert train.main(["fit", "deepseek671b-offload", *fewest, between(small, large)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.endswith("model.n_layers=4 model.n_dense_layers=2 model.n_experts=24"), line


def test_the_search_compiles_each_program_once():
    """A fit searched on a stand-in for the compiler (memory linear in layers, experts and
    vocabulary) at DeepSeek's full size, where the fewest layers fit only with fewer experts:
    no two programs it asks for are the same (a reduction's last value is the whole: the
    program with no reduction), and it takes the most experts and layers that fit."""
    experiment = configs.get("deepseek671b-offload")
    model, run = experiment.model, experiment.run
    asked = []

    def measure(words):
        said = {"n_layers": model.n_layers, "n_dense_layers": model.n_dense_layers,
                "n_experts": model.n_experts, "vocab": model.vocab}
        said.update({k.removeprefix("model."): int(v) for k, v in words.items()})
        asked.append(tuple(said.values()))
        device = said["n_layers"] * said["n_experts"] * GiB + said["vocab"]
        return CompiledMemory(device, 0, 0, 0, 0), None

    budget = fits.Budget(int(5.5 * 64 * GiB), 2**40, "", "")
    fit, _ = fits.search(model, run, budget, measure, set(), 64, False, model.n_layers)
    assert fit.words == {"model.n_layers": "5", "model.n_dense_layers": "3",
                         "model.n_experts": "64"}
    assert len(asked) == len(set(asked)) == fit.compiles


def test_a_comparisons_fit_is_one_every_row_fits(capsys):
    """`train.py fit llama405b-compare`: the rows fitted one after another, each after the
    first to at most the fit so far; the last line is the fit every row fits (here on a CPU the
    offload rows keep Q/K/V on the device, more than the baseline's): at it every row's
    program fits, and one more layer does not fit some row's (compiled here)."""
    five, six = (compiled("llama405b-baseline", [*SMALL_VOCAB, *layers(n)]) for n in (5, 6))
    budget = (five.device + six.device) / 2
    assert train.main(["fit", "llama405b-compare", *SMALL_VOCAB, f"fit_memory={budget / GiB!r}"]
                      ) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(FIT_LINE)
    count = int(re.fullmatch(FIT_LINE + r"model.n_layers=(\d+)", last)[1])
    rows = ("llama405b-baseline", "llama405b-offload", "llama405b-offload-nolhs",
            "llama405b-offload-pipelined")
    assert all(compiled(row, [*SMALL_VOCAB, *layers(count)]).device <= budget for row in rows)
    assert any(compiled(row, [*SMALL_VOCAB, *layers(count + 1)]).device > budget for row in rows)


def test_a_fits_mesh_is_fsdp_over_the_machine_and_the_rows_expert_degree_where_it_divides():
    deepseek, llama = (configs.get(n) for n in ("deepseek671b-offload", "llama405b-offload"))
    mesh = deepseek.run.mesh  # expert 8 of 256 experts
    assert [(m.fsdp, m.expert) for m in (runtime_setup.fit_mesh(deepseek.model, mesh, n)
                                         for n in (1, 4, 8, 12, 16))] == [
        (1, 1), (1, 4), (1, 8), (3, 4), (2, 8)]
    assert runtime_setup.fit_mesh(llama.model, llama.run.mesh, 8).expert == 1


def test_a_dense_layer_count_the_command_line_set_is_in_every_count_tried():
    """DeepSeek's dense layers, first: a fit reduces them with the layers (two of its three at
    four layers), unless the command line set them; then every count tried keeps them and at
    least two MoE layers."""
    model = configs.get("deepseek671b-offload").model  # 3 dense of 61
    words, counts = fits.layer_words(model, set(), 61)
    assert counts[0] == 4 and words(4) == {"model.n_layers": "4", "model.n_dense_layers": "2"}
    words, counts = fits.layer_words(model, {"model.n_dense_layers"}, 61)
    assert counts[0] == 5 and words(5) == {"model.n_layers": "5"}


def test_the_budget_is_the_pool_less_the_margin_and_the_pinned_host_memory_shared(monkeypatch):
    budget = fits.budget(0.0, 100 * GiB, 64 * GiB, 8)
    assert (budget.device, budget.host) == (90 * GiB, int(8 * GiB * 0.9))
    assert fits.budget(2.5, None, 64 * GiB, 1).device == int(2.5 * GiB)
    assert backend.default_host_limit_gib(2048 * GiB) == 1536
    assert backend.default_host_limit_gib(32 * GiB) == 64  # never below XLA's own
    monkeypatch.setenv(backend.HOST_LIMIT_VARIABLE, "2")
    assert backend.host_limit() == min(2 * GiB, backend.host_memory())
    monkeypatch.setenv(backend.HOST_LIMIT_VARIABLE, "lots")
    with pytest.raises(backend.BackendError):
        backend.host_limit()


@pytest.mark.parametrize("budget, weights, fixed, reduced, layers", [
    (200, 2, set(), {"optimizer_state": "host"}, 61),
    (100, 2, set(), {"optimizer_state": "host", "parameters": "host"}, 61),
    (40, 0, set(), {"optimizer_state": "host"}, 40),
    (10, 2, set(), {"optimizer_state": "host", "parameters": "host"}, 10),
    (10, 2, {"parameters"}, {"optimizer_state": "host", "model.n_experts": "192"}, 4)])
def test_the_state_goes_to_host_memory_where_more_layers_fit_the_moments_then_the_weights(
        budget, weights, fixed, reduced, layers):
    """A fit searched on a stand-in for the compiler at DeepSeek's full size (61 layers, the
    fewest 4), on a machine with pinned host memory: a layer's program 1 unit, its moments 2,
    its FP32 weights and gradients `weights`; the routed experts scale it. Each move to host is
    kept where more layers fit with it: the moments first (at 200 units all 61 fit, and the
    weights stay); then the weights (at 100, 33 layers become 61); not where they add none
    (weights 0: 40 layers either way). Where the fewest fit only with the whole state on host
    (10), it goes there before any expert is dropped; a fixed word is never moved, and the
    experts go instead (64 at a time: 3 units a layer at 256, 2.25 at 192)."""
    experiment = configs.get("deepseek671b-offload")
    model, run = experiment.model, experiment.run

    def measure(words):
        per_layer = (1 + 2 * (words.get("optimizer_state") != "host")
                     + weights * (words.get("parameters") != "host"))
        experts = int(words.get("model.n_experts", model.n_experts)) / model.n_experts
        count = int(words.get("model.n_layers", model.n_layers))
        return CompiledMemory(int(count * per_layer * experts * GiB), 0, 0, 0, 0), None

    fit, _ = fits.search(model, run, fits.Budget(budget * GiB, 2**40, "", ""), measure, fixed,
                         64, True, model.n_layers)
    assert {k: v for k, v in fit.words.items() if not k.startswith("model.n_")
            or k == "model.n_experts"} == reduced
    assert fit.layers == layers
