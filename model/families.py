"""The model families: each one module (model/llama.py, model/deepseek.py) with its config
class, layer scans and their tags, parameters, forward, FLOP count and Hugging Face names;
found here by its config or by config.json's model_type."""

from model import deepseek, llama

FAMILIES = (llama, deepseek)


def of(cfg):
    """The family module of a model config."""
    return next(family for family in FAMILIES if isinstance(cfg, family.CONFIG))


def by_hf_type(model_type: str):
    """The family of a Hugging Face config.json's model_type; None if none is."""
    return next((family for family in FAMILIES if family.HF_TYPE == model_type), None)


def scan_tags(cfg) -> dict[str, tuple[str, ...]]:
    """Layer scan -> its tags, for a model config."""
    return of(cfg).SCANS
