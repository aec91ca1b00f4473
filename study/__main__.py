"""The study tools: what the trainer's step does at full scale, examined without running it.

    python -m study plan EXPERIMENT [key=value ...]     its full-scale memory plan per GPU
    python -m study compile EXPERIMENT [key=value ...]  its full-scale step compiled for its
                                                        GPUs (device=...) without a GPU, the
                                                        step replayed from the schedule
    python -m study search EXPERIMENT [key=value ...]   placements ranked by predicted memory
                                                        and step time (search/placements.py)
    python -m study fit [ROW ...] [device=KIND] [gpus=N]    how many of each row's layers
                                                        fit 1-8 GPUs (the fit scale)
    python -m study step-times [--hlo DIR] [EXPERIMENT ...]   every row replayed vs the study
    python -m study compile-table [EXPERIMENT ...] [key=value ...]   every row's compiled memory
    python -m study bench [EXPERIMENT ...] [key=value ...]   proxy step time on this machine
    python -m study cpu-step [steps=N] [rounds=N] [profile=1]   the CPU step at nanoGPT's
                                                        size and the proxies', against a
                                                        same-run matmul; profile=1: by kind
    python -m study checkpoint-bench [EXPERIMENT ...] [steps=N]   checkpoint save, restore costs
    python -m study gpu-check [--smoke] [out_dir=DIR]   gradients and step times on a real GPU

A comparison (llama405b-compare) plans, compiles or searches each of its rows (the tools take
it as its rows). Any mistake is one line and exit status 2, before anything is traced or
compiled.
"""

from runtime import backend  # noqa: F401  (first: it settles the platform, GPU memory and XLA flags)

import sys

import configs
from configs import ConfigError
from runtime.backend import BackendError
from data.tokens import DataError
from hf.safetensors import CheckpointError
from trainer.target import this_machine

ROWS = ("plan", "compile", "search")  # modes that take one experiment (or a comparison): cli.py
# The other modes: each a module with its own main(argv), imported only when asked for.
TOOLS = {"fit": "study.compiling.fit_table", "step-times": "study.compiling.step_times",
         "compile-table": "study.compiling.compile_table", "bench": "study.bench.proxy_step",
         "checkpoint-bench": "study.bench.checkpoint_costs", "gpu-check": "study.bench.gpu_check",
         "cpu-step": "study.bench.cpu_step"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    mode, rest = argv[0], argv[1:]
    try:
        if mode in TOOLS:
            import importlib
            return importlib.import_module(TOOLS[mode]).main(rest)
        if mode not in ROWS:
            raise ConfigError(f"unknown study mode {mode!r}; the modes are "
                              f"{', '.join([*ROWS, *TOOLS])}")
        if not rest or rest[0].startswith("-"):
            raise ConfigError(f"usage: python -m study {mode} EXPERIMENT [key=value ...]")
        name, args = rest[0], rest[1:]
        if name not in configs.COMPARISONS:
            configs.get(name)  # an unknown experiment is one line
        if flags := [a for a in args if a.startswith("-")]:
            raise ConfigError(f"unknown flag {flags[0]!r}: after the experiment come "
                              "key=value words only")
        configs.parse_overrides(args)  # a word that is not key=value, before JAX starts
        this_machine()  # starts JAX's backend (quietly: runtime/backend.py)
        from study import cli
        for member in configs.COMPARISONS.get(name, (name,)):
            getattr(cli, mode)(member, args)
        return 0
    except (ConfigError, DataError, CheckpointError, BackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
