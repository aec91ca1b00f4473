"""The CPU training step of PyTorch peers at the size `python -m study cpu-step` calls nanoGPT's:
nanoGPT's own GPT (its CPU "baby" configuration: 4 layers, 4 heads, width 128, block 64, batch
12, no dropout, tied embeddings, no torch.compile) and transformers' Llama of exactly this
project's model there (SwiGLU 344, untied, RoPE, RMSNorm), both on a 4,096-token vocabulary with
AdamW and global-norm clipping, float32. Each round times torch's own 2048^3 float32 matmul and
then each step, so its figures are ratios of one round, like cpu-step's (docs/runs.md).

Needs torch and transformers (like the fixture scripts; never run by `make test`):

    python3 -m venv /tmp/fixvenv
    /tmp/fixvenv/bin/pip install torch==2.13.0 transformers==5.24.0 numpy
    /tmp/fixvenv/bin/python tests/tools/peer_step.py [steps] [rounds]

The GPT below is nanoGPT's model.py (github.com/karpathy/nanoGPT) restated at that size: the
same modules and order (LayerNorm without bias, fused QKV, PyTorch's scaled_dot_product_attention,
GELU MLP of 4x the width, the LM head's weight tied to the embedding), its AdamW settings (decay
on matrices only, betas 0.9/0.99 of its Shakespeare config) and its loop's per-step work: the
loss fetched as a float, the gradients set to None.
"""

import statistics
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, BLOCK, BATCH, LAYERS, HEADS, WIDTH = 4096, 64, 12, 4, 4, 128


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH, bias=False), nn.LayerNorm(WIDTH, bias=False)
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.attn_proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.mlp_proj = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH, bias=False)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as nanoGPT's

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def llama() -> nn.Module:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=344,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS, head_dim=WIDTH // HEADS,
                         max_position_embeddings=BLOCK, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def stepper(name: str):
    """One training step of `name`'s model: forward, backward, clip, AdamW, loss fetched."""
    model = GPT() if name == "nanoGPT" else llama()
    logits = model if name == "nanoGPT" else lambda idx: model(input_ids=idx).logits
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.99))
    generator = torch.Generator().manual_seed(0)

    def step():
        tokens = torch.randint(VOCAB, (BATCH, BLOCK + 1), generator=generator)
        loss = F.cross_entropy(logits(tokens[:, :-1]).view(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def median_seconds(call, times: int) -> float:
    call()  # warm-up
    found = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        found.append(time.perf_counter() - started)
    return statistics.median(found)


def main() -> int:
    given, defaults = sys.argv[1:3], ["30", "3"]  # steps, rounds
    steps, rounds = map(int, given + defaults[len(given):])
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    steppers = {name: stepper(name) for name in ("nanoGPT", "Llama (transformers)")}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {rounds} rounds of "
          f"{steps} steps, batch {BATCH} x {BLOCK}, vocabulary {VOCAB}")
    for _ in range(rounds):
        ceiling = 2 * 2048**3 / median_seconds(lambda: a @ b, 10)
        line = f"ceiling {ceiling / 1e9:.1f} GFLOP/s"
        for name, step in steppers.items():
            line += f"; {name} {median_seconds(step, steps) * 1e3:.1f} ms"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
