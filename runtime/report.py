"""What a run prints and writes: its folder (config.json, metrics.jsonl, summary.json, the
profile), the header (built as rows of data), a line per step, the summary. Only process 0
prints and writes."""

import contextlib
import dataclasses
import json
import math
import resource
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from runtime import own_program
from runtime.own_program import GiB


def _fmt_bytes(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f} GiB"


def new_run_dir(root: str, name: str) -> Path:
    """A fresh folder per run, never an existing one: earlier results are not overwritten."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = Path(root) / (f"{name}-{stamp}" + (f"-{n}" if n else ""))
        with contextlib.suppress(FileExistsError):
            path.mkdir(parents=True)
            return path
    raise RuntimeError(f"no free run folder under {root}")


class RunDir:
    """A run's folder, `<experiment>-<scale>-<time>` under out_dir. Process 0 makes it and
    tells the others its name (they write their checkpoint shards under it) and writes its files."""

    def __init__(self, path: Path, checkpoints: Path):
        self.path, self.checkpoints = path, checkpoints
        self.main = jax.process_index() == 0

    @classmethod
    def at(cls, path: Path, run) -> "RunDir":
        """The folder `path` of a run: its checkpoints in checkpoint_dir, else inside it."""
        return cls(path, Path(run.checkpoint_dir or path / "checkpoints"))

    @classmethod
    def create(cls, setup) -> "RunDir":
        name = f"{setup.experiment.name}-{setup.scale}"
        path = new_run_dir(setup.run.out_dir, name) if jax.process_index() == 0 else None
        if jax.process_count() > 1:
            encoded = np.frombuffer(str(path or "").encode().ljust(1024, b"\0"), np.uint8)
            text = multihost_utils.broadcast_one_to_all(encoded)
            path = Path(bytes(np.asarray(text)).rstrip(b"\0").decode())
        return cls.at(path, setup.run)

    def write(self, name: str, record: dict) -> None:
        if self.main:
            (self.path / name).write_text(json.dumps(record, indent=2, default=str))

    def append(self, name: str, record: dict) -> None:
        if self.main:
            with open(self.path / name, "a") as f:
                f.write(json.dumps(record) + "\n")


def say(text: str = "") -> None:
    if jax.process_index() == 0:
        print(text, flush=True)


def checkpoint_line(name: str, args, run, run_dir: RunDir, path: Path, stopped_by) -> str:
    """Where the last checkpoint is and, for a stopped run, the command that continues from it
    (a finished one has no steps left: a resume of it is refused)."""
    if not stopped_by:
        return f"checkpoint  {path} (complete)"
    stop = f"stopped by {stopped_by.name}; "
    resume = run_dir.checkpoints if run.checkpoint_dir else run_dir.path
    args = [a for a in args if not a.startswith(("resume=", "checkpoint_dir="))]
    return (f"checkpoint  {stop}{path} (complete); continue with: python train.py "
            f"{' '.join([name, *args])} resume={resume}")


def records(setup, program) -> dict[str, dict]:
    """The run folder's records: config.json, what the run trains, on what; auto.json,
    preset=auto's table (a resume's choice was measured by the run it continues)."""
    config = {"experiment": setup.experiment.name, "scale": setup.scale,
              "devices": program.target.description, "platform": program.target.platform,
              "fit": setup.fit.words if setup.fit else None,
              "model": dataclasses.asdict(setup.model), "run": dataclasses.asdict(setup.run),
              "placement": setup.placement}
    measured = setup.choice and not setup.choice.recorded
    return {"config.json": config, **({"auto.json": setup.choice.record()} if measured else {})}


def tensorboard(run_dir: RunDir, run):
    """A TensorBoard writer in the run folder (process 0, tensorboard=true), else None."""
    if not (run.tensorboard and run_dir.main):
        return None
    from tensorboardX import SummaryWriter  # imported only here: an optional extra
    return SummaryWriter(str(run_dir.path / "tensorboard"))


class NonFiniteLoss(ArithmeticError):
    """A step's loss is NaN or infinite: the run stops (exit status 1)."""


def check_finite(loss: float, step: int, steps: int) -> None:
    if not math.isfinite(loss):
        raise NonFiniteLoss(f"loss is {loss} at step {step}/{steps}")


class Clock:
    """A step's time: from the previous step's completion (or the end of an evaluation, which
    is not the next step's) to its own."""

    def __init__(self):
        self.last = time.perf_counter()

    def wait(self, metrics) -> dict:
        """The step's metrics as floats, once it completes, with its seconds (`step_s`)."""
        values = {k: float(v) for k, v in metrics.items()}
        now = time.perf_counter()
        values["step_s"], self.last = now - self.last, now
        return values

    def restart(self) -> None:
        self.last = time.perf_counter()


