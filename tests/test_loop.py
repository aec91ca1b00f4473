"""The training loop's schedule, read off a loop driven by stand-ins (no JAX program): when it
evaluates, what a step's time holds, what stops it; the evaluation's own number, a DeepSeek
model's cross-entropy; a resume on other data refused (train.py loop, trainer/program.py);
what a CPU step does with its memory and its products' operands."""

import dataclasses
import math
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train
from configs import MeshConfig, RunConfig
from conftest import TINY_DEEPSEEK
from model import deepseek
from runtime import checkpoints, report
from runtime import setup as runtime_setup
from trainer.program import Program
from trainer.target import Target

EVAL_S = 0.2  # a slow evaluation: far longer than a stand-in step


class Stand:
    """The program, data, log, saver and stop signal a loop reads, recording what it is asked:
    each step's loss is `losses[step]` (1.0 unless given)."""

    def __init__(self, steps: int, eval_every: int, losses: dict | None = None):
        self.run = dataclasses.replace(RunConfig(), steps=steps, eval_every=eval_every,
                                       eval_batches=2, seq=4)
        self.losses, self.evaluated, self.written = losses or {}, [], {}
        self.batch_size = 2
        self.data = types.SimpleNamespace(batch=lambda step, size, seq: step, val=types.
                                          SimpleNamespace(eval_batch=lambda i, *_: i))
        self.run_dir = types.SimpleNamespace(main=True, path=Path("unused: no profile"))

    def batch(self, tokens):
        return tokens

    def step(self, state, tokens):
        step = state["step"] + 1
        return {"params": step, "step": step}, {"loss": self.losses.get(step, 1.0)}

    def eval_loss(self, params, batches) -> float:
        assert list(batches) == [0, 1]  # eval_batches of them, by index
        self.evaluated.append(params)
        time.sleep(EVAL_S)
        return 2.0

    def write(self, step: int, values: dict) -> None:
        self.written[step] = values

    def loop(self) -> int:
        saver = types.SimpleNamespace(due=lambda step, last: False)
        stop = types.SimpleNamespace(reached=lambda step: False)
        setup = types.SimpleNamespace(run=self.run, data=self.data)
        return train.loop(self, setup, {"params": 0, "step": 0}, 0, self, saver, stop)


@pytest.mark.parametrize(("steps", "every", "evaluated"), [(7, 3, [3, 6, 7]), (6, 3, [3, 6]),
                                                           (2, 5, [2])])
def test_the_evaluations_fall_every_eval_every_steps_and_after_the_last(steps, every, evaluated):
    stand = Stand(steps, every)
    assert stand.loop() == steps
    assert stand.evaluated == evaluated  # each of the step's own parameters
    assert [s for s, v in stand.written.items() if "eval_loss" in v] == evaluated
    assert stand.written[evaluated[0]]["eval_perplexity"] == pytest.approx(math.exp(2.0))


def test_a_slow_evaluation_is_not_in_the_next_steps_time():
    stand = Stand(4, 2)
    stand.loop()
    assert stand.written[2]["step_s"] < EVAL_S / 2  # waited for before the evaluation
    assert stand.written[3]["step_s"] < EVAL_S / 2  # timed from the evaluation's end


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_loss_not_finite_stops_the_run_at_its_step(loss):
    stand = Stand(5, 0, {3: loss})
    with pytest.raises(report.NonFiniteLoss, match=f"loss is {loss} at step 3/5"):
        stand.loop()
    assert list(stand.written) == [1, 2]


