"""The model families, one module each (model/llama.py, model/deepseek.py), found by its config.
A family has CONFIG (its config class), SCANS (its layer scans and their tags), UNQUANTIZED,
param_specs, trunk, forward and training_flops (checkpoint names: hf/names.py)."""

from model import deepseek, llama

FAMILIES = (llama, deepseek)


def of(cfg):
    return next(family for family in FAMILIES if isinstance(cfg, family.CONFIG))
