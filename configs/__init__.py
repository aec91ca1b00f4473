"""The named experiments the family modules define, and the names callers use of configs/."""

from configs import deepseek_v3, llama3, shakespeare
from configs.checks import out_of_range, problems
from configs.overrides import ConfigError, apply_overrides, parse_overrides
from configs.settings import (ASYNC_LIMIT, LHS, MESH_AXES, PIPELINED, SCALES, Experiment,
                              MeshConfig, ModelConfig, OptimizerConfig, RunConfig, whole,
                              xla_flag_value)

__all__ = ["ASYNC_LIMIT", "COMPARISONS", "EXPERIMENTS", "LHS", "MESH_AXES", "PIPELINED", "SCALES",
           "STUDY_TFLOPS",
           "ConfigError", "Experiment", "MeshConfig", "ModelConfig", "OptimizerConfig",
           "RunConfig", "apply_overrides", "get", "out_of_range", "parse_overrides", "problems",
           "whole", "xla_flag_value"]

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e for e in (*deepseek_v3.EXPERIMENTS, *llama3.EXPERIMENTS, *shakespeare.EXPERIMENTS)}
# The study's measured TFLOP/s per GB200, by row.
STUDY_TFLOPS: dict[str, float] = {e.name: e.study_tflops for e in EXPERIMENTS.values()
                                  if e.study_tflops is not None}
# A comparison's experiments run one after another, one table (runtime/comparison.py).
COMPARISONS: dict[str, tuple[str, ...]] = {**deepseek_v3.COMPARISONS, **llama3.COMPARISONS}


def get(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; `python train.py --list` shows them")
    return EXPERIMENTS[name]
