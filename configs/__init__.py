"""Run configs, named experiments, and `key=value` overrides. No JAX import (see model.config).

An experiment is a full-scale model and run (the study's setting) plus a proxy: the same family
at a size a laptop runs in about a second a step. `scale=auto` picks whichever the machine can run.
"""

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from configs.gpus import GPUS
from model.config import DeepSeekConfig, LlamaConfig

ModelConfig = LlamaConfig | DeepSeekConfig

DTYPES = ("bfloat16", "float32", "float16")
SCALES = ("auto", "full", "proxy")
QUANTS = ("none", "nvfp4")
QUANT_TILES = ("1x16", "16x16")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, cosine decay to min_lr_ratio * lr, and global-norm clipping."""
    lr: float = 3e-4
    warmup_steps: int = 2
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.1
    clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh: `data` replicas (e.g. slices over the data-centre network) x `fsdp` shards.
    fsdp=-1 takes all the devices the data axis leaves."""
    data: int = 1
    fsdp: int = -1

    def shape(self, n_devices: int) -> tuple[int, int]:
        return self.data, (n_devices // self.data if self.fsdp == -1 else self.fsdp)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Synthetic tokens when `path` is empty; else a flat token file (.bin, as nanoGPT writes)."""
    path: str = ""
    dtype: str = "uint16"


@dataclasses.dataclass(frozen=True)
class RunConfig:
    per_device_batch: int = 2
    global_batch: int = 0  # 0: per_device_batch x devices
    seq: int = 8192
    steps: int = 10
    optimizer: OptimizerConfig = OptimizerConfig()
    compute_dtype: str = "bfloat16"  # activations and matmuls; weights are cast per layer
    param_dtype: str = "float32"  # master weights and optimizer state
    # Where the AdamW moments live between steps: device, or host (pinned host memory,
    # streamed through the device a layer at a time for the update: trainer/host_state.py).
    optimizer_state: str = "device"
    mesh: MeshConfig = MeshConfig()
    policy: str = "remat"  # a preset of offload.policies, or "none" (no checkpointing)
    placements: Mapping[str, str] = dataclasses.field(default_factory=dict)  # policy.<tag>=...
    xla_flags: Mapping[str, str] = dataclasses.field(default_factory=dict)  # GPU only
    quant: str = "none"  # nvfp4: layer matrices multiplied in NVFP4 (model/quant.py)
    quant_tiles: str = "1x16"  # weight block scales per 1x16 block or per 16x16 tile (TE)
    data: DataConfig = DataConfig()
    seed: int = 0
    scale: str = "auto"
    init_from: str = ""  # a Hugging Face checkpoint directory of the experiment's family
    out_dir: str = "runs"
    # Checkpoints (runtime/checkpoints.py): every N steps and at the end (0: only when stopped by
    # SIGTERM or Ctrl-C), into checkpoint_dir (empty: <run folder>/checkpoints), the newest
    # `keep` kept. resume=latest | a run folder | a checkpoint directory | one step folder.
    checkpoint_every: int = 500
    checkpoint_dir: str = ""
    keep: int = 3
    resume: str = ""
    profile: bool = False
    device: str = "gb200"  # the GPU full scale is planned and compiled for (configs/gpus.py)
    attention: str = "auto"  # cudnn (fused, GPUs, bf16) | xla | auto
    # MoE models only:
    expert_path: str = "auto"  # sorted (grouped GEMMs) | dense (every expert) | auto
    expert_parallel: bool = False  # routed experts split over the fsdp devices
    # Under expert parallelism, rows a device may send each other device, as a multiple of
    # the balanced share; 0: room for the worst case (dropless). Pairs beyond it are dropped.
    expert_capacity: float = 0.0
    # The loss over this many sequence chunks, each one's logits recomputed in the backward
    # pass, instead of all [B, T, V] fp32 logits and their gradient at once.
    loss_chunks: int = 1
    router_bias_rate: float = 0.001  # aux-loss-free balancing step (DeepSeek-V3's gamma)
    balance_loss_weight: float = 0.0  # sequence-wise balance loss (DeepSeek-V3: 0.0001)

    def batch(self, n_devices: int) -> int:
        return self.global_batch or self.per_device_batch * n_devices


@dataclasses.dataclass(frozen=True)
class Experiment:
    name: str
    summary: str
    model: ModelConfig
    proxy_model: ModelConfig
    run: RunConfig
    proxy_run: Mapping[str, Any]  # RunConfig fields that change at proxy scale

    def at_scale(self, scale: str) -> tuple[ModelConfig, RunConfig]:
        if scale == "full":
            return self.model, self.run
        return self.proxy_model, dataclasses.replace(self.run, **self.proxy_run)


EXPERIMENTS: dict[str, Experiment] = {}
COMPARISONS: dict[str, tuple[str, ...]] = {}  # name -> experiments run one after another
# The study's measured TFLOP/s/device per row (docs/study.md, 128 GB200s): what each row's
# replayed step is compared with (`--compile`, benchmarks/step_times.py).
STUDY_TFLOPS: dict[str, float] = {}


def register(*experiments: Experiment) -> None:
    for e in experiments:
        EXPERIMENTS[e.name] = e


class ConfigError(ValueError):
    """Bad experiment name, override or combination: reported as one line, exit status 2."""


def get(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; `python train.py --list` shows them")
    return EXPERIMENTS[name]


def parse_overrides(args: list[str]) -> dict[str, str]:
    pairs = {}
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq or not key:
            raise ConfigError(f"expected key=value, got {arg!r}")
        pairs[key] = value
    return pairs


def _coerce(key: str, text: str, kind) -> Any:
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    if text.lower() == "none" and type(None) in options:
        return None
    for option in (o for o in options if o is not type(None)):
        if option is bool:
            if text.lower() in ("true", "1", "yes", "false", "0", "no"):
                return text.lower() in ("true", "1", "yes")
        elif option in (int, float, str):
            try:
                value = option(text)
            except ValueError:
                continue
            if option is float and not math.isfinite(value):
                raise ConfigError(f"{key}={text!r}: must be a finite number")
            return value
    names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise ConfigError(f"{key}={text!r}: expected {names}")


def _set(obj, path: list[str], text: str, full_key: str):
    """A copy of dataclass `obj` with the field at `path` set from `text`, typed by the field."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    name = path[0]
    if name not in fields:
        raise ConfigError(f"unknown key {full_key!r}; {type(obj).__name__} has "
                          f"{', '.join(fields)}")
    value, kind = getattr(obj, name), typing.get_type_hints(type(obj))[name]
    if typing.get_origin(kind) is Mapping:
        if len(path) != 2:
            raise ConfigError(f"{full_key}: write {name}.<key>=<value>")
        return dataclasses.replace(obj, **{name: {**value, path[1]: text}})
    if dataclasses.is_dataclass(value):
        if len(path) == 1 and text.lower() == "none" and type(None) in typing.get_args(kind):
            return dataclasses.replace(obj, **{name: None})  # an optional group turned off
        if len(path) == 1:
            raise ConfigError(f"{full_key} is a group; set one of its fields, e.g. "
                              f"{full_key}.{dataclasses.fields(value)[0].name}=...")
        return dataclasses.replace(obj, **{name: _set(value, path[1:], text, full_key)})
    if len(path) > 1:
        raise ConfigError(f"unknown key {full_key!r}: {name} has no sub-fields")
    return dataclasses.replace(obj, **{name: _coerce(full_key, text, kind)})


def apply_overrides(model: ModelConfig, run: RunConfig, overrides: Mapping[str, str]):
    """`model.<field>=...` sets the architecture, `policy.<tag>=...` one placement, and any
    other dotted key a run field. Every value is typed by the field it sets."""
    for key, text in overrides.items():
        path = key.split(".")
        if path[0] == "model" and len(path) > 1:
            model = _set(model, path[1:], text, key)
        elif path[0] == "policy" and len(path) in (2, 3):  # policy.<tag>, policy.<scan>.<tag>
            run = _set(run, ["placements", ".".join(path[1:])], text, key)
        else:
            run = _set(run, path, text, key)
    return model, run


def problems(model: ModelConfig, run: RunConfig, n_devices: int) -> list[str]:
    """Every impossible combination for this many devices, one line each."""
    found = list(model.problems())
    choices = {"compute_dtype": DTYPES, "param_dtype": ("float32", "bfloat16"), "scale": SCALES,
               "quant": QUANTS, "quant_tiles": QUANT_TILES, "device": tuple(GPUS),
               "expert_path": ("auto", "sorted", "dense"), "attention": ("auto", "cudnn", "xla"),
               "optimizer_state": ("device", "host")}
    found += [f"{k}={getattr(run, k)!r}: choose one of {', '.join(v)}"
              for k, v in choices.items() if getattr(run, k) not in v]
    if run.data.dtype not in ("uint16", "uint32"):
        found.append(f"data.dtype={run.data.dtype!r}: choose uint16 or uint32")
    for name in ("per_device_batch", "seq", "steps", "loss_chunks"):
        if getattr(run, name) < 1:
            found.append(f"{name} must be at least 1, got {getattr(run, name)}")
    if run.loss_chunks >= 1 and run.seq % run.loss_chunks:
        found.append(f"seq={run.seq} is not divisible into loss_chunks={run.loss_chunks}")
    if run.seq > model.max_position:
        found.append(f"seq={run.seq} is longer than the RoPE table allows "
                     f"(model.max_position={model.max_position})")
    if not 0 <= run.seed < 2**63:
        found.append(f"seed={run.seed} must lie in [0, 2**63)")
    if run.checkpoint_every < 0 or run.keep < 1:
        found.append(f"checkpoint_every={run.checkpoint_every} must be 0 (off) or positive, "
                     f"keep={run.keep} at least 1")
    if run.global_batch < 0:
        found.append(f"global_batch={run.global_batch} must be 0 (per-device batch x devices) "
                     "or positive")
    data, fsdp = run.mesh.shape(n_devices) if run.mesh.data >= 1 else (run.mesh.data, 0)
    if data < 1 or fsdp < 1 or data * fsdp != n_devices:
        found.append(f"mesh data={run.mesh.data} x fsdp={run.mesh.fsdp} does not cover the "
                     f"{n_devices} devices")
    elif run.batch(n_devices) % (data * fsdp):
        found.append(f"global_batch={run.batch(n_devices)} is not divisible over the "
                     f"{data * fsdp} data x fsdp devices")
    found += _expert_problems(model, run, fsdp)
    found += [f"xla_flags.{flag}: XLA flag names start with xla_"
              for flag in run.xla_flags if not flag.startswith("xla_")]
    opt = run.optimizer
    if opt.lr <= 0 or opt.warmup_steps < 0 or opt.clip_norm <= 0 or opt.weight_decay < 0:
        found.append("optimizer: lr and clip_norm must be positive, warmup_steps and "
                     "weight_decay non-negative")
    if not (0 <= opt.b1 < 1 and 0 <= opt.b2 < 1 and 0 <= opt.min_lr_ratio <= 1):
        found.append("optimizer: b1 and b2 must lie in [0, 1), min_lr_ratio in [0, 1]")
    return found


def _expert_problems(model: ModelConfig, run: RunConfig, fsdp: int) -> list[str]:
    if run.expert_capacity < 0:
        return [f"expert_capacity={run.expert_capacity} must be 0 (dropless) or positive"]
    if not run.expert_parallel:
        return []
    if not isinstance(model, DeepSeekConfig):
        return ["expert_parallel=true needs a model with routed experts (DeepSeek)"]
    if fsdp >= 1 and model.n_experts % fsdp:
        return [f"expert_parallel: model.n_experts={model.n_experts} is not divisible over the "
                f"fsdp={fsdp} devices"]
    return []


from configs import deepseek_v3, llama3  # noqa: E402,F401  (they register their experiments)
