"""What a train step is built for: this machine's devices, compile-only devices of a GPU
described by XLA's target spec (`compile_only`: XLA's real GPU compiler on a machine without
one), or "any" backend (tracing and export over abstract meshes); and what follows from it:
kernels, the NVFP4 path, the XLA flags a compile gets."""

import contextlib
import dataclasses

import jax
from jax.experimental import topologies

from configs import ConfigError, RunConfig
from configs.gpus import Gpu
from model import deepseek, quant
from model.config import DeepSeekConfig
from runtime.backend import has_cuda_plugin, pool_bytes, quiet


@dataclasses.dataclass(frozen=True)
class Target:
    """What a train step is built for: `platform` "cpu" or "gpu" (with its compute capability),
    or "any": only kernels every backend lowers, for tracing and `jax.export` over abstract
    meshes (the static plan). `gpu` is set for compile-only devices made from its spec."""
    platform: str
    capability: tuple[int, int] | None = None
    devices: tuple = ()
    gpu: Gpu | None = None

    @property
    def blackwell(self) -> bool:
        """Compute capability 10.x (B200, GB200): XLA runs block-scaled dots on FP4 cores."""
        return self.capability is not None and self.capability[0] == 10

    def pool_bytes(self) -> int | None:
        """What XLA's memory pool has on each GPU: the allocator's limit on a real one, the
        memory fraction of the spec's memory on compile-only ones; None elsewhere."""
        if self.gpu is not None:
            return pool_bytes(self.gpu)
        if self.platform != "gpu":
            return None
        return (self.devices[0].memory_stats() or {}).get("bytes_limit")

    @property
    def description(self) -> str:
        if self.gpu is not None:
            return (f"{len(self.devices)} x {self.gpu.device_kind}, compile-only (XLA's GPU "
                    "compiler, no GPU)")
        kind = self.devices[0].device_kind if self.devices else self.platform
        return f"{len(self.devices)} x {kind}"


ANY = Target("any")


def this_machine() -> Target:
    with quiet():
        devices = tuple(jax.devices())
    capability = getattr(devices[0], "compute_capability", None)
    if capability is not None:
        capability = tuple(int(part) for part in str(capability).split(".")[:2])
    return Target(devices[0].platform, capability, devices)


def compile_only(gpu: Gpu, n_devices: int) -> Target:
    """`n_devices` compile-only GPUs of `gpu`'s spec, in hosts of gpu.per_host."""
    if not has_cuda_plugin():
        raise ConfigError("compiling for a GPU needs the CUDA compile extra: "
                          ".venv/bin/pip install -e '.[gpu-compile]' (or make compile-...)")
    with quiet():
        topology = topologies.get_topology_desc(platform="cuda",
                                                topology=gpu.topology(n_devices),
                                                target_config=gpu.spec)
    return Target("gpu", gpu.capability, tuple(topology.devices), gpu)


@contextlib.contextmanager
def kernel_checks(target: Target):
    """While tracing for compile-only GPUs: JAX's Python-side cuDNN attention checks read the
    compute capability of the default backend (this machine's CPU), which would refuse
    DeepSeek's head dim 192 as if on an old GPU; they are given the target's instead."""
    if target.gpu is None:
        yield
        return
    # Reaching inside: the checks are module functions of JAX's cuDNN attention (jax 0.12).
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    def at_least(version: str) -> bool:
        return target.capability >= tuple(int(x) for x in version.split("."))

    def equal(version: str) -> bool:
        return target.capability == tuple(int(x) for x in version.split("."))

    names = ("check_compute_capability", "is_cuda_compute_capability_equal")
    saved = [getattr(cudnn_attention, name) for name in names]
    for name, check in zip(names, (at_least, equal)):
        setattr(cudnn_attention, name, check)
    try:
        yield
    finally:
        for name, check in zip(names, saved):
            setattr(cudnn_attention, name, check)


def forward_options(model, run: RunConfig, target: Target) -> dict:
    """The forward arguments that depend on the target: the attention kernel (cuDNN's fused
    one on GPUs in bf16/fp16, XLA's elsewhere, and always on target "any"), the NVFP4 path
    and, for MoE models, how routed experts are computed (grouped GEMMs on accelerators; every
    expert densely on CPUs, where ragged_dot is slow) or, with mesh.expert > 1, split over
    the expert axis."""
    on_cpu = target.platform == "cpu"
    attention = "xla" if target.platform == "any" else run.attention
    if attention == "auto":
        fused = target.platform == "gpu" and run.compute_dtype in ("bfloat16", "float16")
        attention = "cudnn" if fused else "xla"
    options = {"attention": None if attention == "xla" else attention,
               "quantization": quantization(run, target)}
    if isinstance(model, DeepSeekConfig) and run.mesh.expert > 1:
        # A device runs each of its experts as one GEMM over its blocks: no expert path.
        options["expert_parallel"] = deepseek.ExpertParallel(run.mesh.expert,
                                                             run.expert_capacity)
    elif isinstance(model, DeepSeekConfig):
        path = run.expert_path
        options["expert_path"] = ("dense" if on_cpu else "sorted") if path == "auto" else path
    return options


def quantization(run: RunConfig, target: Target) -> quant.Quantization | None:
    """NVFP4 products on Blackwell's FP4 tensor cores, else codes times scales and a GEMM in
    the compute dtype. With a bf16 backward (JAX's block-scaled dot: 1x16 weight blocks only)
    the forward alone is FP4."""
    if run.quant == "none":
        return None
    two_d, backward = run.quant_tiles == "16x16", run.quant_backward
    scaled = target.blackwell and (backward == "fp4" or not two_d)
    return quant.Quantization("scaled" if scaled else "dequantize", two_d, backward)


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


# Compile-only devices: XLA's CUB radix-sort rewriter asks the CUDA runtime for a device, and
# with no device to time kernels on, XLA's autotuning only compiles candidate kernel configs
# until one compiles (half of a compile's time). Off, the optimized program's instructions,
# schedule and buffers are the same (tests/test_gpu_compile.py); a real GPU keeps both.
DEVICELESS = {"xla_gpu_enable_cub_radix_sort": False, "xla_gpu_autotune_level": 0}


def compiler_options(run: RunConfig, target: Target) -> dict:
    """The run's XLA flags as per-compile options, typed; a GPU target only, so they can never
    break a CPU compile; on compile-only devices, DEVICELESS too."""
    if target.platform != "gpu":
        return {}
    def typed(v: str):
        return {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
    options = {k: typed(v) for k, v in run.xla_flags.items()}
    return {**options, **DEVICELESS} if target.gpu is not None else options
