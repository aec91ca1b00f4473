"""Llama 3.1 models and the study's Llama 405B experiments (docs/study.md, the Llama table)."""

import dataclasses
from functools import partial

from configs.settings import ASYNC_LIMIT, LHS, PIPELINED, MeshConfig, RunConfig, experiment
from model.config import LlamaConfig

LLAMA31_8B = LlamaConfig(vocab=128_256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         head_dim=128, d_ff=14_336)
LLAMA31_70B = dataclasses.replace(LLAMA31_8B, d_model=8192, n_layers=80, n_heads=64, d_ff=28_672)
LLAMA31_405B = dataclasses.replace(LLAMA31_8B, d_model=16_384, n_layers=126, n_heads=128,
                                   d_ff=53_248)

# Proxies: same family and head/width ratios (GQA group N/K, F/D), four 512-wide layers and a
# 32k vocabulary: small enough for a CPU at batch 2 x 256 tokens (docs/runs.md: its step time).
_proxy = partial(dataclasses.replace, vocab=32_768, d_model=512, n_layers=4)
PROXY_8B = _proxy(LLAMA31_8B, n_heads=8, n_kv_heads=2, head_dim=64, d_ff=1792)
PROXY_70B = _proxy(LLAMA31_70B, n_heads=8, n_kv_heads=1, head_dim=64, d_ff=1792)
PROXY_405B = _proxy(LLAMA31_405B, n_heads=16, n_kv_heads=1, head_dim=32, d_ff=1664)

# The study: synthetic data, bf16 activations (the default), NVFP4 as Transformer Engine's recipe
# (quant=nvfp4's defaults), the loss in 8 chunks (docs/model.md); no checkpoints in 10 steps.
STUDY_405B = RunConfig(per_device_batch=2, seq=8192, steps=10, mesh=MeshConfig(fsdp=128),
                       quant="nvfp4", loss_chunks=8, checkpoint_every=0)
_llama405b = partial(experiment, model=LLAMA31_405B, proxy_model=PROXY_405B, run=STUDY_405B)

EXPERIMENTS = (
    # study_tflops: the study's measured TFLOP/s per GB200 (docs/study.md), what each row's
    # replayed step and a comparison's table are set beside.
    _llama405b("llama405b-baseline", "row 1: no offload, Q/K/V recomputed in backward; LHS on",
               study_tflops=2669, preset="remat", xla_flags={LHS: "true"}),
    _llama405b("llama405b-offload", "row 2: Q/K/V offloaded to host; LHS on (the study's best)",
               study_tflops=2746, preset="qkv_offload", xla_flags={LHS: "true", ASYNC_LIMIT: "8"}),
    _llama405b("llama405b-offload-nolhs", "row 3: Q/K/V offloaded; latency hiding scheduler off",
               study_tflops=2569, preset="qkv_offload", xla_flags={LHS: "false"}),
    _llama405b("llama405b-offload-pipelined", "row 4: Q/K/V offloaded; LHS + pipelined offload",
               study_tflops=2718, preset="qkv_offload",
               xla_flags={LHS: "true", PIPELINED: "true", ASYNC_LIMIT: "8"}),
    # Not a study row: the search's fast model's first on 128 GB200s once, which the replay
    # overturned (docs/search.md); it needs a larger pinned-host pool (docs/clusters.md).
    _llama405b("llama405b-searched", "searched: micro batch 1, K/V and MLP inputs offloaded, "
               "Q and out_proj kept (the fast model's first, once)", per_device_batch=1,
               tag_changes={"layers.query_proj": "device", "layers.out_proj": "device",
                          "layers.key_proj": "offload", "layers.value_proj": "offload",
                          "layers.mlpwi_0": "offload", "layers.mlpwi_1": "offload"},
               xla_flags={LHS: "true", ASYNC_LIMIT: "8"}),
    experiment("llama8b-offload", "Llama 3.1 8B, Q/K/V offloaded, FSDP 8 (one GPU node)",
               LLAMA31_8B, PROXY_8B, STUDY_405B, mesh=MeshConfig(fsdp=8), preset="qkv_offload",
               quant="none", xla_flags={LHS: "true"}),
    experiment("llama70b-offload", "Llama 3.1 70B, Q/K/V offloaded, FSDP 64", LLAMA31_70B,
               PROXY_70B, STUDY_405B, mesh=MeshConfig(fsdp=64), preset="qkv_offload",
               quant="none", xla_flags={LHS: "true"}),
    # Not a study row (docs/optimizer_state.md): 70B on one 8-GPU host, the AdamW moments in
    # host memory, the activations as `make search-llama70b-8xh200` placed them.
    experiment("llama70b-8xh200", "Llama 3.1 70B on one host of 8 H200s, FSDP 8, AdamW moments "
               "in host memory, activations placed by the search", LLAMA31_70B, PROXY_70B,
               STUDY_405B, mesh=MeshConfig(fsdp=8), per_device_batch=1, quant="none",
               preset="remat", optimizer_state="host",
               tag_changes={"layers.mlpwi_0": "device", "layers.query_proj": "offload",
                          "layers.key_proj": "offload", "layers.value_proj": "offload",
                          "layers.attention_out": "offload", "layers.mlpwi_1": "offload"},
               xla_flags={LHS: "true", PIPELINED: "true", ASYNC_LIMIT: "8"}),
)

# The study's Llama table, row by row (make llama405b-compare).
COMPARISONS = {"llama405b-compare": ("llama405b-baseline", "llama405b-offload",
                                      "llama405b-offload-nolhs", "llama405b-offload-pipelined")}
