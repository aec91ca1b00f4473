"""Where a compiled CPU step's time goes: `python -m study cpu-step profile=1`.

The step is compiled again with XLA's per-thunk trace events on (`xla_cpu_enable_xprof_traceme`:
off in the timed program, where it would cost time), run under jax.profiler, and each event's
time on XLA's CPU threads summed per instruction and sorted into kinds by the compiled HLO."""

import collections
import re
import tempfile
from pathlib import Path

import jax

KINDS = ("matrix products", "elementwise and reductions", "zero-fills", "copies and transposes",
         "loop control")


def kind_of(name: str, line: str) -> str:
    """An instruction's kind from its name and its line in the compiled HLO."""
    if re.search(r"__(ynn|xnn)_fusion|= \S+ dot\(", line):
        return "matrix products"
    if name.startswith("wrapped_broadcast"):
        return "zero-fills"  # a constant broadcast into a buffer (a loop's stacked outputs)
    if re.search(r"= \S+ (copy|transpose)\(", line) or name.startswith(("copy", "transpose")):
        return "copies and transposes"
    if re.search(r"= \S+ while\(", line):
        return "loop control"
    return "elementwise and reductions"


def thunk_seconds(run_steps, steps: int) -> tuple[collections.Counter, float]:
    """Seconds per step of each instruction on XLA's CPU threads while `run_steps()` runs its
    `steps` steps, and what it returns (a step's wall time)."""
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            wall = run_steps()
        profile = jax.profiler.ProfileData.from_file(
            str(next(Path(folder).rglob("*.xplane.pb"))))
    found = collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            if line.name.startswith("tf_XLAEigen"):  # the pool that runs the thunks
                for event in line.events:
                    if not event.name.startswith(("ThunkExecutor", "Slinky", "Threadpool")):
                        found[event.name] += event.duration_ns * 1e-9 / steps
    return found, wall


def lines(compiled, run_steps, steps: int, top: int = 8) -> list[str]:
    """`compiled`'s time per kind and its `top` instructions while `run_steps()` runs it `steps`
    times, beside the step's wall time it returns."""
    text = {m.group(1): m.group(0) for m in re.finditer(r"%([\w.\-]+) = [^\n]*",
                                                        compiled.as_text())}
    seconds, wall = thunk_seconds(run_steps, steps)
    kinds = collections.Counter()
    for name, s in seconds.items():
        kinds[kind_of(name, text.get(name, ""))] += s
    total = sum(seconds.values())
    found = [f"profile: {wall * 1e3:.1f} ms per step (wall, traced); {total * 1e3:.1f} ms of "
             "instructions summed over XLA's CPU threads"]
    found += [f"  {kinds[k] * 1e3:7.1f} ms {kinds[k] / total:4.0%}  {k}" for k in KINDS]
    for name, s in seconds.most_common(top):
        where = re.search(r'op_name="([^"]*)"', text.get(name, ""))
        found.append(f"  {s * 1e3:7.2f} ms  {name}: {where.group(1)[-60:] if where else ''}")
    return found
