"""Text to tokens (`python train.py prepare`): the tokenizer's own ids, split by document,
in nanoGPT's format; and the prepared folder's checks (data/prepare.py, data/tokens.py)."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from data import prepare, tokenizer as tokenizers
from data.tokens import DataError, PreparedTokens, TokenFile, read_meta

# The test's own text: twelve documents, with what a tokenizer must round-trip (accents, an
# emoji, runs of blank lines and spaces, and the end-of-text token's name as plain text).
DOCUMENTS = [f"Document {i}: {'ünïcødé 🎭 ' * (i % 3)}the quick brown fox {i * 7} jumps.\n\n"
             f"  Over the lazy dog, line {i}; <|endoftext|> is only text here.\n"
             for i in range(12)]


def write_docs(folder, documents=DOCUMENTS, suffix=".txt"):
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(documents):
        (folder / f"doc{i:02d}{suffix}").write_text(text, encoding="utf-8")
    return folder


def split_documents(ids: np.ndarray, end_of_text: int) -> list[np.ndarray]:
    """A split's ids cut after each end-of-text token: one array per document."""
    ends = np.flatnonzero(ids == end_of_text)
    assert len(ids) and ids[-1] == end_of_text  # every document ends with the token
    return np.split(ids, ends[:-1] + 1)


def nanogpt_read(path):
    """How nanoGPT's train.py reads a split (np.memmap, uint16), whatever we meant."""
    return np.memmap(path, dtype=np.uint16, mode="r")


def test_prepared_splits_hold_each_document_once_as_the_tokenizer_encodes_it(tmp_path):
    out = tmp_path / "prepared"
    meta = prepare.prepare(prepare.parse([str(write_docs(tmp_path / "text")), f"out={out}",
                                          "tokenizer=bpe:300", "val_fraction=0.25"]))
    tokenizer = tokenizers.read(out / "tokenizer.json")
    eot = tokenizer.token_to_id("<|endoftext|>")
    assert meta["end_of_text"] == {"token": "<|endoftext|>", "id": eot}
    assert meta["dtype"] == "uint16"
    # Round trip: every document decodes back to itself, exactly.
    for text in DOCUMENTS:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) == text
    expected = {text: [*tokenizer.encode(text, add_special_tokens=False).ids, eot]
                for text in DOCUMENTS}
    found = {}
    for split in ("train", "val"):
        ids = np.asarray(nanogpt_read(out / f"{split}.bin"))
        docs = split_documents(ids, eot)
        found[split] = [tokenizer.decode(d[:-1].tolist()) for d in docs]
        # The file is the tokenizer's ids of its documents, in order.
        np.testing.assert_array_equal(ids, np.concatenate([expected[t] for t in found[split]]))
        assert meta["splits"][split] == {"documents": len(docs), "tokens": len(ids)}
    assert not set(found["train"]) & set(found["val"])  # no document in both splits
    assert sorted(found["train"] + found["val"]) == sorted(DOCUMENTS)
    assert len(found["val"]) == 3  # round(0.25 x 12)
    # The split is drawn by the seed: another seed draws another one.
    other = prepare.prepare(prepare.parse([str(tmp_path / "text"), f"out={tmp_path / 'other'}",
                                           "tokenizer=bpe:300", "val_fraction=0.25", "seed=5"]))
    val = np.asarray(nanogpt_read(tmp_path / "other" / "val.bin"))
    assert other["splits"]["val"]["documents"] == 3
    assert sorted(tokenizer.decode(d[:-1].tolist()) for d in split_documents(val, eot)) != \
        sorted(found["val"])


def test_a_checkpoints_tokenizer_json_and_jsonl_documents(tmp_path):
    """A Hugging Face folder's tokenizer.json (its tokenizer_config.json names </s>), one
    document per JSONL line, and a vocabulary past uint16: uint32 files."""
    words = ["</s>", "[UNK]", *(f"w{i}" for i in range(70_000))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    texts = [" ".join(f"w{(i * 7919 + j * 104_729) % 70_000}" for j in range(5 + i))
             for i in range(10)]
    source = tmp_path / "corpus.jsonl"
    source.write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(texts))
                      + "\n\n")
    out = tmp_path / "prepared"
    meta = prepare.prepare(prepare.parse([str(source), f"out={out}", f"tokenizer={checkpoint}",
                                          "text_field=body", "val_fraction=0.2"]))
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == len(words)
    assert meta["end_of_text"] == {"token": "</s>", "id": 0}
    every = [*np.fromfile(out / "train.bin", np.uint32), *np.fromfile(out / "val.bin", np.uint32)]
    assert max(every) >= 2**16  # ids only uint32 holds, read back whole
    assert sorted(len(d) for d in split_documents(np.array(every), 0)) == sorted(
        len(t.split()) + 1 for t in texts)
    assert meta["splits"]["val"]["documents"] == 2
    assert sum(s["tokens"] for s in meta["splits"].values()) == sum(len(t.split()) + 1
                                                                   for t in texts)
    # Training reads the uint32 folder back whole: its own count of tokens, its own ids.
    source = PreparedTokens(str(out), "auto", len(words), 0, 4)
    np.testing.assert_array_equal(source.tokens, np.fromfile(out / "train.bin", np.uint32))
    assert len(source.tokens) == meta["splits"]["train"]["tokens"]


