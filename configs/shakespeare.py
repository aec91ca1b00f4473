"""A first run on real text: a small Llama trained on Shakespeare's plays on one CPU in two to
four minutes (make shakespeare; docs/data.md has its numbers)."""

from configs.settings import DataConfig, MeshConfig, OptimizerConfig, RunConfig, experiment
from model.config import LlamaConfig

# 10,059,840 parameters; the vocabulary is the byte-level BPE make shakespeare trains (bpe:4096).
SHAKESPEARE_MODEL = LlamaConfig(vocab=4096, d_model=320, n_layers=6, n_heads=5, n_kv_heads=5,
                                head_dim=64, d_ff=864, rope_theta=10_000.0, rope_scaling=None,
                                max_position=1024)
# Preset minimal, the activations kept on device: a CPU offloads nothing, and recomputing costs.
SHAKESPEARE_RUN = RunConfig(
    global_batch=8, seq=256, steps=120, mesh=MeshConfig(fsdp=1), preset="minimal",
    optimizer=OptimizerConfig(lr=2e-3, warmup_steps=10),
    data=DataConfig(path="datasets/shakespeare/tokens"), eval_every=40, eval_batches=8,
    checkpoint_every=120, keep=1)

EXPERIMENTS = (experiment("shakespeare", "a 10M-parameter Llama on Shakespeare's plays (make "
                          "shakespeare): real text, its val loss against the unigram entropy",
                          SHAKESPEARE_MODEL, SHAKESPEARE_MODEL, SHAKESPEARE_RUN),)
