"""The training loop learns: the loss falls, NVFP4 training tracks full precision, a token
file trains; a diverging run stops and names its step."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import configs
from configs import OptimizerConfig
from model import common, llama, quant
from offload import policies
from runtime.data import SyntheticTokens, TokenFile
from trainer.step import device_update, loss_fn, make_optimizer, train_step
from conftest import SMALL, run_cli


def proxy_losses(batches, lr: float, **loss_options) -> list[float]:
    """The loss of each step of the llama405b proxy (2 layers, vocab 256) on one device, one
    step per batch, from the same initial weights."""
    cfg = configs.get("llama405b-offload").proxy_model
    cfg = cfg.__class__(**{**cfg.__dict__, "n_layers": 2, "vocab": 256})
    mesh = common.make_mesh((1, 1), ("data", "fsdp"), devices=jax.devices()[:1])
    params = common.init_params(llama.param_specs(cfg), common.AxisRules(mesh=mesh),
                                jax.random.key(0))
    optimizer = make_optimizer(OptimizerConfig(lr=lr, warmup_steps=0),
                                        steps=len(batches))
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), int)}
    loss = partial(loss_fn, model=cfg, rules=None, dtype=jnp.float32, **loss_options)
    step = jax.jit(partial(train_step, loss=loss, update=device_update(optimizer)))
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


def test_loss_falls_on_a_repeated_batch():
    batch = SyntheticTokens(256, seed=0).batch(0, 4, 32)
    losses = proxy_losses([batch] * 30, lr=3e-3, policies={
        "layers": policies.checkpoint_policy(policies.PRESETS["qkv_offload"])})
    assert losses[-1] < 0.5 * losses[0], losses  # memorising 4 x 32 tokens


def test_nvfp4_training_tracks_full_precision_training():
    """The llama405b proxy (2 layers) learning a fixed rule (next = 5 x token + 3 mod 256) on
    fresh sequences every step, with and without NVFP4 weights: the quantized loss follows
    the full-precision one to within 0.1 nats + 5% at each of the first 8 steps (it falls from
    ~6 to ~0.2 there), and both learn (a broken straight-through gradient would not)."""
    rng = np.random.default_rng(0)
    batches = np.zeros((8, 8, 33), np.int32)
    batches[:, :, 0] = rng.integers(0, 256, size=(8, 8))
    for i in range(1, 33):
        batches[:, :, i] = (batches[:, :, i - 1] * 5 + 3) % 256
    curves = [np.array(proxy_losses(batches, lr=1e-3, policies=None, quantization=quantization))
              for quantization in (None, quant.Quantization())]
    full, nvfp4 = curves
    assert np.all(np.abs(nvfp4 - full) <= 0.1 + 0.05 * full), (full, nvfp4)
    assert full[-1] < 0.1 * full[0] and nvfp4[-1] < 0.1 * nvfp4[0]


def test_a_token_file_trains_and_its_windows_are_deterministic(tmp_path, capsys):
    path = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 512, 5000, dtype=np.uint16).tofile(path)
    a, b = (TokenFile(str(path), "uint16", 512, seed=7, seq=32).batch(3, 4, 32) for _ in range(2))
    np.testing.assert_array_equal(a, b)
    tokens = np.fromfile(path, np.uint16)
    assert any(np.array_equal(a[0], tokens[s:s + 33]) for s in range(len(tokens) - 32))
    code, out, err = run_cli(["llama405b-baseline", *SMALL, f"data.path={path}"], tmp_path,
                             capsys)
    assert code == 0, err


def test_a_diverging_run_stops_and_names_the_step(tmp_path, capsys):
    code, _, err = run_cli(["llama405b-baseline", *SMALL, "steps=6", "optimizer.lr=1e36",
                            "optimizer.warmup_steps=0", "optimizer.clip_norm=1e30"],
                           tmp_path, capsys)
    assert code == 1
    assert "at step" in err and "stopping" in err


DEEPSEEK_ROWS = [*configs.COMPARISONS["deepseek671b-compare"], "deepseek671b-device-mb8"]


def test_every_deepseek_rows_proxy_trains_with_its_experts_split_over_an_expert_axis(
        tmp_path, capsys):
    """Each DeepSeek row's proxy (its policy and flags; a dense and a MoE layer) on 8 CPU
    devices as fsdp 2 x expert 4, as the full rows split theirs (fsdp 16 x expert 8), at the
    rows' capacity factor:
    two steps run to a finite loss (a loss that is not finite stops a run with status 1),
    each step line says what was dropped, overall and for the worst device's experts, and
    the header names the split."""
    for name in DEEPSEEK_ROWS:
        code, out, err = run_cli([name, "steps=2", "seq=32", "model.n_layers=2",
                                  "model.vocab=512", "mesh.expert=4", "expert_capacity=1.0"],
                                 tmp_path / name, capsys)
        assert code == 0, err
        assert "experts split over the 4 devices of each expert group (blocks 1x" in out
        assert "fsdp': 2, 'expert': 4" in out
        steps = [line for line in out.splitlines() if line.startswith("step ")]
        assert len(steps) == 2 and all("(worst device's experts" in line for line in steps)
