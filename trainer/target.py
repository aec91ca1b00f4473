"""What a train step is built for (`Target`: this machine's devices, GPUs the study tools
compile for, or any backend) and what follows from it: the NVFP4 path, the XLA flags."""

import contextlib
import dataclasses

import jax

from configs import RunConfig, xla_flag_value
from model import quant
from runtime.backend import quiet


@dataclasses.dataclass(frozen=True)
class Target:
    """`platform` "cpu" or "gpu" (with its compute capability), or "any": only kernels every
    backend lowers, for tracing and `jax.export` over abstract meshes."""
    platform: str
    capability: tuple[int, int] | None = None
    devices: tuple = ()

    @property
    def blackwell(self) -> bool:
        """Compute capability 10.x (B200, GB200): XLA runs block-scaled dots on FP4 cores."""
        return self.capability is not None and self.capability[0] == 10

    def pool_bytes(self) -> int | None:
        """What XLA's memory pool has on each of this machine's GPUs; None elsewhere."""
        if self.platform != "gpu":
            return None
        return (self.devices[0].memory_stats() or {}).get("bytes_limit")

    @property
    def description(self) -> str:
        kind = self.devices[0].device_kind if self.devices else self.platform
        return f"{len(self.devices)} x {kind}"

    def mesh(self, mesh: jax.sharding.Mesh):
        """The mesh a program on `mesh` (over these devices) shards its values on: `mesh`."""
        return mesh

    def tracing(self, mesh: jax.sharding.Mesh):
        """Where a program on `mesh` is traced."""
        return contextlib.nullcontext()


ANY = Target("any")


def this_machine() -> Target:
    with quiet():
        devices = tuple(jax.devices())
    capability = getattr(devices[0], "compute_capability", None)
    if capability is not None:
        capability = tuple(int(part) for part in str(capability).split(".")[:2])
    return Target(devices[0].platform, capability, devices)


def quantization(run: RunConfig, target: Target) -> quant.Quantization | None:
    """NVFP4 products on Blackwell's FP4 tensor cores, else dequantized (the same numbers)."""
    if run.quant == "none":
        return None
    return quant.Quantization("scaled" if target.blackwell else "dequantize",
                              run.quant_tiles == "16x16", run.quant_backward)


def compiler_options(run: RunConfig, target: Target) -> dict:
    """The run's XLA flags as typed per-compile options, a GPU target's only: never a CPU's."""
    if target.platform != "gpu":
        return {}
    return {k: xla_flag_value(v) for k, v in run.xla_flags.items()}
