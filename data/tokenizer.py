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
    tokenizer = _from_file(file, f"tokenizer={path}")
    named = _named_end_of_text(file.parent / "tokenizer_config.json", f"tokenizer={path}")
    candidates = [named] if named else END_OF_TEXT_NAMES
    found = [name for name in candidates if tokenizer.token_to_id(name) is not None]
    if not found:
        raise DataError(f"tokenizer={path}: no end-of-text token in its vocabulary (looked for "
                        f"{', '.join(candidates)})")
    return _literal(tokenizer), found[0]


def _from_file(file: Path, said: str) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises a bare Exception for a malformed file
        raise DataError(f"{said}: {file} does not load: {str(e)[:200]}") from None


def _named_end_of_text(config: Path, said: str) -> str | None:
    """tokenizer_config.json's `eos_token` (a name, or a dict with its `content`), if any."""
    if not config.is_file():
        return None
    try:
        record = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{said}: {config} is not JSON ({e})") from None
    named = record.get("eos_token") if isinstance(record, dict) else None
    named = named.get("content") if isinstance(named, dict) else named
    if named is not None and not isinstance(named, str):
        raise DataError(f"{said}: {config}'s eos_token is {named!r}, not a token's name")
    return named


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
    return _literal(_from_file(path, f"data.path={path.parent}"))
