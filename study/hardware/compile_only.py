"""Compile-only GPUs, made from XLA's target spec of a GPU (study/hardware/gpus.py), on which
XLA's real GPU compiler runs without one, and the options and checks only such a compile needs;
the device and pinned host memory a run takes of a GPU."""

import dataclasses
import functools
from unittest import mock

import jax
from jax.experimental import topologies

from configs import ConfigError
from runtime import backend
from runtime.backend import has_cuda_plugin, memory_fraction, quiet
from study.hardware.gpus import Gpu
from trainer.target import Target

# XLA's CUB radix-sort rewriter asks the CUDA runtime for a device, and with no device to time
# kernels on, XLA's autotuning only compiles candidate kernel configs until one compiles (half
# of a compile's time). Off, the optimized program's instructions, schedule and buffers are
# the same (tests/test_gpu_compile.py); a real GPU keeps both.
DEVICELESS = {"xla_gpu_enable_cub_radix_sort": False, "xla_gpu_autotune_level": 0}


def pool_bytes(gpu: Gpu) -> int:
    """What XLA's memory pool takes of one `gpu`: the memory fraction of its memory."""
    return int(memory_fraction()[0] * gpu.memory)


def host_limit(gpu: Gpu, gpus: int) -> int:
    """Pinned host bytes a run's process may hold on a host of `gpus` `gpu`s (at most a
    host's): XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB if this shell set it, else what a run there sets
    (runtime/backend.py), within the host's memory (study/hardware/gpus.py)."""
    memory = gpu.host_memory * min(gpu.per_host, gpus)
    gib = (backend.host_limit_gib() if backend.HOST_LIMIT_GIVEN
           else backend.default_host_limit_gib(memory))
    return min(gib * 2**30, memory)


@dataclasses.dataclass(frozen=True)
class CompileOnly(Target):
    """GPUs that compile but cannot run: no memory to allocate, measure or hold a pool. Their
    devices have no memory kinds (jax 0.12.0.1 drops `pinned_host` from a sharding on them), so
    a program shards its values on their mesh's abstract mesh, whose shardings keep them: the
    state a GPU run keeps in host memory is the compiled program's host arguments, as there."""

    def pool_bytes(self) -> None:
        return None

    def mesh(self, mesh):
        return mesh.abstract_mesh

    def tracing(self, mesh):
        return jax.set_mesh(mesh)  # the devices the abstract mesh's shardings lower onto

    @property
    def description(self) -> str:
        return f"{super().description}, compile-only"


@functools.cache  # one per GPU kind and count, shared by every compile for them
def compile_only(gpu: Gpu, n_devices: int) -> Target:
    """`n_devices` compile-only GPUs of `gpu`'s spec, in hosts of gpu.per_host."""
    if not has_cuda_plugin():
        raise ConfigError("compiling for a GPU needs the CUDA compile extra: "
                          ".venv/bin/pip install -e '.[gpu-compile]' (or make compile-...)")
    with quiet():
        topology = topologies.get_topology_desc(platform="cuda",
                                                topology=gpu.topology(n_devices),
                                                target_config=gpu.spec)
    return CompileOnly("gpu", gpu.capability, tuple(topology.devices))


def kernel_checks(target: Target):
    """While tracing for compile-only GPUs: JAX's Python-side cuDNN attention checks read the
    compute capability of the default backend (this machine's CPU), which would refuse
    DeepSeek's head dim 192 as if on an old GPU; they are given the target's instead."""
    # Reaching inside: the checks are module functions of JAX's cuDNN attention (jax 0.12).
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split("."))

    return mock.patch.multiple(
        cudnn_attention,
        check_compute_capability=lambda v: target.capability >= version(v),
        is_cuda_compute_capability_equal=lambda v: target.capability == version(v))
