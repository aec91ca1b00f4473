"""Run settings, each declared once beside its field; what an experiment is. No JAX import."""

import dataclasses
import math
from collections.abc import Mapping

from model.config import DeepSeekConfig, LlamaConfig

ModelConfig = LlamaConfig | DeepSeekConfig

SCALES = ("auto", "full", "fit", "proxy")


@dataclasses.dataclass(frozen=True)
class Range:
    """Numbers from low (taken unless `low_taken` is False) to below high (or to it: `high_taken`),
    and `also`; as users read it, `note` saying what a special value means: `>= 0 (0: never)`."""
    low: int
    high: int | float = math.inf
    low_taken: bool = True
    high_taken: bool = False
    also: int | None = None
    note: str = ""

    def __contains__(self, value) -> bool:
        above = self.low <= value if self.low_taken else self.low < value
        below = value <= self.high if self.high_taken else value < self.high
        return value == self.also or (above and below)

    def __str__(self) -> str:
        ends = ("[" if self.low_taken else "(") + ("]" if self.high_taken else ")")
        high = "2**63" if self.high == 2**63 else self.high  # numpy's seeds' end, as users know it
        words = f"in {ends[0]}{self.low}, {high}{ends[1]}" if self.high < math.inf else (
            f"{'>=' if self.low_taken else '>'} {self.low}")
        words = words if self.also is None else f"{self.also} or {words}"
        return f"{words} ({self.note})" if self.note else words


def setting(default, allowed=None, *, resume: str = "free", shown: str = ""):
    """A run field declared once, beside it: `allowed`, its Range or its choices (a tuple);
    `resume` "same" where a resume must keep it (it changes the trained numbers:
    runtime/checkpoints.py); `shown`, its row in runtime/header.py."""
    value = {"default_factory": default} if default is dict else {"default": default}
    return dataclasses.field(**value, metadata={"allowed": allowed, "resume": resume,
                                                "shown": shown})


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, cosine decay to min_lr_ratio * lr, and global-norm clipping."""
    lr: float = setting(3e-4, Range(0, low_taken=False))
    warmup_steps: int = setting(2, Range(0))
    min_lr_ratio: float = setting(0.1, Range(0, 1, high_taken=True))
    b1: float = setting(0.9, Range(0, 1))
    b2: float = setting(0.95, Range(0, 1))
    weight_decay: float = setting(0.1, Range(0))
    clip_norm: float = setting(1.0, Range(0, low_taken=False))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh: `data` replicas (e.g. slices over the data-centre network) x `fsdp` shards
    x `expert` shards, the innermost (trainer/program.py's mesh_of). Weights are sharded over
    fsdp x expert, the routed experts split over `expert` first; tokens over all three."""
    data: int = setting(1, Range(1))
    fsdp: int = setting(-1, Range(1, also=-1, note="-1: all the devices the other axes leave"))
    expert: int = setting(1, Range(1))

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
    return {"true": True, "false": False}.get(text.lower(), int(text) if whole(text) else text)


