"""The activations' placement and the `jax.checkpoint` policies it becomes.

A placement maps each layer scan's tags (`checkpoint_name`s in the model) to where each value
waits between the forward and the backward pass:
  device   kept in device memory;
  offload  copied to pinned host memory in the forward pass, streamed back for the backward;
  remat    not kept: recomputed in the backward pass from the layer's saved inputs.
A tag it does not name is `remat`. The state's offload (weights, optimizer state) is state.py."""

from collections.abc import Mapping

import jax

PLACEMENTS = ("device", "offload", "remat")
# Every checkpointed layer keeps its input (where its recomputation starts): on device unless
# this tag is offloaded; "remat" cannot apply to it. Each family's scans list it first.
LAYER_INPUT = "decoder_layer_input"

_QKV = ("query_proj", "key_proj", "value_proj")
_MINIMAL = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")
# DeepSeek-V3's rows: the tensors the study offloads, every other tag recomputed as MaxText's
# custom policy does (docs/study.md quotes the study and the recipe for each name).
_DSV3 = ("dense_layers.mlpwi_0", "dense_layers.mlpwi_1", "dense_layers.mlpwo",
         "moe_layers.query_wa_proj", "moe_layers.kv_wa_proj", "moe_layers.moe_mlpwi_0",
         "moe_layers.moe_mlpwi_1")
# Presets, named placements a run changes single tags over, keyed as placement.<key>= overrides:
# `tag` for every scan that has it, `scan.tag` for one. "none" turns checkpointing off.
PRESETS: dict[str, dict] = {
    "remat": {},
    "minimal": dict.fromkeys(_MINIMAL, "device"),
    "qkv_offload": dict.fromkeys(_QKV, "offload"),
    "minimal_offloaded": dict.fromkeys(_MINIMAL, "offload"),
    "dsv3_offload": dict.fromkeys(_DSV3, "offload"),
    "dsv3_device": dict.fromkeys(_DSV3, "device"),
}
NO_CHECKPOINT = "none"
AUTO = "auto"  # the fastest placement that fits, measured on the run's machine: runtime/auto.py


def presets_for(scan_tags: Mapping) -> list[str]:
    """The presets that name only scans this model has."""
    return [name for name, table in PRESETS.items()
            if {key.rpartition(".")[0] for key in table} <= {"", *scan_tags}]  # "": any scan


def resolve(preset: str, changes: Mapping[str, str], scan_tags: Mapping) -> dict:
    """scan -> {tag: placement}: the preset, then `changes`, each checked against the model's."""
    if preset == AUTO:  # (a run resolves it to a preset before this: runtime/setup.py)
        raise ValueError(f"preset={AUTO} is chosen by timing compiled candidates on a run's "
                         f"own devices; name one here: {', '.join([*PRESETS, NO_CHECKPOINT])}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of "
                         f"{', '.join([*PRESETS, NO_CHECKPOINT, AUTO])}")
    if preset not in (fitting := presets_for(scan_tags)):  # named as typed, not by a key of it
        scans = sorted({key.rpartition(".")[0] for key in PRESETS[preset]} - {"", *scan_tags})
        raise ValueError(f"preset={preset} places layer scans this model does not have "
                         f"({', '.join(scans)}); its presets: {', '.join(fitting)}, "
                         f"{NO_CHECKPOINT}")
    tables = {scan: {} for scan in scan_tags}
    for key, place in [*PRESETS[preset].items(), *dict(changes).items()]:
        scan, _, tag = key.rpartition(".")
        if scan and scan not in scan_tags:
            raise ValueError(f"placement.{key}: the model has no layer scan {scan!r}; scans: "
                             f"{', '.join(scan_tags)}")
        scans = [scan] if scan else [s for s, tags in scan_tags.items() if tag in tags]
        if not scans or any(tag not in scan_tags[s] for s in scans):
            known = scan_tags[scan] if scan else sorted({t for s in scan_tags.values() for t in s})
            raise ValueError(f"placement.{key}: the model has no tag {tag!r} there; tags"
                             f"{f' of {scan}' if scan else ''}: {', '.join(known)}")
        if place not in PLACEMENTS:
            raise ValueError(f"placement.{key}={place!r}: placement must be one of "
                             f"{', '.join(PLACEMENTS)}")
        for s in scans:
            tables[s][tag] = place
    return tables


def checkpoint_policy(table: Mapping[str, str]):
    """The `jax.checkpoint` policy that realises one scan's placement."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[t for t, p in table.items() if p == "device"],
        names_which_can_be_offloaded=[t for t, p in table.items() if p == "offload"],
        offload_src="device", offload_dst="pinned_host")
