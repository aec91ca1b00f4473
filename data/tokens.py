"""Training and evaluation batches: synthetic tokens, a flat token file, or a folder that
`python train.py prepare` wrote. A training batch is a function of (seed, step) and an evaluation
batch of its index alone, so every process builds the same global batch [B, T+1] in numpy (256 x
8193 tokens is 8 MB) and hands JAX only its devices' rows: every run reads the same windows."""

import json
import os
from pathlib import Path

import numpy as np

META, TRAIN, VAL, TOKENIZER = "meta.json", "train.bin", "val.bin", "tokenizer.json"
DTYPES = ("uint16", "uint32")
_READ = 1 << 24  # tokens per read when a whole file is scanned


# The prepared folders this repository's scripts write, by the command that writes them.
MADE_BY = {"datasets/shakespeare/tokens": "make shakespeare"}


class DataError(ValueError):
    """A missing or malformed text, token file or prepared folder: one line, exit status 2."""


class SyntheticTokens:
    """Uniform random tokens, a function of (seed, step) only: reruns see the same data."""
    val = None
    unigram_entropy = None

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed = vocab, seed

    def batch(self, step: int, batch: int, seq: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, step))
        return rng.integers(0, self.vocab, (batch, seq + 1), dtype=np.int32)

    def describe(self) -> str:
        return ("synthetic uniform tokens, nothing to learn (text: data.path= a folder python "
                "train.py prepare wrote; docs/data.md)")


class TokenFile:
    """A flat array of token ids (nanoGPT's .bin), read through a memmap: training windows at
    offsets drawn from (seed, step), evaluation windows spread evenly over the file."""
    val = None

    def __init__(self, path: str, dtype: str, vocab: int, seed: int, seq: int,
                 name: str | None = None):
        name = name or f"data.path={path!r}"
        if not os.path.isfile(path):
            raise DataError(f"{name}: no such file")
        size = os.path.getsize(path)
        if size == 0 or size % np.dtype(dtype).itemsize:
            raise DataError(f"{name}: {size} bytes is not a whole number of {dtype} tokens")
        self.path, self.seed = path, seed
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        if len(self.tokens) < seq + 1:
            raise DataError(f"{name}: {len(self.tokens)} tokens, fewer than one window of "
                            f"seq+1={seq + 1}")
        counts = np.zeros(vocab, np.int64)
        for start in range(0, len(self.tokens), _READ):  # the whole file, in 16M-token reads
            chunk = self.tokens[start:start + _READ]
            if (top := int(chunk.max())) >= vocab:
                raise DataError(f"{name}: token id {top} is outside the model's vocabulary of "
                                f"{vocab} (wrong data.dtype?)")
            counts += np.bincount(chunk, minlength=vocab)
        p = counts[counts > 0] / len(self.tokens)
        # The loss of the best model that ignores the context; one that uses it goes below.
        self.unigram_entropy = float(-(p * np.log(p)).sum())

    def batch(self, step: int, batch: int, seq: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, step))
        return self._windows(rng.integers(0, len(self.tokens) - seq, batch), seq)

    def eval_batch(self, index: int, batch: int, seq: int, batches: int) -> np.ndarray:
        """Batch `index` of `batches`, the same windows at every evaluation."""
        starts = np.linspace(0, len(self.tokens) - seq - 1, batches * batch).round()
        return self._windows(starts[index * batch:(index + 1) * batch].astype(np.int64), seq)

    def _windows(self, starts, seq: int) -> np.ndarray:
        return np.stack([self.tokens[s: s + seq + 1] for s in starts]).astype(np.int32)

    def describe(self) -> str:
        return f"{self.path}: {len(self.tokens):,} tokens"


