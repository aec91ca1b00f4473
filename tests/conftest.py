"""Every test runs on 8 fake CPU devices, in float32 at full matmul precision; the tiny model
configs and helpers the test files share.

The suite compiles many programs more than once (a resumed run compiles what the run it
resumes compiled; subprocess tests compile what in-process tests did): one compilation cache
per test session, shared by the xdist workers and the subprocesses they start, compiles each
once. It starts empty, so nothing from an earlier session or another jax is reused.
"""

import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Set by the first process of the session (xdist's controller), inherited by its workers.
if "OFFLOAD_TRAINER_TEST_CACHE" not in os.environ:
    os.environ["OFFLOAD_TRAINER_TEST_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"] = \
        tempfile.mkdtemp(prefix="jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    _OWNER = True
else:
    _OWNER = False

# Programs compiled at LLVM -O0: XLA's HLO passes, schedules and buffers are the same at every
# level and the CPU compiles (most of this suite's time) take half as long; subprocesses the
# tests start inherit it. A result can differ from -O1's in float32's last bits, so every
# bit-exact comparison here compares programs compiled alike. (-O1 runs NVFP4 proxy steps
# faster, but its longer compiles cost the suite more than that saves.) Where XLA's GPU
# compiler is installed, GPU kernels are compiled once per worker, kept in the session's cache:
# one model's rows share most of them. Only there: every XLA flag is part of JAX's cache key,
# and a flag naming its worker's file would keep the workers from sharing any program.
_CACHE = os.environ["OFFLOAD_TRAINER_TEST_CACHE"]
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
_FLAGS = {"--xla_backend_optimization_level": "0"}
if importlib.util.find_spec("jax_cuda12_plugin"):
    _FLAGS["--xla_gpu_kernel_cache_file"] = f"{_CACHE}/kernels-{_WORKER}.bin"
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in _FLAGS]
    + [f"{k}={v}" for k, v in _FLAGS.items()])

from runtime import backend  # noqa: E402  (before JAX: no CUDA plugin start-up noise without a GPU)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


def _end_with_parent(parent: int) -> None:
    """An xdist worker ends when its controller does: a run in progress takes SIGTERM as a
    request to stop at the next step (runtime/checkpoints.py), so a stopped `make test` would
    leave the worker going on to its next test."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


if "PYTEST_XDIST_WORKER" in os.environ:
    threading.Thread(target=_end_with_parent, args=(os.getppid(),), daemon=True).start()


def pytest_sessionfinish(session, exitstatus):
    if _OWNER:
        shutil.rmtree(os.environ["OFFLOAD_TRAINER_TEST_CACHE"], ignore_errors=True)


def pytest_runtest_setup(item):
    """A test marked gpu_compile errs, never skips, where XLA's GPU compiler is missing:
    `make test-gpu-compile` installs it, and a broken install must not pass as green."""
    if item.get_closest_marker("gpu_compile") and not backend.has_cuda_plugin():
        pytest.fail("needs the gpu-compile extra (make test-gpu-compile)", pytrace=False)


from model import families  # noqa: E402
from model.params import init_params  # noqa: E402
from model.sharding import AxisRules, make_mesh  # noqa: E402
from model.config import DeepSeekConfig, LlamaConfig, YarnScaling  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# The smallest models with every feature of their family (GQA; MLA with q LoRA, a dense layer
# then MoE layers, groups, a shared expert, YaRN), dimensions unlike each other so a
# transposed or misplaced axis fails.
TINY_LLAMA = LlamaConfig(vocab=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                         d_ff=48, rope_theta=1000.0)
TINY_DEEPSEEK = DeepSeekConfig(
    vocab=61, d_model=32, n_layers=3, n_dense_layers=1, n_heads=2, q_lora_rank=12,
    kv_lora_rank=8, qk_nope_dim=8, qk_rope_dim=4, v_head_dim=6, d_ff=40, moe_d_ff=16,
    n_experts=8, experts_per_token=2, n_shared_experts=1, n_groups=4, topk_groups=2,
    routed_scaling=2.5, rope_scaling=YarnScaling(factor=4.0, original_max_position=64),
    max_position=256)
# The same families with every sharded dimension (embed, the LoRA ranks, the experts) and a
# batch of 8 divisible over 8 devices.
SHARDED_LLAMA = LlamaConfig(vocab=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            head_dim=16, d_ff=96, rope_theta=1000.0)
SHARDED_DEEPSEEK = DeepSeekConfig(
    vocab=64, d_model=64, n_layers=3, n_dense_layers=1, n_heads=2, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=8, d_ff=48, moe_d_ff=16,
    n_experts=16, experts_per_token=3, n_shared_experts=1, n_groups=4, topk_groups=2,
    routed_scaling=2.5, rope_scaling=YarnScaling(factor=4.0, original_max_position=64))


def one_device_params(cfg, seed: int = 0) -> dict:
    """Random parameters of `cfg` on one device, norm weights away from 1 (a test notices them
    ignored) and, for DeepSeek, router biases big enough to change expert choices."""
    mesh = make_mesh((1, 1), ("data", "fsdp"), devices=jax.devices()[:1])
    params = init_params(families.of(cfg).param_specs(cfg), AxisRules(mesh=mesh),
                                jax.random.key(seed))
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: p + 0.3 * jax.numpy.sin(jax.numpy.arange(p.size).reshape(p.shape))
        if str(path[-1].key).endswith("norm") else p, params)
    if isinstance(cfg, DeepSeekConfig):
        bias = jax.random.normal(jax.random.key(seed + 1),
                                 (cfg.n_moe_layers, cfg.n_experts)) * 0.3
        params["moe_layers"]["router_bias"] = bias
    return params


def tokens(cfg, batch: int = 2, seq: int = 12, seed: int = 1):
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, cfg.vocab)


def assert_trees_close(got, want, rel: float) -> None:
    """Leaf by leaf, every element within `rel` x the leaf's largest magnitude: what float32
    reordering (another fusion, another summation order) moves; a wiring mistake moves values
    by their own scale."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = np.abs(b).max() if b.size else 0.0
        assert np.abs(a - b).max(initial=0) <= rel * scale, (
            f"{jax.tree_util.keystr(path)}: max|diff| {np.abs(a - b).max():.3g} > {rel} x "
            f"{scale:.3g}")


# Proxies narrowed from 512 to 128 wide: the same code on every path, a CPU step ~4x faster.
NARROW = ["model.d_model=128", "model.d_ff=256"]
# A small proxy run of the real experiments: 2 layers, 32 tokens, 8 devices x batch 2.
SMALL = ["steps=3", "seq=32", "model.n_layers=2", "model.vocab=512", *NARROW]


def run_cli(args, tmp_path, capsys):
    """train.main on `args` writing under tmp_path: (exit status, stdout, stderr)."""
    import train  # (here, not above: JAX must start after this file's settings)
    code = train.main([*args, f"out_dir={tmp_path}"])
    out, err = capsys.readouterr()
    return code, out, err


def start_state(setup, target=None):
    """(state, steps done) as a run of `setup` on `target` (this machine) starts: fresh, or
    its `resume` checkpoint resharded onto the run's mesh (runtime/setup.py start_state)."""
    from runtime import setup as runtime_setup
    from trainer.program import Program
    from trainer.target import this_machine
    program = Program(setup.model, setup.run, setup.placement, target or this_machine())
    return runtime_setup.start_state(program, setup)
