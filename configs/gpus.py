"""The GPUs a run is planned and compiled for, each described by XLA's own target spec.

`gpu_specs/*.txtpb` are XLA's GPU target descriptions (a `GpuTargetConfigProto` per GPU, read
off real devices), kept as published; README.md there names their source. They give the
device memory the plans measure against and the compute capability that picks kernels, and
they let `--compile` run XLA's real GPU compiler without a GPU (jaxlib 0.12 reads them as
published). No JAX import (see configs).
"""

import dataclasses
import functools
import re
from pathlib import Path

SPECS = Path(__file__).resolve().parent / "gpu_specs"


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str  # the key users type: device=gb200
    per_host: int  # GPUs per host in the usual system (a GB200 NVL72 tray: 4; a DGX: 8)
    host_memory: int  # bytes of host memory per GPU there (hardware.md)
    # The time model's figures, from ../shared/reference/hardware.md (public figures):
    bf16_flops: float  # dense bf16 peak, FLOP/s
    nvlink: float  # GPU-GPU bytes/s each way
    host_link: float  # GPU-host bytes/s each way

    @functools.cached_property
    def spec(self) -> str:
        return (SPECS / f"{self.name}.txtpb").read_text()

    def _field(self, name: str) -> str:
        return re.search(rf"^\s*{name}: (.+)$", self.spec, re.MULTILINE).group(1)

    @property
    def memory(self) -> int:
        """The GPU's memory in bytes, as the driver reports it (what JAX takes a fraction of)."""
        return int(self._field("device_memory_size"))

    @property
    def capability(self) -> tuple[int, int]:
        block = re.search(r"cuda_compute_capability \{([^}]*)\}", self.spec).group(1)
        numbers = dict(re.findall(r"(major|minor): (\d+)", block))
        return int(numbers.get("major", 0)), int(numbers.get("minor", 0))

    @property
    def device_kind(self) -> str:
        return self._field("name").strip('"')

    def topology(self, devices: int) -> str:
        """XLA's topology for `devices` GPUs in hosts of `per_host`: slices x hosts x GPUs."""
        per_host = min(self.per_host, devices)
        if devices % per_host:
            raise ValueError(f"{devices} {self.name} GPUs do not fill hosts of {per_host}")
        return f"1x{devices // per_host}x{per_host}"


# A GB200 NVL72 Grace has 480 GB for its two GPUs; a DGX B200 / H200 / H100 has 2 TB for eight.
# NVLink 5 moves 900 GB/s each way, NVLink 4 450. The GB200's host link is NVLink-C2C, 900 GB/s
# both ways per superchip (whether each of a Grace's two GPUs gets all of it is not confirmed);
# the others' is PCIe Gen5 x16, 64 GB/s in theory and ~50 measured (nvbandwidth issues 24, 53).
# Dense bf16 peaks: B200 2.25-2.5 PFLOP/s (the lower), H100/H200 989 TFLOP/s (not the sparse 1,979).
GPUS = {gpu.name: gpu for gpu in (
    Gpu("gb200", per_host=4, host_memory=240 * 10**9, bf16_flops=2.5e15, nvlink=900e9,
        host_link=450e9),
    Gpu("b200", per_host=8, host_memory=256 * 10**9, bf16_flops=2.25e15, nvlink=900e9,
        host_link=50e9),
    Gpu("h200", per_host=8, host_memory=256 * 10**9, bf16_flops=989e12, nvlink=450e9,
        host_link=50e9),
    Gpu("h100", per_host=8, host_memory=256 * 10**9, bf16_flops=989e12, nvlink=450e9,
        host_link=50e9),
)}
