"""The training loop and the command line: learning, bad input, outputs."""

import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
import train

from configs import OptimizerConfig
from runtime.data import SyntheticTokens, TokenFile
from model import common, llama, quant
from offload import policies
from model import families
from trainer import step as trainer_step

# A small proxy run of the real experiment: 2 layers, 32 tokens, 8 devices x batch 2.
SMALL = ["steps=3", "seq=32", "model.n_layers=2", "model.vocab=512"]


def run_cli(args, tmp_path, capsys):
    code = train.main([*args, f"out_dir={tmp_path}"])
    out, err = capsys.readouterr()
    return code, out, err


def proxy_losses(batches, lr: float, **loss_options) -> list[float]:
    """The loss of each step of the llama405b proxy (2 layers, vocab 256) on one device, one
    step per batch, from the same initial weights."""
    cfg = configs.get("llama405b-offload").proxy_model
    cfg = cfg.__class__(**{**cfg.__dict__, "n_layers": 2, "vocab": 256})
    mesh = common.make_mesh((1, 1), ("data", "fsdp"), devices=jax.devices()[:1])
    params = common.init_params(llama.param_specs(cfg), common.AxisRules(mesh=mesh),
                                jax.random.key(0))
    optimizer = trainer_step.make_optimizer(OptimizerConfig(lr=lr, warmup_steps=0),
                                        steps=len(batches))
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), int)}
    loss = partial(trainer_step.loss_fn, model=cfg, rules=None, dtype=jnp.float32, **loss_options)
    step = jax.jit(partial(trainer_step.train_step, loss=loss, optimizer=optimizer))
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


def _corrupt_checkpoint(tmp_path: Path) -> str:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    config = Path("tests/fixtures/llama_gqa/config.json").read_text()
    (directory / "config.json").write_text(config)
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    return str(directory)


BAD_INPUT = {
    "unknown experiment": ["llama9b"],
    "unknown key": ["llama405b-offload", "stepz=3"],
    "unknown nested key": ["llama405b-offload", "optimizer.beta=3"],
    "wrong type": ["llama405b-offload", "steps=ten"],
    "not key=value": ["llama405b-offload", "steps"],
    "heads not divisible": ["llama405b-offload", "model.n_kv_heads=3"],
    "sequence past RoPE table": ["llama405b-offload", "seq=200000"],
    "batch not divisible": ["llama405b-offload", "global_batch=12"],
    "mesh does not cover devices": ["llama405b-offload", "mesh.fsdp=3"],
    "unknown tag": ["llama405b-offload", "policy.qkv_proj=offload"],
    "bad placement": ["llama405b-offload", "policy.query_proj=disk"],
    "unknown preset": ["llama405b-offload", "policy=everything"],
    "full scale on a CPU": ["llama405b-offload", "scale=full"],
    "bad dtype": ["llama405b-offload", "compute_dtype=int8"],
    "missing token file": ["llama405b-offload", "data.path=/nonexistent/tokens.bin"],
    "missing checkpoint": ["llama405b-offload", "init_from=/nonexistent/ckpt"],
    "no data axis": ["llama405b-offload", "mesh.data=0"],
    "negative batch": ["llama405b-offload", "global_batch=-8"],
    "not a finite number": ["llama405b-offload", "optimizer.lr=nan"],
    "bad optimizer range": ["llama405b-offload", "optimizer.b1=1.5"],
    "bad rope scaling": ["llama405b-offload", "model.rope_scaling.low_freq_factor=0"],
    "cudnn on a CPU": ["llama405b-offload", "attention=cudnn"],
    "no dense layer": ["deepseek671b-offload", "model.n_dense_layers=0"],
    "v wider than q/k": ["deepseek671b-offload", "model.v_head_dim=64"],
    "bad yarn": ["deepseek671b-offload", "model.rope_scaling.beta_slow=0"],
    "policy for a missing scan": ["llama405b-offload", "policy.moe_layers.mla_q=offload"],
    "wrong family's checkpoint": ["deepseek671b-offload", "init_from=tests/fixtures/llama_gqa"],
    "width NVFP4 cannot block": ["llama405b-offload", "model.d_ff=1000"],
    "unknown NVFP4 tiles": ["llama405b-offload", "quant_tiles=8x8"],
    "unknown quantization": ["llama405b-offload", "quant=int4"],
    "experts not divisible": ["deepseek671b-offload", "expert_parallel=true", "mesh.fsdp=8",
                              "model.n_experts=12", "model.n_groups=4"],
    "negative expert capacity": ["deepseek671b-offload", "expert_capacity=-1"],
    "negative seed": ["llama405b-offload", "seed=-1"],
    "seed past numpy's range": ["llama405b-offload", f"seed={2**64}"],
    "negative checkpoint interval": ["llama405b-offload", "checkpoint_every=-1"],
}


