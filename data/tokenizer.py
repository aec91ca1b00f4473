"""Tokenizers, through Hugging Face's `tokenizers`: a checkpoint's tokenizer.json, or a
byte-level BPE trained on the corpus; and the end-of-text token that separates documents."""

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data.tokens import DataError

BPE_END_OF_TEXT = "<|endoftext|>"  # GPT-2's name, the one special token of a trained BPE
BYTES = 256  # the byte-level alphabet every trained BPE starts from
# What checkpoints call their end-of-text token when no tokenizer_config.json names it:
# GPT-2's, Llama 3's, SentencePiece models', DeepSeek-V3's.
END_OF_TEXT_NAMES = (BPE_END_OF_TEXT, "<|end_of_text|>", "</s>", "<｜end▁of▁sentence｜>")


def _literal(tokenizer: Tokenizer) -> Tokenizer:
    # A document's text never makes a special token: a literal "<|endoftext|>" in it is text,
    # so only the joins between documents are end-of-text tokens.
    tokenizer.encode_special_tokens = True
    return tokenizer


def load(path: str) -> tuple[Tokenizer, str]:
    """(the tokenizer, its end of text) of a Hugging Face checkpoint folder or its tokenizer.json:
    tokenizer_config.json's `eos_token`, else the first of END_OF_TEXT_NAMES it has."""
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise DataError(f"tokenizer={path}: no tokenizer.json there (a Hugging Face checkpoint "
                        "folder has one; or bpe:N trains one on the corpus)")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises a bare Exception for a malformed file
        raise DataError(f"tokenizer={path}: {file} does not load: {str(e)[:200]}") from None
    config = file.parent / "tokenizer_config.json"
    named = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    named = named.get("content") if isinstance(named, dict) else named
    candidates = [named] if named else END_OF_TEXT_NAMES
    found = [name for name in candidates if tokenizer.token_to_id(name) is not None]
    if not found:
        raise DataError(f"tokenizer={path}: no end-of-text token in its vocabulary (looked for "
                        f"{', '.join(candidates)})")
    return _literal(tokenizer), found[0]


def train_bpe(texts: Iterable[str], size: int, documents: int) -> Tokenizer:
    """A byte-level BPE of at most `size` tokens learnt from `texts` (GPT-2's pre-tokenizer:
    every text round-trips exactly), BPE_END_OF_TEXT its token 0; `size` > BYTES."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=[BPE_END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer, length=documents)
    return _literal(tokenizer)


def read(path: Path) -> Tokenizer:
    """A prepared folder's tokenizer.json, as `prepare` used it."""
    return _literal(Tokenizer.from_file(str(path)))
