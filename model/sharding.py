"""Logical sharding: model code names what an axis is (batch, embed, heads); one table,
`AxisRules`, says which mesh axis shards it."""

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Logical axis name -> mesh axis (or axes, or None for replicated): a new parallelism is
    one edited default, not edits across the model. FSDP: weights are sharded along `embed`,
    activations along `batch`, over the same devices. Expert parallelism (`experts`,
    `exchange`): the routed experts split over `expert` and FSDP-sharded over `fsdp`; every
    other weight is sharded over both."""
    batch: MeshAxes = ("data", "fsdp", "expert")
    seq: MeshAxes = None
    embed: MeshAxes = ("fsdp", "expert")
    vocab: MeshAxes = None
    heads: MeshAxes = None
    kv_heads: MeshAxes = None
    head_dim: MeshAxes = None
    mlp: MeshAxes = None
    latent: MeshAxes = None  # MLA's low-rank latents, as outputs
    lora: MeshAxes = ("fsdp", "expert")  # the same latents as the input of up-projections
    # The routed-expert weights' expert axis, at rest: the expert groups' share of the experts,
    # FSDP-sharded along the same axis (MaxText's shard_exp_on_fsdp), so a layer gathers along
    # the stack's major axis and XLA keeps no transposed copy of the stack (docs/study.md).
    experts: MeshAxes = ("expert", "fsdp")
    expert_embed: MeshAxes = None  # their embed axis
    exchange: MeshAxes = "expert"  # the devices of one expert group, which exchange tokens
    layers: MeshAxes = None
    mesh: Mesh | AbstractMesh | None = None  # abstract when exporting without devices

    def sharding(self, logical: tuple[str | None, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical))

    def spec(self, logical: tuple[str | None, ...]) -> PartitionSpec:
        mapped = [self._present(getattr(self, name)) if name else None for name in logical]
        used = [a for m in mapped if m for a in ((m,) if isinstance(m, str) else m)]
        if len(used) != len(set(used)):
            raise ValueError(f"logical axes {logical} map a mesh axis twice: {mapped}")
        return PartitionSpec(*mapped)

    def _present(self, axes: MeshAxes) -> MeshAxes:
        """`axes` less those the mesh lacks (a mesh of data x fsdp is expert parallelism of 1)."""
        if axes is None or self.mesh is None:
            return axes
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes)
                     if a in self.mesh.axis_names)
        return kept[0] if len(kept) == 1 else kept or None


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...], devices=None) -> Mesh:
    """The first prod(shape) `devices` (default all) in their order, axes Auto: XLA propagates
    our hints."""
    devices = np.asarray(jax.devices() if devices is None else devices, dtype=object)
    return Mesh(devices[:math.prod(shape)].reshape(shape), names,
                axis_types=(AxisType.Auto,) * len(names))


def constrain(x: jax.Array, rules: AxisRules | None, logical: tuple[str | None, ...]):
    return x if rules is None else jax.lax.with_sharding_constraint(x, rules.sharding(logical))
