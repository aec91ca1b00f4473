"""Every run setting is declared once beside its field (configs.settings `setting`): its range or
choices, its resume rule and the header row that shows it; the row does show it."""

import dataclasses
import types
from collections.abc import Mapping
from pathlib import Path

import jax

from configs import MeshConfig
from configs.checks import CHOICES, _value
from configs.settings import declared
from runtime import header, report
from runtime.setup import resolve
from trainer.program import forward_options
from trainer.target import Target


# Settings whose row shows what resolving them makes (the token file read), not the word.
# Settings a run resolves into others, shown there; fit_memory in the fit row, which only a fit
# scale run has (tests/test_fit.py), auto_steps in the placement row of a preset=auto run
# (tests/test_auto.py).
RESOLVED = {"data.path", "data.dtype", "fit_memory", "auto_steps"}


def _header(setup, devices) -> dict[str, str]:
    run = setup.run
    options = forward_options(setup.model, run, setup.placement, None, Target("cpu", None,
                                                                              devices))
    run_dir = report.RunDir.at(Path(run.out_dir) / "a-run", run)
    return header.settings_rows(setup, Target("cpu", None, devices), options, run_dir, 3)


def _other(key: str, value):
    """A value of a setting other than `value` (its header need not make sense of it)."""
    if key in CHOICES:
        return next(c for c in CHOICES[key] if c != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return {**value, "x": "y"} if isinstance(value, Mapping) else value + "x"


def _replaced(run, key: str, value):
    name, _, rest = key.partition(".")
    inner = _replaced(getattr(run, name), rest, value) if rest else value
    return dataclasses.replace(run, **{name: inner})


def test_every_run_setting_is_shown_in_the_header_row_it_declares():
    """Each setting's declaration (configs `setting(shown=ROW)`) names a row of the run
    header, and changing the setting changes that row's text: on the DeepSeek proxy with its
    experts split, NVFP4 and evaluation on (so every setting means something), and without
    the split for the experts' path (which the split replaces)."""
    devices = tuple(jax.devices())
    split = resolve("deepseek671b-offload", ["mesh.expert=4", "quant=nvfp4", "resume="],
                    devices)
    val = types.SimpleNamespace(tokens=range(1000))
    split = dataclasses.replace(split, run=dataclasses.replace(split.run, eval_every=5,
                                                               checkpoint_every=2),
                                data=types.SimpleNamespace(describe=lambda: "tokens",
                                                           unigram_entropy=None, val=val))
    whole = dataclasses.replace(split, run=dataclasses.replace(split.run, mesh=MeshConfig()))
    for key, meta in declared():
        assert meta["shown"] in header.ROWS, key
        if key in RESOLVED:
            continue
        base = whole if key == "expert_path" else split
        before = _header(base, devices)
        changed = _replaced(base.run, key, _other(key, _value(base.run, key)))
        after = _header(dataclasses.replace(base, run=changed), devices)
        assert after[meta["shown"]] != before[meta["shown"]], key
