"""Training on prepared text: the held-out loss (what it averages, over which windows, the
same at every evaluation and across a resume), TensorBoard's copy of the metrics, a run that
learns, and `python train.py sample` (data/tokens.py, trainer/program.py's Program.evaluate,
runtime/sample.py)."""

import json
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from data import prepare
from data.tokens import PreparedTokens, TokenFile
from model import llama
from runtime import sample
from conftest import run_cli
from test_data import DAMAGES

SEQ, BATCH, EVAL_BATCHES = 32, 16, 2


def markov_documents(count: int, seed: int = 0) -> list[str]:
    """Documents of 60 made-up words in which each word is followed by one of two others:
    about ln 2 nats of surprise per word for a model that reads the context, ln 60 for one
    that does not."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list("bcdfghklmnprstvz"), 2)) + rng.choice(list("aeiou"))
             for _ in range(60)]
    nexts = rng.integers(0, len(words), (len(words), 2))
    documents = []
    for _ in range(count):
        word, text = rng.integers(len(words)), []
        for _ in range(rng.integers(150, 250)):
            text.append(words[word])
            word = nexts[word, rng.integers(2)]
        documents.append(" ".join(text) + ".\n")
    return documents


def unigram_entropy(path) -> float:
    """-sum p log p of the token frequencies of a split, in float64: the test's own sum."""
    counts = np.bincount(np.fromfile(path, np.uint16)).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@pytest.fixture(scope="module")
