"""The words of a study command line, every one checked before anything is traced or compiled:
an experiment's full-scale settings and GPU (`study_setup`), and a tool's flags, experiments and
key=value words (`tool_words`)."""

from collections.abc import Mapping

import configs
from configs import ConfigError
from runtime.setup import Setup, resolve
from study.hardware.gpus import Gpu, gpu_of


def study_setup(name: str, args: list[str]) -> tuple[Setup, Gpu]:
    """The experiment's full-scale settings (the trainer's `resolve`) and the GPU it is studied
    on: its own, or `device=NAME` (a word of the study tools, not of a run)."""
    devices = [a.partition("=")[2] for a in args if a.startswith("device=")]
    gpu = gpu_of(name, devices[-1] if devices else "")
    return resolve(name, [a for a in args if not a.startswith("device=")], full=True), gpu


def tool_words(usage: str, argv: list[str], flags: Mapping[str, str | None], names: bool = True,
               keys: bool = False) -> tuple[dict, list[str], list[str]]:
    """(the flags given -> their value, True for one that takes none; the experiments, a
    comparison as its rows; the key=value words) of a tool's command line, every word checked
    before the tool traces or compiles anything. `usage`: its words after `python -m study`;
    `flags`: those it takes -> what each takes after it (None: nothing)."""
    given, found, words, rest = {}, [], [], iter(argv)
    for word in rest:
        if word.startswith("-"):  # a flag, never an experiment
            if word not in flags:
                raise ConfigError(f"unknown flag {word!r}; usage: python -m study {usage}")
            if flags[word] is None:
                given[word] = True
            elif (value := next(rest, "")) and not value.startswith("-"):
                given[word] = value
            else:
                raise ConfigError(f"{word} needs {flags[word]} after it; usage: python -m study "
                                  f"{usage}")
        else:
            (words if "=" in word else found).append(word)
    if found and not names:
        raise ConfigError(f"unexpected word {found[0]!r}; usage: python -m study {usage}")
    if words and not keys:
        raise ConfigError(f"{usage.split()[0]} takes no key=value words, got {words[0]!r}; "
                          f"usage: python -m study {usage}")
    configs.parse_overrides(words)  # each word key=value
    for name in found:
        if name not in configs.COMPARISONS:
            configs.get(name)
    return given, [row for n in found for row in configs.COMPARISONS.get(n, (n,))], words
