"""The docs' own arithmetic, where it is arithmetic: the tokens a documented run sees, from the
experiment's settings (configs/), not from a run's output."""

import re
from pathlib import Path

import configs

DOCS = Path(__file__).resolve().parent.parent / "docs"
PARTS = {"half": 2, "third": 3, "quarter": 4, "fifth": 5, "sixth": 6, "seventh": 7, "eighth": 8}


def number(text: str) -> int:
    return int(text.replace(",", ""))


def test_the_tokens_make_shakespeare_sees_are_its_settings_product():
    text = " ".join((DOCS / "data.md").read_text().split())
    run = configs.get("shakespeare").run
    steps, batch, seq = (int(n) for n in re.search(
        r"(\d+) steps of (\d+) windows of (\d+) tokens", text).groups())
    assert (steps, batch, seq) == (run.steps, run.global_batch, run.seq)
    seen, *product, part, split = re.search(
        r"([\d,]+) tokens seen: (\d+) steps x (\d+) windows x (\d+) tokens, a (\w+) of one "
        r"pass over the train split's ([\d,]+) tokens", text).groups()
    assert [int(n) for n in product] == [run.steps, run.global_batch, run.seq]
    assert number(seen) == run.steps * run.global_batch * run.seq
    assert number(split) == number(re.search(r"train [^;]*?([\d,]+) tokens;", text)[1])
    assert round(number(split) / number(seen)) == PARTS[part]
