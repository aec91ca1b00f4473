"""How JAX starts in this process, and what a train step is built for.

Import this module before anything else imports JAX: it settles what must be settled before
JAX starts.
  - A machine without an NVIDIA GPU but with the CUDA plugin installed (the `gpu-compile`
    extra) runs on the CPU backend, and the plugin's C++ start-up messages ("Could not find
    cuda drivers ...", written below Python's sys.stderr) are dropped, so a CPU run prints what
    it would print without the plugin.
  - XLA's GPU memory pool takes MEMORY_FRACTION of each GPU unless the environment already
    says (XLA_CLIENT_MEM_FRACTION, or the older XLA_PYTHON_CLIENT_MEM_FRACTION); plans and
    compiles measure against that same figure.
  - All-reduces go to NCCL, not XLA's Triton one-shot kernels (NCCL_ALL_REDUCES, unless
    XLA_FLAGS already names the setting): jaxlib 0.12.0.1's GPU compiler aborts on a scalar
    all-reduce over 64 GB200s ("LLVM Fatal Error ... size mismatch when packing elements"),
    and XLA reads this list-valued setting only from XLA_FLAGS, not from a compile's options.

A `Target` is what a step is compiled for: this machine's devices, or compile-only devices of
a GPU described by XLA's target spec (`compile_only`), which run XLA's real GPU compiler on a
machine without one.
"""

import contextlib
import ctypes.util
import dataclasses
import glob
import importlib.util
import os
import re
import sys
import tempfile

from configs import ConfigError
from configs.gpus import Gpu

# JAX's own default leaves a quarter of the GPU unused (46 GiB of a GB200), and the study's
# DeepSeek-V3 row ran in 165.2 of a GB200's 184.3 GiB; 5% stays outside XLA's pool for the
# CUDA context and NCCL's buffers.
MEMORY_FRACTION = 0.95
FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
NCCL_ALL_REDUCES = "--xla_gpu_experimental_use_collective_kernels=-ALL_REDUCE"
_CUDA_STUB_NOISE = re.compile(r"absl::InitializeLog\(\) is called|cudart_stub\.cc.*cuda drivers")


def has_gpu() -> bool:
    """An NVIDIA GPU's device node (/dev/dxg under WSL) or its driver's library."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg")
                or ctypes.util.find_library("cuda"))


def has_cuda_plugin() -> bool:
    return importlib.util.find_spec("jax_cuda12_plugin") is not None


def memory_fraction() -> tuple[float, str]:
    """(the share of each GPU's memory XLA's pool takes, the variable that says so)."""
    for name in FRACTION_VARIABLES:
        if os.environ.get(name):
            try:
                fraction = float(os.environ[name])
            except ValueError:
                fraction = -1.0
            if not 0 < fraction <= 1:
                raise ConfigError(f"{name}={os.environ[name]!r}: expected a fraction in (0, 1]")
            return fraction, name
    return MEMORY_FRACTION, FRACTION_VARIABLES[0]


def pool_bytes(gpu: Gpu) -> int:
    """What XLA's memory pool takes of one `gpu`: the memory fraction of its memory."""
    return int(memory_fraction()[0] * gpu.memory)


@contextlib.contextmanager
def quiet():
    """Drop the CUDA plugin's start-up messages on a machine without a GPU; keep the rest of
    what is written to file descriptor 2 meanwhile (C++ libraries write there directly)."""
    if has_gpu() or not has_cuda_plugin():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not _CUDA_STUB_NOISE.search(line)))


if has_cuda_plugin() and not has_gpu():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
if not any(os.environ.get(name) for name in FRACTION_VARIABLES):
    os.environ[FRACTION_VARIABLES[0]] = str(MEMORY_FRACTION)
if NCCL_ALL_REDUCES.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NCCL_ALL_REDUCES}".strip()
with quiet():
    import jax
    from jax.experimental import topologies


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
