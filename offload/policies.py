"""The tag vocabulary, placement tables and the `jax.checkpoint` policies they become.

A placement table maps a tag (a `checkpoint_name` in the model) to where its value waits
between the forward and the backward pass:
  device   kept in device memory;
  offload  copied to pinned host memory in the forward pass, streamed back for the backward;
  remat    not kept: recomputed in the backward pass from the layer's saved inputs.
A tag missing from a table is `remat`.
"""

from collections.abc import Mapping

import jax

# The only lists of tag names, per layer scan; tests check them against the traced models.
LLAMA_TAGS = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "attention_out",
              "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")
_MLA_TAGS = ("decoder_layer_input", "query_wa_proj", "mla_q", "kv_wa_proj", "mla_kv",
             "query_proj", "key_proj", "value_proj", "attention_out", "out_proj")
DEEPSEEK_DENSE_TAGS = (*_MLA_TAGS, "mlpwi_0", "mlpwi_1", "mlpwo")
# The MoE layer's shared expert is a SwiGLU (mlpwi_*); the routed experts are moe_mlpwi_*.
DEEPSEEK_MOE_TAGS = (*DEEPSEEK_DENSE_TAGS, "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")
PLACEMENTS = ("device", "offload", "remat")
# Every checkpointed layer keeps its input (the point its recomputation starts from): on
# device unless this tag is offloaded. "remat" cannot apply to it.
LAYER_INPUT = "decoder_layer_input"

# Named tables. "none" is not a table: it turns checkpointing off (autodiff keeps everything).
PRESETS: dict[str, dict[str, str]] = {
    "remat": {},
    "minimal": {t: "device" for t in ("query_proj", "key_proj", "value_proj", "out_proj",
                                      "mlpwi_0", "mlpwi_1", "mlpwo")},
    "qkv_offload": {t: "offload" for t in ("query_proj", "key_proj", "value_proj")},
    "minimal_offloaded": {t: "offload" for t in ("query_proj", "key_proj", "value_proj",
                                                 "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")},
}
NO_CHECKPOINT = "none"


def placement_table(preset: str, changes: Mapping[str, str] = (), tags=LLAMA_TAGS) -> dict:
    """The preset's table with `changes` applied, checked against the model's tags."""
    if preset not in PRESETS:
        raise ValueError(f"unknown policy {preset!r}; choose one of "
                         f"{', '.join([*PRESETS, NO_CHECKPOINT])}")
    table = {**PRESETS[preset], **dict(changes)}
    for tag, place in table.items():
        if tag not in tags:
            raise ValueError(f"policy.{tag}: the model has no tag {tag!r}; tags: {', '.join(tags)}")
        if place not in PLACEMENTS:
            raise ValueError(f"policy.{tag}={place!r}: placement must be one of "
                             f"{', '.join(PLACEMENTS)}")
    return table


def checkpoint_policy(table: Mapping[str, str]):
    """The `jax.checkpoint` policy that realises a placement table."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[t for t, p in table.items() if p == "device"],
        names_which_can_be_offloaded=[t for t, p in table.items() if p == "offload"],
        offload_src="device", offload_dst="pinned_host")
