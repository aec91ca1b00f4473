"""The training step's update written out in numpy float64 from its published definitions,
independent of optax and of trainer/step.py: tests/test_training_step.py holds the jitted
trainer to it.

Per step t (counted from 0), given the gradients g of the loss at the parameters p:
- global-norm clipping: g <- g x min(1, clip_norm / ||g||), ||g|| over every leaf at once;
- the learning rate: linear from 0 to the peak over warmup_steps, then a cosine from the peak
  to min_lr_ratio x peak at the run's last step (Loshchilov & Hutter's SGDR, one cycle);
- AdamW (Loshchilov & Hutter, "Decoupled weight decay regularization", Algorithm 2, with
  Kingma & Ba's bias correction and eps outside the square root):
      m <- b1 m + (1 - b1) g,    v <- b2 v + (1 - b2) g^2
      p <- p - lr_t x (m / (1 - b1^(t+1)) / (sqrt(v / (1 - b2^(t+1))) + eps) + wd x p)
  the wd x p term only for matrices, not for the RMSNorm gains nor the router bias;
- DeepSeek-V3's auxiliary-loss-free balancing (DeepSeek-V3 report, section 2.1.2): each MoE
  layer's expert bias moves by rate x sign(the layer's mean load - the expert's load), after
  the optimizer step, with the loads of the step's forward pass.
"""

import math

import numpy as np

from configs import OptimizerConfig

EPS = 1e-8  # Adam's epsilon: Kingma & Ba's default, which the trainer does not change
UNDECAYED = ("norm", "router_bias")  # leaf names ending so are not weight-decayed


def learning_rate(cfg: OptimizerConfig, steps: int, t: int) -> float:
    if t < cfg.warmup_steps:
        return cfg.lr * t / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    progress = min(1.0, (t - cfg.warmup_steps) / (steps - cfg.warmup_steps))
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def clip_scale(grads: dict[str, np.ndarray], clip_norm: float) -> float:
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
    return min(1.0, clip_norm / norm)


def reference_step(state: dict, grads: dict[str, np.ndarray], load: np.ndarray | None,
                   cfg: OptimizerConfig, steps: int, router_bias_rate: float) -> dict:
    """One step on flat {name: float64 array} trees: state {"params", "mu", "nu", "t"};
    `load`: tokens per expert [MoE layers, experts] of the step's forward (None: dense)."""
    t, lr = state["t"], learning_rate(cfg, steps, state["t"])
    scale = clip_scale(grads, cfg.clip_norm)
    params, mu, nu = {}, {}, {}
    for name, p in state["params"].items():
        g = grads[name] * scale
        mu[name] = cfg.b1 * state["mu"][name] + (1 - cfg.b1) * g
        nu[name] = cfg.b2 * state["nu"][name] + (1 - cfg.b2) * g * g
        adam = (mu[name] / (1 - cfg.b1 ** (t + 1))
                / (np.sqrt(nu[name] / (1 - cfg.b2 ** (t + 1))) + EPS))
        decay = 0.0 if name.endswith(UNDECAYED) else cfg.weight_decay
        params[name] = p - lr * (adam + decay * p)
    if load is not None:
        name, = (n for n in params if n.endswith("router_bias"))
        params[name] = params[name] + router_bias_rate * np.sign(
            load.mean(axis=1, keepdims=True) - load)
    return {"params": params, "mu": mu, "nu": nu, "t": t + 1}
