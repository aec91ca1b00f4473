"""Run configs, named experiments, and `key=value` overrides. No JAX import (see model.config).

An experiment is a full-scale model and run (the study's setting) plus a proxy: the same family
at a size a laptop's CPU trains; between them, the fit scale keeps the full-scale layers, as
many as fit the machine's GPUs (docs/runs.md). `scale=auto` picks what the machine can run."""

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

from model.config import DeepSeekConfig, LlamaConfig

ModelConfig = LlamaConfig | DeepSeekConfig

DTYPES = ("bfloat16", "float32", "float16")
SCALES = ("auto", "full", "fit", "proxy")


def setting(default, allowed: str | tuple | None = None, *, resume: str = "free", shown: str = ""):
    """A run field declared once, beside it: `allowed`, its range (">= 1"; what a special value
    means in brackets) or its choices (a tuple); `resume` "same" where a resume must keep it (it
    changes the trained numbers: runtime/checkpoints.py); `shown`, its row in runtime/header.py."""
    value = {"default_factory": default} if default is dict else {"default": default}
    return dataclasses.field(**value, metadata={"allowed": allowed, "resume": resume,
                                                "shown": shown})


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, cosine decay to min_lr_ratio * lr, and global-norm clipping."""
    lr: float = setting(3e-4, "> 0")
    warmup_steps: int = setting(2, ">= 0")
    min_lr_ratio: float = setting(0.1, "in [0, 1]")
    b1: float = setting(0.9, "in [0, 1)")
    b2: float = setting(0.95, "in [0, 1)")
    weight_decay: float = setting(0.1, ">= 0")
    clip_norm: float = setting(1.0, "> 0")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh: `data` replicas (e.g. slices over the data-centre network) x `fsdp` shards
    x `expert` shards, the innermost (trainer/program.py's mesh_of). Weights are sharded over
    fsdp x expert, the routed experts split over `expert` first; tokens over all three."""
    data: int = setting(1, ">= 1")
    fsdp: int = setting(-1, "-1 or >= 1 (-1: all the devices the other axes leave)")
    expert: int = setting(1, ">= 1")

    def shape(self, n_devices: int) -> tuple[int, int, int]:
        rest = n_devices // (self.data * self.expert) if self.data * self.expert > 0 else 0
        return self.data, (rest if self.fsdp == -1 else self.fsdp), self.expert

    @property
    def devices(self) -> int:
        """The devices the mesh spells out (fsdp=-1: as many as it takes; then not known)."""
        return self.data * self.fsdp * self.expert if self.fsdp > 0 else -1


MESH_AXES = ("data", "fsdp", "expert")  # the mesh's axis names, outermost first
# The XLA flags the study's rows set (docs/study.md).
LHS = "xla_gpu_enable_latency_hiding_scheduler"
PIPELINED = "xla_gpu_enable_pipelined_host_offloading"
ASYNC_LIMIT = "xla_gpu_experimental_parallel_async_compute_limit"
# What those flags take, checked before anything is traced: XLA checks a value only when it
# parses it, at compile time, and jaxlib does not expose the flags' types (docs/runs.md).
XLA_FLAG_TYPES = {LHS: bool, PIPELINED: bool, ASYNC_LIMIT: int}