def whole(text: str) -> bool:
    """Whether a word is a whole number `int` reads: ASCII digits (`str.isdigit` takes "²")."""
    return text.isascii() and text.isdigit()


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Synthetic tokens when `path` is empty; else a folder `python train.py prepare` wrote (its
    dtype in its meta.json), or a flat token file (nanoGPT's .bin, uint16 unless `dtype` says)."""
    path: str = ""
    dtype: str = setting("auto", ("auto", "uint16", "uint32"))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    per_device_batch: int = setting(2, Range(1), shown="batch")
    global_batch: int = setting(0, Range(0, note="0: per_device_batch x devices"), shown="batch")
    seq: int = setting(8192, Range(1), resume="same", shown="batch")
    steps: int = setting(10, Range(1), resume="same", shown="batch")
    optimizer: OptimizerConfig = setting(OptimizerConfig(), resume="same", shown="optimizer")
    # Activations and matmuls (weights cast per layer); param_dtype: master weights, AdamW state.
    compute_dtype: str = setting("bfloat16", ("bfloat16", "float32", "float16"), resume="same",
                                 shown="dtypes")
    param_dtype: str = setting("float32", ("float32", "bfloat16"), resume="same", shown="dtypes")
    optimizer_state: str = setting("device", ("device", "host"), shown="placement")
    # The layer scans' FP32 weights and gradients in pinned host memory, a layer at a time on
    # the device (offload/state.py); the embedding, final norm and LM head stay on the device.
    parameters: str = setting("device", ("device", "host"), shown="placement")
    mesh: MeshConfig = setting(MeshConfig(), shown="devices")
    # A named placement (offload/activations.py); none: no checkpointing; auto: the fastest
    # that fits this machine, each candidate compiled and timed for auto_steps steps.
    preset: str = setting("remat", shown="placement")
    auto_steps: int = setting(3, Range(1), shown="placement")
    # Changes to the preset's placement, one tag each: placement.<tag>=device|offload|remat
    # (or .<scan>.<tag>) on the command line.
    tag_changes: Mapping[str, str] = setting(dict, shown="placement")
    xla_flags: Mapping[str, str] = setting(dict, shown="xla flags")  # GPU only
    quant: str = setting("none", ("none", "nvfp4"), resume="same", shown="kernels")
    # Weight block scales per 16x16 tile (TE's recipe) or 1x16 block.
    quant_tiles: str = setting("16x16", ("16x16", "1x16"), resume="same", shown="kernels")
    # fp4: Dgrad and Wgrad in NVFP4 too (TE's recipe); bf16: the forward only (JAX's own).
    quant_backward: str = setting("fp4", ("fp4", "bf16"), resume="same", shown="kernels")
    data: DataConfig = setting(DataConfig(), resume="same", shown="data")
    # The val split's mean loss over eval_batches fixed batches (docs/data.md).
    eval_every: int = setting(0, Range(0, note="0: never"), shown="data")
    eval_batches: int = setting(8, Range(1), shown="data")
    seed: int = setting(0, Range(0, 2**63, note="numpy's seeds"), resume="same", shown="data")
    scale: str = setting("auto", SCALES, shown="scale")
    # scale=fit and preset=auto: GiB a device's program may hold (0: XLA's pool on a GPU, less
    # a margin; elsewhere not bounded).
    fit_memory: float = setting(0.0, Range(0, note="0: a GPU's pool"), shown="fit")
    # A Hugging Face checkpoint directory of the experiment's family.
    init_from: str = setting("", shown="model")
    out_dir: str = setting("runs", shown="output")
    # Checkpoints (runtime/checkpoints.py) into checkpoint_dir (empty: <run folder>/checkpoints),
    # the newest `keep` kept. resume=latest | a run folder | a checkpoint directory | a step folder.
    checkpoint_every: int = setting(500, Range(0, note="0: only when stopped by a signal"),
                                    shown="checkpoints")
    checkpoint_dir: str = setting("", shown="checkpoints")
    keep: int = setting(3, Range(1), shown="checkpoints")
    resume: str = setting("", shown="checkpoints")
    profile: bool = setting(False, shown="output")
    tensorboard: bool = setting(False, shown="output")  # an optional extra (docs/data.md)
    attention: str = setting("auto", ("auto", "cudnn", "xla"), shown="kernels")  # cudnn: GPUs
    # MoE models, dropless without an expert axis: sorted (grouped GEMMs) | dense | tiled | auto.
    expert_path: str = setting("auto", ("auto", "sorted", "dense", "tiled"), shown="kernels")
    # A device's rows per expert, in balanced shares, in blocks over the expert axis (and on one
    # device without one); 0: dropless (docs/model.md).
    expert_capacity: float = setting(0.0, Range(0, note="0: dropless"), resume="same",
                                   shown="kernels")
    # The loss in sequence chunks, logits recomputed (trainer/step.py).
    loss_chunks: int = setting(1, Range(1), shown="kernels")
    # DeepSeek-V3's aux-loss-free balancing step (gamma), sequence-wise balance loss (0.0001 there).
    router_bias_rate: float = setting(0.001, Range(0), resume="same", shown="optimizer")
    balance_loss_weight: float = setting(0.0, Range(0), resume="same", shown="optimizer")

    def batch(self, n_devices: int) -> int:
        return self.global_batch or self.per_device_batch * n_devices


# What every experiment changes at proxy scale: a short sequence, no mesh axes (a laptop may
# have one device), and f32, since a CPU has no bf16 matmul units (the run header says so).
PROXY_RUN = dict(seq=256, per_device_batch=2, compute_dtype="float32", mesh=MeshConfig(),
                 expert_capacity=0.0, loss_chunks=1)


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A full-scale model and run (the study's) and a proxy, the same family sized for a laptop's
    CPU; the fit scale keeps the full-scale layers that fit the GPUs (docs/runs.md)."""
    name: str
    summary: str
    model: ModelConfig
    proxy_model: ModelConfig
    run: RunConfig
    study_tflops: float | None = None  # the study's measured TFLOP/s per GB200 (docs/study.md)

    def at_scale(self, scale: str) -> tuple[ModelConfig, RunConfig]:
        """Full and fit: the study's model and run (a fit reduces them: runtime/fit.py)."""
        if scale in ("full", "fit"):
            return self.model, self.run
        return self.proxy_model, dataclasses.replace(self.run, **PROXY_RUN)


def experiment(name, summary, model, proxy_model, run: RunConfig, study_tflops=None,
               **run_changes) -> Experiment:
    return Experiment(name, summary, model, proxy_model, dataclasses.replace(run, **run_changes),
                      study_tflops)


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