def markov(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("markov")
    for i, text in enumerate(markov_documents(40)):
        (folder / "text").mkdir(exist_ok=True)
        (folder / "text" / f"{i:02d}.txt").write_text(text)
    prepare.prepare(prepare.parse([str(folder / "text"), f"out={folder / 'prepared'}",
                                   "tokenizer=bpe:320", "val_fraction=0.2"]))
    return str(folder / "prepared")


def tiny(markov: str, *more: str) -> list[str]:
    """A small Llama (2 layers, 64 wide) on the prepared text, 8 devices x 2 sequences."""
    return ["shakespeare", f"data.path={markov}", "model.d_model=64", "model.n_layers=2",
            "model.n_heads=2", "model.n_kv_heads=2", "model.head_dim=32", "model.d_ff=128",
            "model.vocab=320", f"seq={SEQ}", f"global_batch={BATCH}",
            f"eval_batches={EVAL_BATCHES}", *more]


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(markov, tmp_path_factory):
    """40 steps with an evaluation every 20 and TensorBoard on: the run folder."""
    import train
    out = tmp_path_factory.mktemp("runs")
    code = train.main(tiny(markov, "steps=40", "eval_every=20", "checkpoint_every=40",
                           "optimizer.lr=1e-2", "optimizer.warmup_steps=5", "tensorboard=true",
                           f"out_dir={out}"))
    assert code == 0
    (run_dir,) = out.iterdir()
    return run_dir


def test_a_few_dozen_steps_take_the_val_loss_below_the_unigram_entropy(trained, markov):
    summary = json.loads((trained / "summary.json").read_text())
    entropy = unigram_entropy(f"{markov}/train.bin")
    assert summary["unigram_entropy"] == pytest.approx(entropy, rel=1e-12)
    evaluated = [r for r in records(trained) if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [20, 40]
    # Below what ignoring the context reaches, by a margin no unigram model can close.
    assert summary["eval_loss"] == evaluated[-1]["eval_loss"] < entropy - 1.0, (summary, entropy)
    assert summary["eval_perplexity"] == pytest.approx(np.exp(summary["eval_loss"]))


def test_the_eval_loss_is_the_cross_entropy_of_the_models_logits_on_fixed_windows(
        trained, markov):
    """The last evaluation, recomputed: the checkpoint's parameters, llama.forward's logits on
    one device and a float64 numpy cross-entropy, over windows the test checks are val.bin's,
    evenly spread from its first token to its last window."""
    model = sample.Model(str(trained))
    val = np.fromfile(f"{markov}/val.bin", np.uint16)
    source = PreparedTokens(markov, "auto", 320, 0, SEQ).val
    windows = np.concatenate([source.eval_batch(i, BATCH, SEQ, EVAL_BATCHES)
                              for i in range(EVAL_BATCHES)])
    starts = [next(s for s in range(len(val) - SEQ) if np.array_equal(val[s:s + SEQ + 1], w))
              for w in windows]
    assert starts[0] == 0 and starts[-1] == len(val) - SEQ - 1
    assert np.ptp(np.diff(starts)) <= 1  # evenly spread (the spacing rounded)
    logits, _ = llama.forward(model.params, jnp.asarray(windows[:, :-1]), model.cfg)
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    log_z = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    targets = windows[:, 1:]
    losses = log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    want = losses.mean()
    got = json.loads((trained / "summary.json").read_text())["eval_loss"]
    assert abs(got - want) <= 2e-6 * want, (got, want)


def tensorboard_scalars(folder) -> dict[str, dict[int, float]]:
    """The event files' scalars, tag -> {step: value}, read with tensorboardX's own record
    checksum and event protocol buffer."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c
    scalars: dict[str, dict[int, float]] = {}
    for file in sorted(folder.glob("events.out.tfevents.*")):
        data, at = file.read_bytes(), 0
        while at < len(data):
            header = data[at:at + 8]
            (length,) = struct.unpack("Q", header)
            body = data[at + 12:at + 12 + length]
            assert struct.unpack("I", data[at + 8:at + 12])[0] == masked_crc32c(header)
            assert struct.unpack("I", data[at + 12 + length:at + 16 + length])[0] == \
                masked_crc32c(body)
            at += 16 + length
            event = event_pb2.Event.FromString(body)
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_holds_the_jsonl_metrics(trained):
    scalars = tensorboard_scalars(trained / "tensorboard")
    expected: dict[str, dict[int, float]] = {}
    for record in records(trained):
        for name, value in record.items():
            if name != "step":
                expected.setdefault(name, {})[record["step"]] = np.float32(value)
    assert set(expected) >= {"loss", "grad_norm", "step_s", "eval_loss", "eval_perplexity"}
    assert scalars == expected


def test_greedy_sampling_follows_the_models_own_logits(trained):
    """At temperature 0 each new token is the argmax of the model's logits after the tokens
    before it: read here off one unpadded forward of the whole text (causal: position t sees
    tokens 0..t), where sampling ran a padded window per token."""
    model = sample.Model(str(trained))
    prompt = [model.end_of_text, *model.tokenizer.encode("ba", add_special_tokens=False).ids]
    greedy = sample.generate(model, "ba", 12, temperature=0, top_k=0, seed=0)
    logits, _ = llama.forward(model.params, jnp.asarray([prompt + greedy]), model.cfg)
    best = np.argmax(np.asarray(logits[0])[:, :320], axis=-1)
    assert greedy == best[len(prompt) - 1:-1].tolist()
    drawn = [sample.generate(model, "ba", 16, temperature=1.5, top_k=0, seed=s)
             for s in (1, 1, 2, 3)]
    assert drawn[0] == drawn[1]  # the same seed, the same text
    assert len({tuple(d) for d in drawn}) == 3  # other seeds, other draws


def test_the_eval_windows_are_the_same_at_every_evaluation_and_across_a_resume(
        markov, tmp_path, capsys, monkeypatch):
    """4 steps evaluated every 2, then steps 3-4 resumed from the step-2 checkpoint: each
    evaluation reads the same windows, and the resumed run's step-4 eval loss is the
    uninterrupted one's, exactly."""
    read = []
    eval_batch = TokenFile.eval_batch
    monkeypatch.setattr(TokenFile, "eval_batch", lambda self, *a: read.append(
        eval_batch(self, *a)) or read[-1])
    args = tiny(markov, "steps=4", "eval_every=2", "checkpoint_every=2", "keep=2")
    code, _, err = run_cli(args, tmp_path / "runs", capsys)
    assert code == 0, err
    (whole,) = (tmp_path / "runs").iterdir()
    code, _, err = run_cli([*args, f"resume={whole / 'checkpoints' / '2'}"], tmp_path / "runs",
                           capsys)
    assert code == 0, err
    (resumed,) = set((tmp_path / "runs").iterdir()) - {whole}
    assert len(read) == 3 * EVAL_BATCHES  # steps 2 and 4, then the resumed run's 4
    for evaluation in (1, 2):
        for index in range(EVAL_BATCHES):
            np.testing.assert_array_equal(read[evaluation * EVAL_BATCHES + index], read[index])
    assert len({r.tobytes() for r in read}) == EVAL_BATCHES  # (the batches differ)
    whole_eval = {r["step"]: r["eval_loss"] for r in records(whole) if "eval_loss" in r}
    resumed_eval = {r["step"]: r["eval_loss"] for r in records(resumed) if "eval_loss" in r}
    assert list(whole_eval) == [2, 4] and resumed_eval == {4: whole_eval[4]}


def test_eval_every_needs_a_val_split(tmp_path, capsys):
    code, out, err = run_cli(["llama405b-offload", "eval_every=5"], tmp_path, capsys)
    assert code == 2 and err.count("\n") == 1 and "needs a val split" in err
    assert not list(tmp_path.iterdir())


def test_sample_needs_a_checkpoint_and_a_tokenizer(tmp_path, capsys, monkeypatch):
    """A run on synthetic tokens, checkpointed under a relative out_dir (as `runs`, the
    default, is): sample finds its checkpoint and says it has no tokenizer."""
    import train
    assert train.main(["sample", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    monkeypatch.chdir(tmp_path)
    code = train.main(["shakespeare", "data.path=", "model.vocab=320", "model.d_model=64",
                       "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2",
                       "model.head_dim=32", "model.d_ff=128", f"seq={SEQ}", "global_batch=8",
                       "steps=1", "eval_every=0", "out_dir=relative"])
    assert code == 0, capsys.readouterr().err
    (run_dir,) = (tmp_path / "relative").iterdir()
    assert (run_dir / "checkpoints" / "1").is_dir()
    assert train.main(["sample", str(run_dir.relative_to(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "synthetic tokens: there is no tokenizer" in err


def test_sample_latest_names_the_checkpoint_it_found(trained, tmp_path, capsys, monkeypatch):
    """`latest` passes over a newer run folder that saved no checkpoint (as the study's rows
    save none unless asked): the text comes from the older run, and the first line says so."""
    import train
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / trained.name).symlink_to(trained)
    (runs / "llama405b-offload-proxy-29991231-235959").mkdir()  # newer, no checkpoints/
    monkeypatch.chdir(tmp_path)
    assert train.main(["sample", "latest", "tokens=2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"sampled from runs/{trained.name}/checkpoints/40, "), first


SAMPLE_MISTAKES = {
    "no run": [], "a flag for the run": ["--latest"], "key=value first": ["tokens=5"],
    "unknown key": ["latest", "top_p=0.9"], "a word that is not key=value": ["latest", "ROMEO"],
    "not a number": ["latest", "tokens=many"], "no tokens": ["latest", "tokens=0"],
    "negative temperature": ["latest", "temperature=-1"], "negative top_k": ["latest", "top_k=-5"],
    "negative seed": ["latest", "seed=-1"], "infinite temperature": ["latest", "temperature=inf"],
    "temperature not a number": ["latest", "temperature=nan"],
    "top_k not a number": ["latest", "top_k=1.5"], "seed not a number": ["latest", "seed=x"],
}


@pytest.mark.parametrize("args", SAMPLE_MISTAKES.values(), ids=SAMPLE_MISTAKES)
def test_sample_mistakes_are_one_line_before_any_checkpoint_is_read(args, tmp_path, capsys,
                                                                   monkeypatch):
    import train
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sample, "Model", lambda run: pytest.fail("a checkpoint was looked for"))
    assert train.main(["sample", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert not list(tmp_path.iterdir())


def test_a_sample_setting_not_a_number_says_which_and_what_it_takes(capsys):
    import train
    assert train.main(["sample", "latest", "tokens=abc"]) == 2
    assert capsys.readouterr().err == "error: sample: tokens='abc': expected int\n"


@pytest.mark.parametrize("damage", [*DAMAGES, "tokenizer.json cut short"])
def test_sample_checks_the_folder_as_training_does(damage, trained, markov, capsys):
    """The folder the run trained on, damaged after it: one line, as training says it."""
    import train
    folder = Path(markov)
    kept = {f: f.read_bytes() for f in folder.iterdir()}
    cut = (lambda f: (f / "tokenizer.json").write_bytes(kept[f / "tokenizer.json"][:100]),
           "does not load")
    change, said = DAMAGES.get(damage, cut)
    try:
        change(folder)
        assert train.main(["sample", str(trained), "tokens=1"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: ") and err.count("\n") == 1, err
        assert said in err, err
    finally:
        for file, data in kept.items():
            file.write_bytes(data)


def test_draws_follow_softmax_of_the_logits_over_the_temperature_among_the_top_k():
    """Draw frequencies against the float64 softmax(logits / T) over the k largest logits,
    each within 5 binomial standard deviations (a fixed seed: the same draws every run)."""
    logits = np.array([2.0, 1.6, 1.3, 1.1, 0.3, -2.0])
    temperature, top_k, n = 0.6, 4, 10_000
    rng = np.random.default_rng(0)
    counts = np.bincount([sample.choose(logits, temperature, top_k, rng) for _ in range(n)],
                         minlength=len(logits))
    kept = np.argsort(logits)[-top_k:]
    want = np.zeros(len(logits))
    want[kept] = np.exp((logits[kept] - logits.max()) / temperature)
    want /= want.sum()
    sigma = np.sqrt(n * want * (1 - want))
    assert np.all(np.abs(counts - n * want) <= 5 * sigma), (counts, n * want)
    assert counts[want == 0].sum() == 0


def test_top_k_1_is_the_most_likely_token_at_any_temperature():
    rng = np.random.default_rng(1)
    for _ in range(50):
        logits = rng.normal(size=40)
        assert sample.choose(logits, 1.0, 1, rng) == np.argmax(logits)


def test_a_greedy_continuation_past_the_window_follows_the_last_windows_logits(trained):
    """40 greedy tokens after a short prompt, longer than the model's 32-token window: each
    one past it is the argmax of the model's logits on the 32 tokens just before it."""
    model = sample.Model(str(trained))
    prompt = [model.end_of_text, *model.tokenizer.encode("ba", add_special_tokens=False).ids]
    ids = prompt + sample.generate(model, "ba", 40, temperature=0, top_k=0, seed=0)
    positions = range(SEQ, len(ids))  # a full window of tokens before each
    windows = np.array([ids[p - SEQ:p] for p in positions])
    logits, _ = llama.forward(model.params, jnp.asarray(windows), model.cfg)
    best = np.argmax(np.asarray(logits)[:, -1, :320], axis=-1)
    assert [ids[p] for p in positions] == best.tolist()