def xla_flag_value(text: str) -> bool | int | str:
    """An XLA flag's value as a compile passes it (trainer/target.py)."""
    return {"true": True, "false": False}.get(text.lower(), int(text) if text.isdigit() else text)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Synthetic tokens when `path` is empty; else a folder `python train.py prepare` wrote (its
    dtype in its meta.json), or a flat token file (nanoGPT's .bin, uint16 unless `dtype` says)."""
    path: str = ""
    dtype: str = setting("auto", ("auto", "uint16", "uint32"))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    per_device_batch: int = setting(2, ">= 1", shown="batch")
    global_batch: int = setting(0, ">= 0 (0: per_device_batch x devices)", shown="batch")
    seq: int = setting(8192, ">= 1", resume="same", shown="batch")
    steps: int = setting(10, ">= 1", resume="same", shown="batch")
    optimizer: OptimizerConfig = setting(OptimizerConfig(), resume="same", shown="optimizer")
    # Activations and matmuls (weights cast per layer); param_dtype: master weights, AdamW state.
    compute_dtype: str = setting("bfloat16", DTYPES, resume="same", shown="dtypes")
    param_dtype: str = setting("float32", ("float32", "bfloat16"), resume="same", shown="dtypes")
    optimizer_state: str = setting("device", ("device", "host"), shown="placement")
    mesh: MeshConfig = setting(MeshConfig(), shown="devices")
    # A named placement (offload/activations.py); none: no checkpointing.
    preset: str = setting("remat", shown="placement")
    # placement.<tag>=device|offload|remat (or .<scan>.<tag>), over the preset
    placement: Mapping[str, str] = setting(dict, shown="placement")
    xla_flags: Mapping[str, str] = setting(dict, shown="xla flags")  # GPU only
    quant: str = setting("none", ("none", "nvfp4"), resume="same", shown="kernels")
    # Weight block scales per 16x16 tile (TE's recipe) or 1x16 block.
    quant_tiles: str = setting("16x16", ("16x16", "1x16"), resume="same", shown="kernels")
    # fp4: Dgrad and Wgrad in NVFP4 too (TE's recipe); bf16: the forward only (JAX's own).
    quant_backward: str = setting("fp4", ("fp4", "bf16"), resume="same", shown="kernels")
    data: DataConfig = setting(DataConfig(), resume="same", shown="data")
    # The val split's mean loss over eval_batches fixed batches (docs/data.md).
    eval_every: int = setting(0, ">= 0 (0: never)", shown="data")
    eval_batches: int = setting(8, ">= 1", shown="data")
    seed: int = setting(0, "in [0, 2**63) (numpy's seeds)", resume="same", shown="data")
    scale: str = setting("auto", SCALES, shown="scale")
    # scale=fit: GiB a device's program may hold (0: XLA's pool on a GPU, less a margin).
    fit_memory: float = setting(0.0, ">= 0 (0: a GPU's pool)", shown="fit")
    # A Hugging Face checkpoint directory of the experiment's family.
    init_from: str = setting("", shown="model")
    out_dir: str = setting("runs", shown="output")
    # Checkpoints (runtime/checkpoints.py) into checkpoint_dir (empty: <run folder>/checkpoints),
    # the newest `keep` kept. resume=latest | a run folder | a checkpoint directory | a step folder.
    checkpoint_every: int = setting(500, ">= 0 (0: only when stopped by a signal)",
                                    shown="checkpoints")
    checkpoint_dir: str = setting("", shown="checkpoints")
    keep: int = setting(3, ">= 1", shown="checkpoints")
    resume: str = setting("", shown="checkpoints")
    profile: bool = setting(False, shown="output")
    tensorboard: bool = setting(False, shown="output")  # an optional extra (docs/data.md)
    attention: str = setting("auto", ("auto", "cudnn", "xla"), shown="kernels")  # cudnn: GPUs
    # MoE models, dropless without an expert axis: sorted (grouped GEMMs) | dense | auto.
    expert_path: str = setting("auto", ("auto", "sorted", "dense"), shown="kernels")
    # A device's rows per expert, in balanced shares, in blocks over the expert axis (and on one
    # device without one); 0: dropless (docs/model.md).
    expert_capacity: float = setting(0.0, ">= 0 (0: dropless)", resume="same", shown="kernels")
    # The loss in sequence chunks, logits recomputed (trainer/step.py).
    loss_chunks: int = setting(1, ">= 1", shown="kernels")
    # DeepSeek-V3's aux-loss-free balancing step (gamma), sequence-wise balance loss (0.0001 there).
    router_bias_rate: float = setting(0.001, ">= 0", resume="same", shown="optimizer")
    balance_loss_weight: float = setting(0.0, ">= 0", resume="same", shown="optimizer")

    def batch(self, n_devices: int) -> int:
        return self.global_batch or self.per_device_batch * n_devices


# What every experiment changes at proxy scale: a short sequence, no mesh axes (a laptop may
# have one device), and f32, since a CPU has no bf16 matmul units (the run header says so).
PROXY_RUN = dict(seq=256, per_device_batch=2, compute_dtype="float32", mesh=MeshConfig(),
                 expert_capacity=0.0, loss_chunks=1)


@dataclasses.dataclass(frozen=True)
class Experiment:
    name: str
    summary: str
    model: ModelConfig
    proxy_model: ModelConfig
    run: RunConfig

    def at_scale(self, scale: str) -> tuple[ModelConfig, RunConfig]:
        """Full and fit: the study's model and run (a fit reduces them: runtime/fit.py)."""
        if scale in ("full", "fit"):
            return self.model, self.run
        return self.proxy_model, dataclasses.replace(self.run, **PROXY_RUN)


EXPERIMENTS: dict[str, Experiment] = {}
COMPARISONS: dict[str, tuple[str, ...]] = {}  # name -> experiments run one after another
# The study's measured TFLOP/s/device per row (docs/study.md, 128 GB200s): what each row's
# replayed step is compared with (python -m study compile, step-times).
STUDY_TFLOPS: dict[str, float] = {}


def register(name: str, summary: str, model: ModelConfig, proxy_model: ModelConfig,
             run: RunConfig, **run_changes) -> None:
    EXPERIMENTS[name] = Experiment(name, summary, model, proxy_model,
                                   dataclasses.replace(run, **run_changes))


class ConfigError(ValueError):
    """Bad experiment name, override or combination: reported as one line, exit status 2."""


def get(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; `python train.py --list` shows them")
    return EXPERIMENTS[name]


def parse_overrides(args: list[str]) -> dict[str, str]:
    if bad := [arg for arg in args if "=" not in arg or arg.startswith("=")]:
        raise ConfigError(f"expected key=value, got {bad[0]!r}")
    return dict(arg.split("=", 1) for arg in args)


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


# Keys a run took before they were renamed: their error names the new key.
RENAMED = {"policy": "preset"}


def _set(obj, path: list[str], text: str, full_key: str):
    """A copy of dataclass `obj` with the field at `path` set from `text`, typed by the field."""
    name, known = path[0], [f.name for f in dataclasses.fields(obj)]
    if full_key in RENAMED:
        raise ConfigError(f"unknown key {full_key!r}: it is {RENAMED[full_key]}= now "
                          f"({RENAMED[full_key]}={text})")
    if name not in known:
        raise ConfigError(f"unknown key {full_key!r}; {type(obj).__name__} has {', '.join(known)}")
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
    """`model.<field>=`, `placement.<tag>=` and run fields, each value typed by its field."""
    for key, text in overrides.items():
        path = key.split(".")
        if path[0] == "model" and len(path) > 1:
            model = _set(model, path[1:], text, key)
        elif path[0] == "placement" and len(path) in (2, 3):  # .<tag>, .<scan>.<tag>
            run = _set(run, ["placement", ".".join(path[1:])], text, key)
        else:
            run = _set(run, path, text, key)
    return model, run


def declared(cls=None, prefix: str = "", group=None):
    """(dotted key, its declaration) of every leaf setting of the run config; a group's leaves
    take the group's resume rule and row."""
    for f in dataclasses.fields(cls or RunConfig):
        meta = {"allowed": None, **f.metadata, **({k: group[k] for k in ("resume", "shown")}
                                                  if group else {})}
        if dataclasses.is_dataclass(f.default):
            yield from declared(type(f.default), f"{prefix}{f.name}.", meta)
        else:
            yield prefix + f.name, meta


# Every numeric field of the run (from its declaration) and of the model configs -> its range, one
# out of it one line (`router_bias_rate=-0.01 must be >= 0`); every choice field -> its choices.
CHOICES = {key: m["allowed"] for key, m in declared() if isinstance(m.get("allowed"), tuple)}
RANGES = {
    **{key: m["allowed"] for key, m in declared() if isinstance(m.get("allowed"), str)},
    **{f"model.{name}": "> 0" for name in (
        "vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
        "rope_theta", "max_position", "norm_eps", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim",
        "v_head_dim", "moe_d_ff", "n_experts", "experts_per_token", "n_shared_experts",
        "n_groups", "topk_groups", "routed_scaling", "rope_scaling.factor",
        "rope_scaling.original_max_position", "rope_scaling.low_freq_factor",
        "rope_scaling.high_freq_factor", "rope_scaling.beta_fast", "rope_scaling.beta_slow")},
    "model.n_dense_layers": ">= 1",
    "model.q_lora_rank": "> 0 (none: a plain q_proj)",
    "model.rope_scaling.mscale": ">= 0 (0 or none: Hugging Face's default)",
    "model.rope_scaling.mscale_all_dim": ">= 0 (0 or none: Hugging Face's default)",
}
_RULES = {
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    ">= 1": lambda v: v >= 1,
    "in [0, 1)": lambda v: 0 <= v < 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in [0, 2**63)": lambda v: 0 <= v < 2**63,
    "-1 or >= 1": lambda v: v == -1 or v >= 1,
}


def _value(config, key: str):
    """The field at a dotted key (None where the config has no such field)."""
    for name in key.split("."):
        config = getattr(config, name, None)
    return config


def out_of_range(model: ModelConfig, run: RunConfig, said=()) -> list[str]:
    """A line for each field of RANGES out of its range (a field of the other model family,
    or one set to None, has none), unless a line of `said` names it or its group."""
    found = []
    for key, allowed in RANGES.items():
        path = key.split(".")
        value = _value(model, key[6:]) if path[0] == "model" else _value(run, key)
        if value is None or _RULES[allowed.partition(" (")[0]](value):
            continue
        names = [".".join(path[:n]) for n in range(min(2, len(path)), len(path) + 1)]
        if not any(re.search(rf"(?<![\w.]){re.escape(n)}(?![\w.])", line)
                   for n in names for line in said):
            found.append(f"{key}={value!r} must be {allowed}")
    return found


def problems(model: ModelConfig, run: RunConfig, n_devices: int) -> list[str]:
    """Every impossible combination for this many devices, one line each."""
    found = list(model.problems())
    mesh = run.mesh
    data, fsdp, expert = mesh.shape(n_devices)
    experts = _expert_problems(model, run, fsdp)
    found += out_of_range(model, run, found + experts)
    for key, choices in CHOICES.items():
        if (value := _value(run, key)) not in choices:
            found.append(f"{key}={value!r}: choose one of {', '.join(choices)}")
    if run.loss_chunks >= 1 and run.seq % run.loss_chunks:
        found.append(f"seq={run.seq} is not divisible into loss_chunks={run.loss_chunks}")
    fp4_backward = run.quant == "nvfp4" and run.quant_backward == "fp4"
    if fp4_backward and run.quant_tiles != "16x16":
        found.append("quant_backward=fp4 reuses the forward's quantized weights transposed, which "
                     f"needs quant_tiles=16x16 (got {run.quant_tiles}; or quant_backward=bf16)")
    elif fp4_backward and run.seq % 16:
        found.append("quant_backward=fp4 quantizes the weight gradient's operands in blocks of "
                     f"16 tokens: seq={run.seq} must be a multiple of 16")
    if run.seq > model.max_position:
        found.append(f"seq={run.seq} is longer than the RoPE table allows "
                     f"(model.max_position={model.max_position})")
    # (An axis out of its range is said by the range table, not again here.)
    axes_in_range = min(mesh.data, mesh.expert) >= 1 and (mesh.fsdp == -1 or mesh.fsdp >= 1)
    if axes_in_range and (fsdp < 1 or data * fsdp * expert != n_devices):
        found.append(f"mesh data={mesh.data} x fsdp={mesh.fsdp} x expert={mesh.expert} does "
                     f"not cover the {n_devices} devices")
    elif axes_in_range and run.batch(n_devices) % n_devices:
        found.append(f"global_batch={run.batch(n_devices)} is not divisible over the "
                     f"{n_devices} devices")
    found += experts
    found += [f"xla_flags.{flag}: XLA flag names start with xla_"
              for flag in run.xla_flags if not flag.startswith("xla_")]
    words = {bool: "true or false", int: "a whole number"}
    found += [f"xla_flags.{flag}={text!r}: expected {words[XLA_FLAG_TYPES[flag]]}"
              for flag, text in run.xla_flags.items()
              if flag in XLA_FLAG_TYPES and type(xla_flag_value(text)) is not XLA_FLAG_TYPES[flag]]
    if not run.out_dir:  # (an unset shell variable): not the current folder
        found.append("out_dir='': name the folder a run's folder goes in (runs by default)")
    return found


def _expert_problems(model: ModelConfig, run: RunConfig, fsdp: int) -> list[str]:
    expert = run.mesh.expert
    if expert < 1 or fsdp < 1:
        return []  # out of its range, or the mesh does not cover the devices: said elsewhere
    if not isinstance(model, DeepSeekConfig):
        return [] if expert == 1 else [f"mesh.expert={expert}: this model has no routed "
                                       "experts to split (only DeepSeek does)"]
    if model.n_experts % expert:
        return [f"mesh.expert={expert} does not divide the model's n_experts={model.n_experts}"]
    if model.n_experts % (fsdp * expert):
        return [f"model.n_experts={model.n_experts} is not divisible over the fsdp x expert = "
                f"{fsdp * expert} devices the routed experts are sharded over"]
    return []


from configs import deepseek_v3, llama3, shakespeare  # noqa: E402,F401  (they register)