class PreparedTokens(TokenFile):
    """A prepared folder: training windows from train.bin, evaluation windows from val.bin."""

    def __init__(self, path: str, dtype: str, vocab: int, seed: int, seq: int):
        folder = Path(path)
        self.meta = read_meta(folder)
        if dtype != "auto" and dtype != self.meta["dtype"]:
            raise DataError(f"data.dtype={dtype}, but {folder / META} says {self.meta['dtype']} "
                            "(leave data.dtype out: a prepared folder knows its own)")
        if self.meta["vocab_size"] > vocab:
            raise DataError(f"model.vocab={vocab} does not cover the tokenizer's vocabulary of "
                            f"{self.meta['vocab_size']:,} (data.path={path}): set model.vocab="
                            f"{self.meta['vocab_size']} or more")
        super().__init__(str(folder / TRAIN), self.meta["dtype"], vocab, seed, seq,
                         f"data.path={path}: {TRAIN}")
        self.folder = folder
        self.val = (TokenFile(str(folder / VAL), self.meta["dtype"], vocab, seed, seq,
                              f"data.path={path}: {VAL}")
                    if self.meta["splits"]["val"]["tokens"] else None)

    def describe(self) -> str:
        words = ", ".join(f"{split} {s['tokens']:,} tokens ({s['documents']:,} documents)"
                          for split, s in self.meta["splits"].items())
        return (f"{self.folder}: {words}; tokenizer {self.meta['tokenizer']} (vocabulary "
                f"{self.meta['vocab_size']:,})")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_meta(folder: Path) -> dict:
    """A prepared folder's meta.json, checked against its files (the dtype, each split's size,
    the end-of-text id, the tokenizer): the one check of a folder training, evaluation and
    sampling read, so what one command takes the others take too."""
    said = f"data.path={folder}: {META}"
    try:
        meta = json.loads((folder / META).read_text())
        dtype, vocab, splits = meta["dtype"], meta["vocab_size"], meta["splits"]
        counts = {split: splits[split]["tokens"] for split in ("train", "val")}
        end_of_text = meta["end_of_text"]["id"]
    except FileNotFoundError:
        raise DataError(f"data.path={folder}: a folder without {META} (python train.py prepare "
                        "writes one; a bare token file is given by its .bin path)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{said} is not a prepared folder's ({e!r})") from None
    if dtype not in DTYPES or not _count(vocab) or vocab < 1:
        raise DataError(f"{said} has dtype {dtype!r} and vocab_size {vocab!r}; expected uint16 "
                        "or uint32 and a positive whole size")
    if bad := [f"{split} tokens {n!r}" for split, n in counts.items() if not _count(n)]:
        raise DataError(f"{said} has {bad[0]}: expected a whole count >= 0")
    if not _count(end_of_text) or end_of_text >= vocab:
        raise DataError(f"{said} has end-of-text id {end_of_text!r}: expected one of its "
                        f"vocabulary's {vocab:,} ids")
    for split, file in (("train", TRAIN), ("val", VAL)):
        path = folder / file
        size = path.stat().st_size if path.is_file() else None
        if size != counts[split] * np.dtype(dtype).itemsize:
            found = "no file" if size is None else f"{size:,} bytes"
            raise DataError(f"{said} says {file} holds {counts[split]:,} {dtype} tokens, but it "
                            f"has {found}")
    if not (folder / TOKENIZER).is_file():
        raise DataError(f"data.path={folder}: no {TOKENIZER} (python train.py prepare writes one)")
    return meta


TokenSource = SyntheticTokens | TokenFile


def token_source(path: str, dtype: str, vocab: int, seed: int, seq: int) -> TokenSource:
    """Checked up front: a bad file or folder fails before anything is compiled or written."""
    if not path:
        return SyntheticTokens(vocab, seed)
    if not os.path.exists(path):
        made_by = MADE_BY.get(os.path.normpath(path))
        raise DataError(f"data.path={path}: no such file or folder" + (
            f" ({made_by} writes it)" if made_by else " (python train.py prepare writes one)"))
    if os.path.isdir(path):
        return PreparedTokens(path, dtype, vocab, seed, seq)
    return TokenFile(path, "uint16" if dtype == "auto" else dtype, vocab, seed, seq)
