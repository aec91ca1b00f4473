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


def busy_shares(threads: list[list[tuple[int, int]]]) -> list[float]:
    """The share of the time from the first (start, end) to the last during which 0, 1, ...
    len(threads) of the threads run something (each thread's intervals merged first)."""
    edges = []
    for intervals in threads:
        merged = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        edges += [(start, 1) for start, _ in merged] + [(end, -1) for _, end in merged]
    edges.sort()
    time_with = [0] * (len(threads) + 1)
    running, last = 0, edges[0][0]
    for at, change in edges:
        time_with[running] += at - last
        running, last = running + change, at
    return [t / (last - edges[0][0]) for t in time_with]


def thunk_seconds(run_steps, steps: int) -> tuple[collections.Counter, float, list[float]]:
    """Seconds per step of each instruction on XLA's CPU threads while `run_steps()` runs its
    `steps` steps, what it returns (a step's wall time), and the shares of that time in which
    none, one, ... of those threads ran an instruction."""
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            wall = run_steps()
        profile = jax.profiler.ProfileData.from_file(
            str(next(Path(folder).rglob("*.xplane.pb"))))
    found, threads = collections.Counter(), []
    for plane in profile.planes:
        for line in plane.lines:
            if line.name.startswith("tf_XLAEigen"):  # the pool that runs the thunks
                threads.append([])
                for event in line.events:  # the runtime's own events, and a thunk's end marker
                    if not event.name.startswith(("ThunkExecutor", "Slinky", "Threadpool",
                                                  "end: ")):
                        found[event.name] += event.duration_ns * 1e-9 / steps
                        threads[-1].append((event.start_ns, event.start_ns + event.duration_ns))
    return found, wall, busy_shares(threads)


def lines(compiled, run_steps, steps: int, top: int = 8) -> list[str]:
    """`compiled`'s time per kind and its `top` instructions while `run_steps()` runs it `steps`
    times, beside the step's wall time it returns."""
    text = {m.group(1): m.group(0) for m in re.finditer(r"%([\w.\-]+) = [^\n]*",
                                                        compiled.as_text())}
    seconds, wall, shares = thunk_seconds(run_steps, steps)
    kinds = collections.Counter()
    for name, s in seconds.items():
        kinds[kind_of(name, text.get(name, ""))] += s
    total = sum(seconds.values())
    found = [f"profile: {wall * 1e3:.1f} ms per step (wall, traced); {total * 1e3:.1f} ms of "
             "instructions summed over XLA's CPU threads"]
    found.append(f"  of the traced time, XLA's {len(shares) - 1} CPU threads ran instructions: "
                 + ", ".join(f"{n} of them {share:.0%}" for n, share in enumerate(shares)))
    found += [f"  {kinds[k] * 1e3:7.1f} ms {kinds[k] / total:4.0%}  {k}" for k in KINDS]
    for name, s in seconds.most_common(top):
        where = re.search(r'op_name="([^"]*)"', text.get(name, ""))
        found.append(f"  {s * 1e3:7.2f} ms  {name}: {where.group(1)[-60:] if where else ''}")
    return found