def test_a_deepseek_eval_loss_is_its_cross_entropy_without_the_balance_term():
    """With a balance-loss weight the training loss is cross-entropy + weight x balance; the
    evaluation is the cross-entropy alone: a float64 one of the model's logits."""
    run = dataclasses.replace(RunConfig(), seq=16, global_batch=2, mesh=MeshConfig(fsdp=1),
                              compute_dtype="float32", balance_loss_weight=0.5, preset="none")
    program = Program(TINY_DEEPSEEK, run, None, Target("cpu", devices=tuple(jax.devices()[:1])))
    program.step = "the step itself is not under test: not compiled"
    program.compile_run(evaluation=True)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.5, a.shape), a.dtype),
                          program.state_shapes["params"])
    tokens = rng.integers(0, TINY_DEEPSEEK.vocab, (2, 17))
    logits, _ = jax.jit(deepseek.forward, static_argnums=2)(params, tokens[:, :-1], TINY_DEEPSEEK)
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    log_z = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    want = (log_z - np.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]).mean()
    assert abs(program.eval_loss(params, [tokens]) - want) <= 2e-6 * want


def test_a_resume_on_other_data_is_refused():
    """data.path (and data.dtype) change the trained numbers: a checkpoint's differ."""
    run = RunConfig()
    meta = {"model": checkpoints._plain(TINY_DEEPSEEK), "run": checkpoints._plain(run),
            "global_batch": 2}
    assert checkpoints.differences(meta, TINY_DEEPSEEK, run, 2) == []
    other = dataclasses.replace(run, data=dataclasses.replace(run.data, path="elsewhere"))
    (found,) = checkpoints.differences(meta, TINY_DEEPSEEK, other, 2)
    assert found.startswith("data=") and "elsewhere" in found



# nanoGPT's size's step as the trainer compiles it (study/bench/cpu_step.py), run 5 times after
# 3: its temporary buffers' pages, and the pages it page-faulted in per step.
STEP_FAULTS = """
from runtime import backend
backend.keep_freed_memory()
import resource
from study.bench.cpu_step import NANOGPT, prepared
size = prepared(*NANOGPT)
size.time(2, False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
size.time(4, False)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
print(size.program.step.memory_analysis().temp_size_in_bytes // 4096, faults)
"""


def test_a_cpu_step_reuses_the_memory_its_last_step_freed():
    """The allocator setting a training process makes (runtime/backend.py), in a process of its
    own: a step's buffers take the memory the last step freed, so it page-faults in fewer than
    half as many pages as its temporary buffers span. (With glibc's defaults it faults in all
    of them at every step, and more: blocks that large are mapped anew each time, in pages of
    4 KiB where the kernel gives no huge pages.)"""
    result = subprocess.run([sys.executable, "-c", STEP_FAULTS], capture_output=True, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300, check=True,
                            cwd=Path(__file__).resolve().parent.parent)
    pages, faults = map(float, result.stdout.split())
    assert faults < pages / 2, result.stdout


def test_a_cpu_step_lays_no_activation_gradient_out_again_for_its_weight_gradients():
    """On a CPU the trainer multiplies the layer matrices as 2-D dots (`flat_products`,
    layers.einsum): in its compiled step no instruction writes a [features, tokens] matrix
    (an activation gradient laid out again, transposed, for a weight gradient's product). The
    same step with einsums, as a GPU's is written, has such a copy for each of them."""
    one = Target("cpu", devices=tuple(jax.devices()[:1]))
    setup = runtime_setup.resolve("shakespeare", [
        "model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2",
        "model.head_dim=32", "model.d_ff=160", "seq=24", "per_device_batch=4", "global_batch=0",
        "preset=none", "data.path=", "eval_every=0"], one.devices)
    tokens = setup.run.per_device_batch * setup.run.seq  # 96: no layer's width
    written = {}
    for flat in (True, False):
        program = Program(setup.model, setup.run, setup.placement, one)
        assert program.options.flat_products
        program.options = dataclasses.replace(program.options, flat_products=flat)
        text = program.compile_run().as_text()
        written[flat] = re.findall(rf"= f32\[(\d+),{tokens}\]\{{1,0\}} (?:fusion|copy|transpose)",
                                   text[text.index("ENTRY"):])
    assert written[True] == [] and len(written[False]) >= 2 * setup.model.n_layers, written