@pytest.mark.parametrize("args", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_is_one_line_and_status_2(args, tmp_path, capsys):
    code, out, err = run_cli(args, tmp_path, capsys)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())  # stopped before any run folder was made


def test_bad_files_are_one_line_and_status_2(tmp_path, capsys):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")  # 1.5 uint16 tokens
    too_big = tmp_path / "big.bin"
    np.array([1, 2, 60000], np.uint16).tofile(too_big)
    short = tmp_path / "short.bin"
    np.arange(10, dtype=np.uint16).tofile(short)
    late = tmp_path / "late.bin"
    np.concatenate([np.zeros(3_000_000, np.uint16), [600]]).astype(np.uint16).tofile(late)
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "config.json").write_text("[1, 2]")
    for args in (["data.path=" + str(odd)], ["data.path=" + str(too_big)],
                 ["data.path=" + str(short)], ["data.path=" + str(late)],
                 ["init_from=" + _corrupt_checkpoint(tmp_path)], ["init_from=" + str(listed)]):
        code, _, err = run_cli(["llama405b-offload", *SMALL, *args], tmp_path / "out", capsys)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert not (tmp_path / "out").exists()  # nothing written


def test_exit_status_from_a_real_process(tmp_path):
    result = subprocess.run([sys.executable, "train.py", "llama405b-offload", "model.n_kv_heads=3",
                             f"out_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: model.n_heads=16 is not divisible by model.n_kv_heads=3"]


def test_list_names_every_experiment(capsys):
    assert train.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == [*configs.EXPERIMENTS, *configs.COMPARISONS]


@pytest.mark.parametrize("name", list(configs.EXPERIMENTS))
@pytest.mark.parametrize("scale", ["proxy", "full"])
def test_every_experiment_is_sound_at_both_scales(name, scale):
    experiment = configs.get(name)
    model, run = experiment.at_scale(scale)
    devices = run.mesh.data * run.mesh.fsdp if scale == "full" else 8
    assert configs.problems(model, run, devices) == []
    if run.policy != policies.NO_CHECKPOINT:
        policies.placement_tables(run.policy, run.placements, families.scan_tags(model))


def test_compare_runs_each_row_into_one_table(tmp_path, capsys, monkeypatch):
    """The comparison's mechanics: each row resolved with the same overrides and run, then one
    table (each run itself is tested end to end in tests/test_checkpoints.py)."""
    ran = []

    def fake_train(setup, target):
        ran.append((setup.experiment.name, setup.run.steps))
        return {"median_step_s": 0.5, "tflops_per_device": 1.0, "peak_device_bytes": None,
                "host_offload_bytes_planned": 2**30}

    monkeypatch.setattr(train, "train", fake_train)
    code, out, err = run_cli(["llama405b-compare", *SMALL, "steps=2"], tmp_path, capsys)
    assert code == 0, err
    assert ran == [(name, 2) for name in configs.COMPARISONS["llama405b-compare"]]
    (folder,) = tmp_path.glob("llama405b-compare-*")
    rows = (folder / "compare.csv").read_text().splitlines()
    assert [r.split(",") for r in rows[1:]] == [
        ["llama405b-baseline", "remat", "true", "false", "500.0", "1.000", "n/a", "1.00"],
        ["llama405b-offload", "qkv_offload", "true", "false", "500.0", "1.000", "n/a", "1.00"],
        ["llama405b-offload-nolhs", "qkv_offload", "false", "false", "500.0", "1.000", "n/a",
         "1.00"],
        ["llama405b-offload-pipelined", "qkv_offload", "true", "true", "500.0", "1.000", "n/a",
         "1.00"]]
    assert (folder / "compare.md").read_text() in out


def test_a_comparison_plans_and_compiles_each_of_its_rows(monkeypatch):
    shown = []
    for flag in ("plan", "compile"):
        monkeypatch.setitem(train.MODES, f"--{flag}", lambda name, args: shown.append(name))
        assert train.main(["llama405b-compare", f"--{flag}", "steps=2"]) == 0
    assert shown == list(configs.COMPARISONS["llama405b-compare"]) * 2
