"""DeepSeek-V3 671B and the study's DeepSeek experiments (docs/study.md, the DeepSeek table)."""

import dataclasses
from functools import partial

from configs.settings import ASYNC_LIMIT, LHS, PIPELINED, MeshConfig, RunConfig, experiment
from model.config import DeepSeekConfig

DEEPSEEK_V3 = DeepSeekConfig(
    vocab=129_280, d_model=7168, n_layers=61, n_dense_layers=3, n_heads=128, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, d_ff=18_432,
    moe_d_ff=2048, n_experts=256, experts_per_token=8, n_shared_experts=1, n_groups=8,
    topk_groups=4, routed_scaling=2.5)

# Proxy: the same structure (MLA with q LoRA, a dense first layer, 8 expert groups of which a
# token uses 4, a shared expert, YaRN), 512 wide, small enough for a CPU. No expert axis
# (PROXY_RUN): mesh.expert=2 or 4 splits its experts as the full rows do, at several times the cost.
PROXY_V3 = dataclasses.replace(
    DEEPSEEK_V3, vocab=32_768, d_model=512, n_layers=4, n_dense_layers=1, n_heads=8,
    q_lora_rank=128, kv_lora_rank=64, qk_nope_dim=32, qk_rope_dim=16, v_head_dim=32, d_ff=1344,
    moe_d_ff=160, n_experts=16, experts_per_token=4)

# The study gives no sequence length: 4096, the model's original context, is assumed. The mesh and
# expert blocks are JAX-Toolbox's MaxText recipe for 128 GPUs (docs/study.md: capacity factor 1.0,
# an expert group one NVLink domain); bf16 activations (the default), the loss in 8 chunks.
STUDY_V3 = RunConfig(per_device_batch=8, seq=4096, steps=10, mesh=MeshConfig(fsdp=16, expert=8),
                     preset="dsv3_offload", expert_capacity=1.0, loss_chunks=8, checkpoint_every=0)
_deepseek = partial(experiment, model=DEEPSEEK_V3, proxy_model=PROXY_V3, run=STUDY_V3)

EXPERIMENTS = (
    # study_tflops as for Llama; rows 1-2 from the stated ratios: row 3 is 1.57x row 1 and
    # 1.677x row 2.
    _deepseek("deepseek671b-remat", "row 1: full rematerialization (MaxText's full), mb 8",
              study_tflops=908.2 / 1.57, preset="remat", xla_flags={LHS: "true"}),
    _deepseek("deepseek671b-offload-nolhs", "row 2: offload, no LHS, no pipelining, mb 8",
              study_tflops=908.2 / 1.677, xla_flags={LHS: "false"}),
    _deepseek("deepseek671b-offload", "rows 3/5: offload + LHS + pipelined transfers, mb 8, "
              "global 1024", study_tflops=908.2,
              xla_flags={LHS: "true", PIPELINED: "true", ASYNC_LIMIT: "8"}),
    _deepseek("deepseek671b-device", "row 4: the same activations saved on device, mb 2, "
              "global 256", preset="dsv3_device", per_device_batch=2, xla_flags={LHS: "true"}),
    _deepseek("deepseek671b-device-mb8", "row 4's note: saved on device at mb 8 (the study "
              "ran out of memory)", preset="dsv3_device", xla_flags={LHS: "true"}),
)
COMPARISONS = {"deepseek671b-compare": ("deepseek671b-remat", "deepseek671b-offload-nolhs",
                                        "deepseek671b-offload", "deepseek671b-device")}