class Profile:
    """With profile=true, a trace of the run's second to fourth steps in its profile/ folder."""

    def __init__(self, run_dir: RunDir, on: bool, first_step: int, steps: int):
        last = min(first_step + 3, steps)
        self.steps = (min(first_step + 1, last), last) if on and run_dir.main else (0, 0)
        self.path = run_dir.path / "profile"

    def begin(self, step: int) -> None:
        if step == self.steps[0]:
            jax.profiler.start_trace(str(self.path))

    def end(self, step: int) -> None:
        if step == self.steps[1]:
            jax.profiler.stop_trace()
            say(f"profile: {self.path} (open in Perfetto or TensorBoard)")


class StepLog:
    """Each step's line (process 0), metrics.jsonl record and TensorBoard scalars; the summary."""

    def __init__(self, run, readings: own_program.Readings, run_dir: RunDir, tensorboard,
                 tokens: int, entropy: float | None, first_step: int):
        """`tokens` per step; `entropy`: the train split's unigram entropy (None: synthetic)."""
        self.run, self.readings, self.run_dir = run, readings, run_dir
        self.tokens, self.first_step, self.tensorboard = tokens, first_step, tensorboard
        self.entropy = entropy
        self.times: list[float] = []
        self.evaluated: dict[str, float] = {}  # the last evaluation's eval_* values

    def write(self, step: int, values: dict) -> None:
        """A step's values (loss, step_s, eval_* where evaluated): printed, appended, written."""
        seconds = values["step_s"]
        self.times.append(seconds)
        values |= {"tokens_per_s": self.tokens / seconds,
                   "tflops_per_device": self.readings.flops / seconds / 1e12}
        if "eval_loss" in values:
            self.evaluated = {k: values[k] for k in ("eval_loss", "eval_perplexity")}
        say(self._line(step, values))
        self.run_dir.append("metrics.jsonl", {"step": step, **values})
        if self.tensorboard:
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, step)
    def _line(self, step: int, values: dict) -> str:
        eta = statistics.median(self.times) * (self.run.steps - step)
        line = (f"step {step:>{len(str(self.run.steps))}}/{self.run.steps}  loss "
                f"{values['loss']:.4f}  {values['step_s'] * 1e3:8.1f} ms  "
                f"{values['tokens_per_s']:10,.0f} tok/s  {values['tflops_per_device']:8.3f} "
                f"TFLOP/s/device  ETA {eta:5.1f} s")
        if "expert_dropped" in values:
            line += (f"  experts max/mean {values['expert_load_max_over_mean']:.2f}, dropped "
                     f"{values['expert_dropped']:.2%} (worst device's experts "
                     f"{values['expert_dropped_worst_device']:.2%})")
        if "eval_loss" in values:
            line += (f"  eval loss {values['eval_loss']:.4f} (perplexity "
                     f"{values['eval_perplexity']:,.1f})")
        return line

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()

    def summary(self) -> dict:
        median = statistics.median(self.times[1:] or self.times)  # not step 1's warm-up
        flops, recomputed, compiled = (self.readings.flops, self.readings.recomputed,
                                       self.readings.compiled)
        stats = jax.local_devices()[0].memory_stats() or {}
        result = {
            "median_step_s": median, "tflops_per_device": flops / median / 1e12,
            "tokens_per_s": self.tokens / median,
            "recomputed_flops_per_device": recomputed,
            "peak_device_bytes": stats.get("peak_bytes_in_use"),
            "compiled_device_bytes": compiled.device,
            "compiled_host_bytes": compiled.host,
            "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "host_offload_bytes_planned": self.readings.host_planned,
        }
        if self.evaluated:
            result |= {**self.evaluated, "unigram_entropy": self.entropy}
        peak = (_fmt_bytes(result["peak_device_bytes"]) if stats
                else f"not reported by the {jax.default_backend()} backend")
        say("-" * 100)
        last = self.first_step + len(self.times) - 1
        say(f"median step {median * 1e3:.1f} ms over steps {self.first_step + 1}..{last}"
            if len(self.times) > 1 else f"step time {median * 1e3:.1f} ms (one step)")
        say(f"throughput  {result['tflops_per_device']:.3f} TFLOP/s/device (MaxText's formula), "
            f"{result['tokens_per_s']:,.0f} tokens/s; {recomputed / 1e12:.3g} TFLOP per "
            "device recomputed per step")
        say(f"memory      peak device {peak}, compiled {_fmt_bytes(compiled.device)}; "
            f"host {_fmt_bytes(compiled.host)} compiled, process peak "
            f"{_fmt_bytes(result['host_peak_rss_bytes'])}; offloaded activations "
            f"{_fmt_bytes(self.readings.host_planned)} per device (planned)")
        if self.evaluated:
            say(f"eval        loss {result['eval_loss']:.4f} nats/token (perplexity "
                f"{result['eval_perplexity']:,.1f}) after step {last}; the train split's "
                f"unigram entropy: {self.entropy:.4f} nats/token")
        self.run_dir.write("summary.json", result)
        return result
