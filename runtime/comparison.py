"""A comparison (`python train.py llama405b-compare`): its rows run one after another, then one
table like the study's. On one host each row runs in a process of its own, so that its peak
memory is its own; first `python train.py fit COMPARISON` checks every row and, at fit scale,
finds the fit every row fits, so that the rows compare (docs/runs.md). A multi-process launch
runs the rows in its own processes (train.py)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import configs
from configs import STUDY_TFLOPS, ConfigError
from runtime.own_program import GiB
from runtime.report import new_run_dir

TRAIN = Path(__file__).resolve().parent.parent / "train.py"
FIT_LINE = "fit of every row: "  # the last line of `train.py fit COMPARISON` at fit scale


def child(words: list[str], capture: bool = False, env: dict | None = None) -> tuple[int, str]:
    """(exit status, stdout if captured) of `python train.py WORDS` (in `env`, else this
    process's). Ctrl-C reaches the child from the terminal, SIGTERM is passed on: it stops at a
    step boundary, as a run does."""
    process = subprocess.Popen([sys.executable, str(TRAIN), *words], text=True, env=env,
                               stdout=subprocess.PIPE if capture else None)
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM,
                                              lambda *_: process.send_signal(signal.SIGTERM))}
    try:
        out, _ = process.communicate()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if capture:
        print(out, end="", flush=True)
    return process.returncode, out or ""


def run_rows(name: str, args: list[str], env=lambda row: None) -> tuple[int, list[dict], Path]:
    """(exit status, the rows run, their folder): each row of comparison `name` in a process of
    its own (`env(row)`: its environment), at the fit every row fits where they run at fit
    scale; the first status that is not 0 stops it."""
    status, out = child(["fit", name, *args], capture=True)
    if status:
        return status, [], Path()
    fitted = [line.removeprefix(FIT_LINE).split() for line in out.splitlines()
              if line.startswith(FIT_LINE)]
    out_dir = configs.parse_overrides(args).get("out_dir", configs.RunConfig.out_dir)
    folder, rows = new_run_dir(out_dir, name), []
    for row in configs.COMPARISONS[name]:
        before = set(folder.iterdir())
        words = [row, *args, *(fitted[-1] if fitted else []), f"out_dir={folder}"]
        if status := child(words, env=env(row))[0]:
            return status, rows, folder
        (run_dir,) = set(folder.iterdir()) - before
        rows.append({**read_row(run_dir), "run_dir": run_dir})
    return 0, rows, folder


def check_rows(name: str, args: list[str]) -> None:
    """What a comparison cannot take: one row's checkpoint."""
    for key in ("resume", "checkpoint_dir"):
        if any(a.startswith(key + "=") for a in args):
            raise ConfigError(f"{name} runs several experiments: {key}= is for one of them "
                              f"({', '.join(configs.COMPARISONS[name])})")


def read_row(run_dir: Path) -> dict:
    """A row of the table: the run's config.json with its summary."""
    return {**json.loads((run_dir / "config.json").read_text()),
            "summary": json.loads((run_dir / "summary.json").read_text())}


def _ratio(value: float | None, first: float | None) -> str:
    return f"{value / first:.3f}" if value and first else "-"


def table(name: str, rows: list[dict], folder: Path) -> None:
    """The rows (each a run's config.json with its summary) as one table like the study's,
    each row's throughput against the first row's beside the study's ratio; printed and
    written as compare.md and compare.csv."""
    header = ["row", "preset", "LHS", "pipelined offload", "step ms", "TFLOP/s/device",
              "vs first", "study: vs first", "peak device GiB", "host GiB (compiled)",
              "recomputed TFLOP/device"]
    evaluated = any("eval_loss" in row["summary"] for row in rows)
    header += ["eval loss", "eval perplexity"] if evaluated else []
    first, study_first = rows[0]["summary"]["tflops_per_device"], STUDY_TFLOPS.get(
        rows[0]["experiment"])
    lines = []
    for row in rows:
        summary, run = row["summary"], row["run"]
        flags, peak = run["xla_flags"], summary["peak_device_bytes"]
        lines.append([row["experiment"], run["preset"], flags.get(configs.LHS, "default"),
                      flags.get(configs.PIPELINED, "false"),
                      f"{summary['median_step_s'] * 1e3:.1f}",
                      f"{summary['tflops_per_device']:.3f}",
                      _ratio(summary["tflops_per_device"], first),
                      _ratio(STUDY_TFLOPS.get(row["experiment"]), study_first),
                      "n/a" if peak is None else f"{peak / GiB:.2f}",
                      f"{summary['compiled_host_bytes'] / GiB:.2f}",
                      f"{summary['recomputed_flops_per_device'] / 1e12:.3g}"])
        if evaluated:
            lines[-1] += ([f"{summary['eval_loss']:.4f}", f"{summary['eval_perplexity']:.2f}"]
                          if "eval_loss" in summary else ["n/a", "n/a"])
    markdown = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    markdown += ["| " + " | ".join(line) + " |" for line in lines]
    scales = ", ".join(sorted({row["scale"] for row in rows}))
    print(f"\n{name} ({scales} scale, {rows[0]['devices']}):")
    print("\n".join([*markdown, *_one_program(rows)]))
    (folder / "compare.md").write_text("\n".join(markdown) + "\n")
    (folder / "compare.csv").write_text("\n".join(",".join(r) for r in [header, *lines]) + "\n")
    print(f"written to {folder}")


def _one_program(rows: list[dict]) -> list[str]:
    """On a CPU, once: which rows run one program there (it drops host placements, an
    offloaded tensor stays on the device, and XLA flags are a GPU's) and where they differ."""
    if rows[0]["platform"] != "cpu":
        return []
    groups: dict[str, list[str]] = {}
    for row in rows:
        run = {k: v for k, v in row["run"].items() if k != "xla_flags"}
        placement = json.dumps(row["placement"]).replace('"offload"', '"device"')
        key = json.dumps([row["model"], run, placement], sort_keys=True, default=str)
        groups.setdefault(key, []).append(row["experiment"])
    same = [" = ".join(names) for names in groups.values() if len(names) > 1]
    return [f"On a cpu backend host placements are dropped (an offloaded tensor stays on the "
            f"device) and XLA flags are not applied: {'; '.join(same) or 'no two rows'} run "
            f"one program here. Their GPU programs differ: python -m study compile ROW "
            f"(or this table on GPUs)."]
