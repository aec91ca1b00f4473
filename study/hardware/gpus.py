"""The GPUs a run is planned and compiled for, each described by XLA's own target spec.

`gpu_specs/*.txtpb` are XLA's GPU target descriptions (a `GpuTargetConfigProto` per GPU, read off
real devices), kept as published (jaxlib 0.12 reads them so; README.md there names their source):
the device memory the plans measure against, the compute capability that picks kernels, and what
lets `python -m study compile` run XLA's real GPU compiler without a GPU. No JAX import (configs).
"""

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from pathlib import Path

from configs import ConfigError

SPECS = Path(__file__).resolve().parent / "gpu_specs"


@dataclasses.dataclass(frozen=True, eq=False)  # one object per kind: compared by identity
class Gpu:
    """One GPU kind as the plans and the step-time replay see it (docs/hardware.md: sources)."""
    name: str  # the key users type: device=gb200
    per_host: int  # GPUs per host in the usual system (a GB200 NVL72 tray: 4; a DGX: 8)
    host_memory: int  # bytes of host memory per GPU there
    peaks: Mapping[str, float]  # dense FLOP/s per precision class of a GEMM's inputs
    nvlink: float  # GPU-GPU bytes/s each way
    nvlink_domain: int  # GPUs one NVLink fabric joins (NVL72: 72, a DGX: 8)
    network: float  # bytes/s each way per GPU between NVLink domains (its NIC)
    host_link: float  # bytes/s each way of one host link
    host_link_gpus: int  # GPUs that share one host link (a Grace serves two)
    # What a GEMM reaches of its peak, per precision class, fitted on one study row (named) by
    # `make step-times`; a class without a fitted figure runs at peak, reported as uncalibrated.
    efficiency: Mapping[str, float] = dataclasses.field(default_factory=dict)
    calibrated_on: Mapping[str, str] = dataclasses.field(default_factory=dict)
    collective_latency: float = 15e-6  # NCCL's base ring/tree latency (tuning.cc: 12-17 us)
    kernel_launch: float = 2e-6  # the gap between two kernels on one stream (assumed)

    @property
    def hbm(self) -> float:
        """HBM bytes/s, as XLA's spec has it."""
        return float(self._field("memory_bandwidth"))

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

    def domain_size(self, devices: int) -> int:
        """GPUs per NVLink domain when `devices` of them fill as few domains as they can, in
        equal parts (128 GB200s: two NVL72 racks of 64): device d is in domain d // size."""
        return devices // math.ceil(devices / self.nvlink_domain)

    def topology(self, devices: int) -> str:
        """XLA's topology for `devices` GPUs in hosts of `per_host`: slices x hosts x GPUs."""
        per_host = min(self.per_host, devices)
        if devices % per_host:
            raise ConfigError(f"gpus={devices}: {self.name} GPUs come {per_host} to a host; "
                              f"give at most {per_host} or a multiple of {per_host}")
        return f"1x{devices // per_host}x{per_host}"


# Dense peaks (sparsity doubles the datasheets' figures); "tf32" is what an f32 GEMM runs at.
# NVLink 5 moves 900 GB/s each way, NVLink 4 450; one 400 Gb/s NIC per GPU between domains.
# A GB200's host link is NVLink-C2C, 900 GB/s both ways per Grace, which serves two GPUs (how
# it divides between them is not published); the others' is PCIe Gen5 x16, ~50 GB/s measured.
BLACKWELL = {"bf16": 2.5e15, "fp8": 5e15, "fp4": 10e15, "tf32": 1.25e15}
HOPPER = {"bf16": 989e12, "fp8": 1979e12, "tf32": 495e12}
DGX = dict(per_host=8, host_memory=256 * 10**9, nvlink_domain=8, network=50e9, host_link=50e9,
           host_link_gpus=1)
GPUS = {gpu.name: gpu for gpu in (
    Gpu("gb200", per_host=4, host_memory=240 * 10**9, peaks=BLACKWELL, nvlink=900e9,
        nvlink_domain=72, network=50e9, host_link=450e9, host_link_gpus=2,
        efficiency={"bf16": 0.651, "fp4": 0.514},
        calibrated_on={"bf16": "deepseek671b-offload", "fp4": "llama405b-baseline"}),
    Gpu("b200", peaks={"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 9e15, "tf32": 1.125e15},
        nvlink=900e9, **DGX),
    Gpu("h200", peaks=HOPPER, nvlink=450e9, **DGX),
    Gpu("h100", peaks=HOPPER, nvlink=450e9, **DGX),
)}

# The GPU each experiment is planned, compiled and replayed for unless `device=NAME` says
# otherwise: the study's GB200s, but for the rows made for another machine.
EXPERIMENT_GPUS = {"llama70b-8xh200": "h200"}


def gpu_of(experiment: str, device: str = "") -> Gpu:
    """The GPU `experiment` is studied on: `device` (a key of GPUS) or its own."""
    name = device or EXPERIMENT_GPUS.get(experiment, "gb200")
    if name not in GPUS:
        from configs import ConfigError  # (configs imports no JAX: this module neither)
        raise ConfigError(f"device={name!r}: choose one of {', '.join(GPUS)}")
    return GPUS[name]
