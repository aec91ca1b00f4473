"""What a train step is built for (`Target`: this machine's devices, GPUs the study tools
compile for, or any backend) and what follows from it: kernels, the NVFP4 path, XLA flags."""

import dataclasses

import jax

from configs import RunConfig, xla_flag_value
from model import deepseek, quant
from model.config import DeepSeekConfig
from runtime.backend import quiet


@dataclasses.dataclass(frozen=True)
class Target:
    """What a train step is built for: `platform` "cpu" or "gpu" (with its compute capability),
    or "any": only kernels every backend lowers, for tracing and `jax.export` over abstract
    meshes. `compile_only`: devices that compile but cannot run (no memory to allocate)."""
    platform: str
    capability: tuple[int, int] | None = None
    devices: tuple = ()
    compile_only: bool = False

    @property
    def blackwell(self) -> bool:
        """Compute capability 10.x (B200, GB200): XLA runs block-scaled dots on FP4 cores."""
        return self.capability is not None and self.capability[0] == 10

    def pool_bytes(self) -> int | None:
        """What XLA's memory pool has on each of this machine's GPUs; None elsewhere."""
        if self.platform != "gpu" or self.compile_only:
            return None
        return (self.devices[0].memory_stats() or {}).get("bytes_limit")

    @property
    def description(self) -> str:
        kind = self.devices[0].device_kind if self.devices else self.platform
        return f"{len(self.devices)} x {kind}" + (", compile-only" if self.compile_only else "")


ANY = Target("any")


def this_machine() -> Target:
    with quiet():
        devices = tuple(jax.devices())
    capability = getattr(devices[0], "compute_capability", None)
    if capability is not None:
        capability = tuple(int(part) for part in str(capability).split(".")[:2])
    return Target(devices[0].platform, capability, devices)


def forward_options(model, run: RunConfig, target: Target) -> dict:
    """The forward arguments that depend on the target: the attention kernel, the NVFP4 path
    and, for MoE models, the routed experts' path (dense on CPUs, where ragged_dot is slow) or,
    with mesh.expert > 1, their split over the expert axis."""
    attention = "xla" if target.platform == "any" else run.attention
    if attention == "auto":
        fused = target.platform == "gpu" and run.compute_dtype in ("bfloat16", "float16")
        attention = "cudnn" if fused else "xla"
    options = {"attention": None if attention == "xla" else attention,
               "quantization": quantization(run, target)}
    if isinstance(model, DeepSeekConfig) and run.mesh.expert > 1:
        # A device runs each of its experts as one GEMM over its blocks: no expert path.
        options["expert_parallel"] = deepseek.ExpertParallel(run.mesh.expert, run.expert_capacity)
    elif isinstance(model, DeepSeekConfig):
        auto = "dense" if target.platform == "cpu" else "sorted"
        options["expert_path"] = auto if run.expert_path == "auto" else run.expert_path
    return options


def quantization(run: RunConfig, target: Target) -> quant.Quantization | None:
    """NVFP4 products on Blackwell's FP4 tensor cores, else dequantized (the same numbers)."""
    if run.quant == "none":
        return None
    return quant.Quantization("scaled" if target.blackwell else "dequantize",
                              run.quant_tiles == "16x16", run.quant_backward)


def quantization_words(q: quant.Quantization | None) -> str:
    """What a step does with its layer matrices, for its header and plan."""
    if q is None:
        return "weights unquantized"
    gemms = "every GEMM" if q.backward == "fp4" else "the forward GEMMs (backward in bf16)"
    if q.path == "scaled":
        return f"NVFP4: {gemms} of the layer matrices on FP4 tensor cores"
    tiles = "16x16 tiles" if q.two_d else "1x16 blocks"
    return (f"NVFP4 values ({tiles}) for {gemms} of the layer matrices, multiplied in the "
            "compute dtype: the same numbers, no FP4 speed-up")


def compiler_options(run: RunConfig, target: Target) -> dict:
    """The run's XLA flags as per-compile options, typed; a GPU target only, so they can never
    break a CPU compile."""
    if target.platform != "gpu":
        return {}
    return {k: xla_flag_value(v) for k, v in run.xla_flags.items()}
