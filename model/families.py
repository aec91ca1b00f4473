"""The model families: each one module (model/llama.py, model/deepseek.py) with its config
class, layer scans and their tags, parameters, forward, FLOP count and Hugging Face names;
found here by its config."""

from model import deepseek, llama

FAMILIES = (llama, deepseek)


def of(cfg):
    """The family module of a model config."""
    return next(family for family in FAMILIES if isinstance(cfg, family.CONFIG))


def scan_tags(cfg) -> dict[str, tuple[str, ...]]:
    """Layer scan -> its tags, for a model config."""
    return of(cfg).SCANS
