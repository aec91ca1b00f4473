"""Training batches: deterministic synthetic tokens, or random windows of a token file.

Every process builds the same global batch [B, T+1] in numpy (cheap: 256 x 8193 tokens is 8 MB)
and hands JAX only the rows its devices hold, so single- and multi-host runs share one path."""

import os

import numpy as np


class DataError(ValueError):
    """A missing or malformed token file: reported as one line, exit status 2."""


class SyntheticTokens:
    """Uniform random tokens, a function of (seed, step) only: reruns see the same data."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed = vocab, seed

    def batch(self, step: int, batch: int, seq: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, step))
        return rng.integers(0, self.vocab, (batch, seq + 1), dtype=np.int32)


class TokenFile:
    """A flat array of token ids (uint16 or uint32, nanoGPT's .bin), read through a memmap.
    Each row of a batch is a window starting at a random offset drawn from (seed, step)."""

    def __init__(self, path: str, dtype: str, vocab: int, seed: int, seq: int):
        if not os.path.isfile(path):
            raise DataError(f"data.path={path!r}: no such file")
        size = os.path.getsize(path)
        if size == 0 or size % np.dtype(dtype).itemsize:
            raise DataError(f"data.path={path!r}: {size} bytes is not a whole number of "
                            f"{dtype} tokens")
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        self.seed = seed
        if len(self.tokens) < seq + 1:
            raise DataError(f"data.path={path!r}: {len(self.tokens)} tokens, fewer than one "
                            f"window of seq+1={seq + 1}")
        for start in range(0, len(self.tokens), 1 << 24):  # the whole file, in 16M-token reads
            if (top := int(self.tokens[start:start + (1 << 24)].max())) >= vocab:
                raise DataError(f"data.path={path!r}: token id {top} is outside the model's "
                                f"vocabulary of {vocab} (wrong data.dtype?)")

    def batch(self, step: int, batch: int, seq: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, step))
        starts = rng.integers(0, len(self.tokens) - seq, batch)
        return np.stack([self.tokens[s: s + seq + 1] for s in starts]).astype(np.int32)


def token_source(path: str, dtype: str, vocab: int, seed: int, seq: int):
    """Checked up front: a bad file fails before anything is compiled or written."""
    return TokenFile(path, dtype, vocab, seed, seq) if path else SyntheticTokens(vocab, seed)