def test_the_vocabulary_counts_added_tokens(tmp_path):
    """65,536 words (every uint16 id) and an end-of-text token added on top, id 65,536: the
    files must be uint32, and the token read back."""
    words = {f"w{i}": i for i in range(2**16)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    text = write_docs(tmp_path / "text", [f"w{i} w65535 w{2 * i}" for i in range(10)])
    meta = prepare.prepare(prepare.parse([str(text), f"out={tmp_path / 'out'}",
                                          f"tokenizer={tmp_path / 'tokenizer.json'}"]))
    assert (meta["vocab_size"], meta["dtype"], meta["end_of_text"]["id"]) == (
        2**16 + 1, "uint32", 2**16)
    ids = np.fromfile(tmp_path / "out" / "train.bin", np.uint32)
    assert ids[-1] == 2**16 and 2**16 - 1 in ids


def test_the_bpe_is_trained_on_the_train_documents_alone(tmp_path):
    """The prepared tokenizer is the one trained on the documents train.bin holds, not on
    the val documents too (their text would leak into the vocabulary)."""
    # Each document its own made-up words; room for every merge: the vocabulary is the text's.
    rng = np.random.default_rng(0)
    documents = [" ".join("".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 6))
                          for _ in range(8)) + "\n" for _ in range(12)]
    out = tmp_path / "prepared"
    prepare.prepare(prepare.parse([str(write_docs(tmp_path / "text", documents)), f"out={out}",
                                   "tokenizer=bpe:2000", "val_fraction=0.25"]))
    tokenizer = tokenizers.read(out / "tokenizer.json")
    ids = np.fromfile(out / "train.bin", np.uint16)
    train_docs = [tokenizer.decode(d[:-1].tolist()) for d in split_documents(ids, 0)]
    assert len(train_docs) == 9 and set(train_docs) < set(documents)
    # Trained here on the train documents in their order in the corpus.
    ordered = [d for d in documents if d in train_docs]
    reference = tokenizers.train_bpe(iter(ordered), 2000, len(ordered))
    assert tokenizer.get_vocab() == reference.get_vocab()


def test_a_file_named_twice_is_read_once(tmp_path, capsys):
    text = write_docs(tmp_path / "text")
    meta = prepare.prepare(prepare.parse([str(text), str(text / "doc03.txt"), str(text),
                                          f"out={tmp_path / 'out'}", "tokenizer=bpe:300"]))
    assert sum(s["documents"] for s in meta["splits"].values()) == len(DOCUMENTS)
    said = capsys.readouterr().out.splitlines()[0]
    assert said.startswith("prepare: 13 file(s) named more than once") and "doc03" in said


def test_a_token_id_is_checked_against_the_vocabulary_at_its_edge(tmp_path):
    """ids 0..vocab-1 are the vocabulary's; id == vocab is one past it."""
    path = tmp_path / "tokens.bin"
    np.arange(10, dtype=np.uint16).tofile(path)
    assert TokenFile(str(path), "uint16", 10, 0, 4).tokens.max() == 9
    with pytest.raises(DataError, match="token id 9 is outside the model's vocabulary of 9"):
        TokenFile(str(path), "uint16", 9, 0, 4)


