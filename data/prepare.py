"""Text to tokens: `python train.py prepare` (USAGE; docs/data.md says what it reads and writes).

Every mistake is found before anything is written; the folder appears only once complete
(written as DIR.partial-PID, then renamed). The corpus is streamed: a first pass counts and
checks the documents, a second (with bpe:N) trains the tokenizer on the train split, the last
tokenizes batches of documents in parallel (the Rust library's threads) into the split files."""

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from data import tokenizer as tokenizers
from data.tokens import DTYPES, META, TOKENIZER, TRAIN, VAL, DataError

USAGE = ("usage: python train.py prepare SOURCE ... out=DIR [tokenizer=PATH|bpe:N] "
         "[val_fraction=F] [text_field=NAME] [seed=S]")
DEFAULTS = {"out": "", "tokenizer": "bpe:8192", "val_fraction": "0.1", "text_field": "text",
            "seed": "0"}
TEXT_SUFFIXES = (".txt", ".md", ".jsonl")
BATCH_BYTES = 8 << 20  # text per tokenizer call: the library's threads share a batch


@dataclasses.dataclass(frozen=True)
class Options:
    sources: tuple[str, ...]
    out: Path
    tokenizer: str
    val_fraction: float
    text_field: str
    seed: int


@dataclasses.dataclass(frozen=True)
class SourceFile:
    path: Path
    documents: int
    size: int


def parse(argv: list[str]) -> Options:
    sources = [a for a in argv if "=" not in a]
    if flags := [a for a in sources if a.startswith("-")]:
        raise DataError(f"prepare: unknown flag {flags[0]!r}; {USAGE}")
    options = dict(DEFAULTS)
    for key, value in (a.split("=", 1) for a in argv if "=" in a):
        if key not in DEFAULTS:
            raise DataError(f"prepare: unknown key {key!r}; it takes {', '.join(DEFAULTS)}")
        options[key] = value
    if not sources or not options["out"]:
        raise DataError(USAGE)
    try:
        fraction, seed = float(options["val_fraction"]), int(options["seed"])
    except ValueError:
        raise DataError(f"prepare: val_fraction={options['val_fraction']!r} must be a number "
                        f"and seed={options['seed']!r} an integer") from None
    if not 0 < fraction < 1 or seed < 0 or not options["text_field"]:
        raise DataError(f"prepare: val_fraction={fraction:g} must be in (0, 1), seed={seed} "
                        f">= 0 and text_field non-empty")
    spec = options["tokenizer"]
    size = spec.removeprefix("bpe:")
    whole = size.isascii() and size.isdigit()  # (str.isdigit alone takes "²")
    if spec.startswith("bpe:") and (not whole or int(size) < tokenizers.BYTES + 1):
        raise DataError(f"tokenizer={spec}: a byte-level BPE needs N >= {tokenizers.BYTES + 1} "
                        f"(the {tokenizers.BYTES} bytes and {tokenizers.BPE_END_OF_TEXT})")
    return Options(tuple(sources), Path(options["out"]), spec, fraction,
                   options["text_field"], seed)


def _files(source: str) -> list[Path]:
    path = Path(source)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not found:
            raise DataError(f"prepare: {source} holds no {', '.join(TEXT_SUFFIXES)} files")
        return found
    if not path.is_file():
        raise DataError(f"prepare: {source}: no such file or folder")
    return [path]


def _jsonl_texts(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise DataError(f"prepare: {path}:{number} is not JSON") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"prepare: {path}:{number} has no text field {field!r} "
                                "(text_field= names it)")
            yield text


def _texts(path: Path, field: str) -> Iterator[str]:
    try:
        if path.suffix == ".jsonl":
            yield from _jsonl_texts(path, field)
        else:
            yield path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"prepare: {path} is not UTF-8 text ({e.reason} at byte "
                        f"{e.start})") from None


def unique_files(sources: tuple[str, ...]) -> list[Path]:
    """The sources' files in order, each once: a file named twice (itself, and through its
    folder) would put its documents in the corpus twice, maybe in both splits; said once."""
    seen: dict[Path, Path] = {}
    repeated = [path for source in sources for path in _files(source)
                if seen.setdefault(path.resolve(), path) is not path]
    if repeated:
        print(f"prepare: {len(repeated)} file(s) named more than once among the sources, each "
              f"read once (the first: {repeated[0]})", flush=True)
    return list(seen.values())


def scan(options: Options) -> list[SourceFile]:
    """Every source file with its documents counted (every JSONL line read and checked)."""
    files = [SourceFile(p, sum(1 for _ in _texts(p, options.text_field)), p.stat().st_size)
             for p in unique_files(options.sources)]
    if empty := [f.path for f in files if f.size == 0 or f.documents == 0]:
        raise DataError(f"prepare: {empty[0]} is empty")
    return files


def choose_val(documents: int, fraction: float, seed: int) -> np.ndarray:
    """Which documents are val: round(fraction x documents) of them, drawn by `seed`."""
    count = round(fraction * documents)
    if not 0 < count < documents:
        split = "val" if count == 0 else "train"
        raise DataError(f"prepare: val_fraction={fraction:g} of {documents} document(s) leaves "
                        f"the {split} split empty (documents are split whole: give more files, "
                        "or JSONL with one document per line)")
    val = np.zeros(documents, bool)
    val[np.random.default_rng(seed).choice(documents, count, replace=False)] = True
    return val


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"prepare: out={out} exists and is not an empty folder: a prepared "
                        "folder is never overwritten")
    parent = next(p for p in out.absolute().parents if p.exists())
    if not parent.is_dir():
        raise DataError(f"prepare: out={out}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DataError(f"prepare: out={out}: {parent} is not writable")


def documents(files: list[SourceFile], field: str) -> Iterator[tuple[int, str, int]]:
    """(index, text, bytes of its file it completes) of every document, in order."""
    index = 0
    for file in files:
        for n, text in enumerate(_texts(file.path, field)):
            yield index, text, file.size if n == file.documents - 1 else 0
            index += 1


class Progress:
    """A line at most every two seconds: bytes read, tokens written, rate, time left."""

    def __init__(self, total_bytes: int):
        self.total, self.done, self.tokens = total_bytes, 0, 0
        self.started = self.shown = time.perf_counter()

    def advance(self, size: int, tokens: int) -> None:
        self.done, self.tokens = self.done + size, self.tokens + tokens
        now = time.perf_counter()
        if now - self.shown < 2:
            return
        self.shown, elapsed = now, max(now - self.started, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else float("inf")
        print(f"tokenizing: {self.done / 2**20:,.1f} of {self.total / 2**20:,.1f} MiB, "
              f"{self.tokens:,} tokens, {rate / 2**20:.1f} MiB/s, {self.tokens / elapsed:,.0f} "
              f"tokens/s, ETA {eta:.0f} s", flush=True)


def write_splits(files, options, tokenizer, end_of_text: int, val, folder: Path, dtype) -> dict:
    """Tokenize every document into folder/train.bin or val.bin; {split: counts}."""
    counts = {"train": {"documents": 0, "tokens": 0}, "val": {"documents": 0, "tokens": 0}}
    progress = Progress(sum(f.size for f in files))
    with open(folder / TRAIN, "wb") as train, open(folder / VAL, "wb") as held_out:
        batch: list[tuple[int, str]] = []
        done = pending = 0

        def flush():
            try:
                encoded = tokenizer.encode_batch_fast([text for _, text in batch],
                                                      add_special_tokens=False)
            except Exception as e:  # the Rust library's bare Exception (e.g. no unknown token)
                raise DataError(f"prepare: tokenizer={options.tokenizer} fails on the documents: "
                                f"{str(e)[:200]}") from None
            for (index, _), encoding in zip(batch, encoded):
                split = "val" if val[index] else "train"
                ids = np.array([*encoding.ids, end_of_text], dtype)
                ids.tofile(held_out if split == "val" else train)
                counts[split]["documents"] += 1
                counts[split]["tokens"] += len(ids)
            progress.advance(done, sum(len(encoding.ids) + 1 for encoding in encoded))
            batch.clear()

        for index, text, size in documents(files, options.text_field):
            batch.append((index, text))
            pending, done = pending + len(text), done + size
            if pending >= BATCH_BYTES:
                flush()
                done = pending = 0
        flush()
    return counts


def prepare(options: Options) -> dict:
    """The whole preparation; its meta.json."""
    check_out(options.out)
    started = time.perf_counter()
    bpe = options.tokenizer.startswith("bpe:")
    if not bpe:
        tokenizer, end_of_text = tokenizers.load(options.tokenizer)
    files = scan(options)
    val = choose_val(sum(f.documents for f in files), options.val_fraction, options.seed)
    if bpe:
        train_texts = (text for index, text, _ in documents(files, options.text_field)
                       if not val[index])
        tokenizer = tokenizers.train_bpe(train_texts, int(options.tokenizer[4:]), int((~val).sum()))
        end_of_text = tokenizers.BPE_END_OF_TEXT
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = DTYPES[0] if vocab <= 2**16 else DTYPES[1]
    partial = options.out.absolute().with_name(f"{options.out.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True)
    try:
        eot = tokenizer.token_to_id(end_of_text)
        counts = write_splits(files, options, tokenizer, eot, val, partial, dtype)
        tokenizer.save(str(partial / TOKENIZER))
        meta = {"tokenizer": options.tokenizer, "vocab_size": vocab, "dtype": dtype,
                "end_of_text": {"token": end_of_text, "id": eot}, "splits": counts,
                "source": list(options.sources), "files": len(files),
                "text_field": options.text_field,
                "val_fraction": options.val_fraction, "seed": options.seed,
                "format": "nanoGPT's: flat token ids, an end-of-text token after each document"}
        (partial / META).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
        if options.out.exists():
            options.out.rmdir()  # empty (checked): the complete folder takes its place
        partial.rename(options.out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print(f"prepared {options.out} in {time.perf_counter() - started:.1f} s: "
          + "; ".join(f"{split} {c['documents']:,} documents, {c['tokens']:,} tokens"
                      for split, c in counts.items())
          + f"; tokenizer {options.tokenizer} (vocabulary {vocab:,}, {dtype}), end of text "
          f"{end_of_text!r} = {eot}")
    return meta


def main(argv: list[str]) -> int:
    prepare(parse(argv))
    return 0