def prepare_cli(args, capsys):
    import train
    code = train.main(["prepare", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _bad_prepare_inputs(tmp_path):
    text = write_docs(tmp_path / "text")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "no-field.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp_path / "not-json.jsonl").write_text('{"text": "a"}\nnot json\n')
    (tmp_path / "no-tokenizer").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "one.txt").write_text("a single document")
    for name, config in (("cut-short", None), ("bad-config", "{'eos_token': "),
                         ("no-unknown", None)):
        vocab = {"</s>": 0, "Document": 1}  # no unknown token: the first other word fails
        tokenizer = Tokenizer(models.WordLevel(vocab))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        (tmp_path / name).mkdir()
        tokenizer.save(str(tmp_path / name / "tokenizer.json"))
        if config:
            (tmp_path / name / "tokenizer_config.json").write_text(config)
    cut = tmp_path / "cut-short" / "tokenizer.json"
    cut.write_text(cut.read_text()[:100])
    return {
        "no source": ["out=x"],
        "missing source": [str(tmp_path / "missing.txt"), "out=x"],
        "empty source": [str(tmp_path / "empty.txt"), "out=x"],
        "JSONL line without the field": [str(tmp_path / "no-field.jsonl"), "out=x"],
        "JSONL line not JSON": [str(tmp_path / "not-json.jsonl"), "out=x"],
        "folder without tokenizer.json": [str(text), "out=x",
                                          f"tokenizer={tmp_path / 'no-tokenizer'}"],
        "BPE below the byte alphabet": [str(text), "out=x", "tokenizer=bpe:256"],
        "val fraction leaving val empty": [str(text), "out=x", "val_fraction=0.01"],
        "val fraction leaving train empty": [str(text), "out=x", "val_fraction=0.99"],
        "one document": [str(tmp_path / "one.txt"), "out=x"],
        "val fraction out of range": [str(text), "out=x", "val_fraction=1"],
        "output folder not empty": [str(text), f"out={tmp_path / 'full'}"],
        "unknown key": [str(text), "out=x", "vocab=300"],
        "a flag": [str(text), "out=x", "--force"],
        "no output": [str(text)],
        "tokenizer.json cut short": [str(text), "out=x", f"tokenizer={tmp_path / 'cut-short'}"],
        "tokenizer_config.json not JSON": [str(text), "out=x",
                                           f"tokenizer={tmp_path / 'bad-config'}"],
        "a tokenizer failing while it encodes": [str(text), "out=x",
                                                 f"tokenizer={tmp_path / 'no-unknown'}"],
        "output below a file": [str(text), f"out={tmp_path / 'one.txt' / 'tokens'}"],
        "seed not a number": [str(text), "out=x", "seed=abc"],
        "negative seed": [str(text), "out=x", "seed=-1"],
        "val fraction infinite": [str(text), "out=x", "val_fraction=inf"],
        "val fraction not finite": [str(text), "out=x", "val_fraction=nan"],
        "empty text field": [str(tmp_path / "no-field.jsonl"), "out=x", "text_field="],
        "BPE size not a number": [str(text), "out=x", "tokenizer=bpe:many"],
    }


BAD_PREPARE = ["no source", "missing source", "empty source", "JSONL line without the field",
               "JSONL line not JSON", "folder without tokenizer.json",
               "BPE below the byte alphabet", "val fraction leaving val empty",
               "val fraction leaving train empty", "one document", "val fraction out of range",
               "output folder not empty", "unknown key", "a flag", "no output",
               "tokenizer.json cut short", "tokenizer_config.json not JSON",
               "a tokenizer failing while it encodes", "output below a file",
               "seed not a number", "negative seed", "val fraction not finite",
               "val fraction infinite", "empty text field",
               "BPE size not a number"]


# What a line must say where a true but misleading one was said before.
SAID = {"output below a file": "one.txt is a file, not a folder",
        "a tokenizer failing while it encodes": "Missing [UNK] token"}


@pytest.mark.parametrize("case", BAD_PREPARE)
def test_bad_prepare_input_is_one_line_and_status_2(case, tmp_path, capsys, monkeypatch):
    args = _bad_prepare_inputs(tmp_path)[case]
    monkeypatch.chdir(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, out, err = prepare_cli(args, capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert SAID.get(case, "") in err
    # Nothing written: no folder (not even a partial one), the full folder as it was.
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


@pytest.fixture
def prepared(tmp_path):
    out = tmp_path / "prepared"
    prepare.prepare(prepare.parse([str(write_docs(tmp_path / "text")), f"out={out}",
                                   "tokenizer=bpe:300", "val_fraction=0.25"]))
    return out


def test_a_prepared_folder_is_checked_against_its_meta(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    assert read_meta(prepared) == meta
    source = PreparedTokens(str(prepared), "auto", 300, 0, 8)
    assert len(source.tokens) == meta["splits"]["train"]["tokens"]
    assert len(source.val.tokens) == meta["splits"]["val"]["tokens"]
    checks = [("data.dtype=uint32", lambda: PreparedTokens(str(prepared), "uint32", 300, 0, 8)),
              ("does not cover the tokenizer's vocabulary of 300",
               lambda: PreparedTokens(str(prepared), "auto", 299, 0, 8))]
    for said, make in checks:
        with pytest.raises(DataError, match=said):
            make()
    (prepared / "meta.json").write_text(json.dumps({**meta, "dtype": "uint32"}))
    with pytest.raises(DataError, match="train.bin holds .* uint32 tokens, but it has"):
        read_meta(prepared)
    splits = {**meta["splits"], "val": {**meta["splits"]["val"], "tokens": 5}}
    (prepared / "meta.json").write_text(json.dumps({**meta, "splits": splits}))
    with pytest.raises(DataError, match="val.bin holds 5 uint16 tokens, but it has"):
        read_meta(prepared)


def _meta_change(change):
    def damage(folder):
        meta = json.loads((folder / "meta.json").read_text())
        (folder / "meta.json").write_text(json.dumps(change(meta)))
    return damage


# Damages to a prepared folder, done in place: (the damage, what its line says). Every command
# that reads a folder (training, evaluation, sampling: tests/test_evaluation.py) says them alike.
DAMAGES = {
    "counts as strings": (_meta_change(lambda m: {**m, "splits": {
        s: {**c, "tokens": str(c["tokens"])} for s, c in m["splits"].items()}}),
        "expected a whole count"),
    "counts as floats": (_meta_change(lambda m: {**m, "splits": {
        s: {**c, "tokens": float(c["tokens"])} for s, c in m["splits"].items()}}),
        "expected a whole count"),
    "no end of text": (_meta_change(lambda m: {k: v for k, v in m.items() if k != "end_of_text"}),
                       "'end_of_text'"),
    "end of text outside the vocabulary": (_meta_change(lambda m: {**m, "end_of_text": {
        **m["end_of_text"], "id": m["vocab_size"]}}), "expected one of its vocabulary's"),
    "no tokenizer.json": (lambda folder: (folder / "tokenizer.json").unlink(),
                          "no tokenizer.json"),
}


def damage_folder(prepared, folder, name: str):
    """A copy of `prepared` with the damage DAMAGES[name] done to it."""
    folder.mkdir()
    for file in prepared.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    DAMAGES[name][0](folder)
    return folder


def test_a_bad_prepared_folder_is_one_line_before_anything_runs(prepared, tmp_path, capsys):
    """train.py on a prepared folder the model cannot use: its vocabulary smaller than the
    tokenizer's, a meta.json that disagrees with the files, a data.dtype against the folder's,
    eval_every on a bare token file (no val split): one line, status 2, no run folder."""
    from conftest import run_cli
    meta = json.loads((prepared / "meta.json").read_text())
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        (broken / name).write_bytes((prepared / name).read_bytes())
    (broken / "meta.json").write_text(json.dumps({**meta, "dtype": "uint32"}))
    small = ["steps=1", "seq=8", "model.n_layers=1", "quant=none"]
    damaged = {name: damage_folder(prepared, tmp_path / name, name) for name in DAMAGES}
    cases = [([f"data.path={prepared}", "model.vocab=256"], "does not cover"),
             ([f"data.path={broken}", "model.vocab=512"], "but it has"),
             *(([f"data.path={folder}", "model.vocab=512"], DAMAGES[name][1])
               for name, folder in damaged.items()),
             ([f"data.path={prepared}", "model.vocab=512", "data.dtype=uint32"], "data.dtype"),
             ([f"data.path={prepared / 'train.bin'}", "model.vocab=512", "eval_every=2"],
              "needs a val split")]
    for args, said in cases:
        code, out, err = run_cli(["llama405b-offload", *small, *args], tmp_path / "runs", capsys)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert said in err, err
        assert not (tmp_path / "runs").exists()


def test_shakespeare_before_make_shakespeare_names_it(tmp_path, capsys, monkeypatch):
    from conftest import run_cli
    monkeypatch.chdir(tmp_path)  # no datasets/shakespeare/tokens here
    code, out, err = run_cli(["shakespeare"], tmp_path / "runs", capsys)
    assert code == 2 and err == ("error: data.path=datasets/shakespeare/tokens: no such file or "
                                 "folder (make shakespeare writes it)\n")
    assert not (tmp_path / "runs").exists()
