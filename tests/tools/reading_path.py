"""What a reader follows of one training step, measured by tracing a 1-step proxy run (docs/
reading.md): the calls from train.py's train() to the Llama layer body, the files they are in,
the project files the step's function runs, and those a run executes from creating its program
to its first step's result.

    .venv/bin/python tests/tools/reading_path.py
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from runtime import backend  # noqa: E402,F401  (before JAX)
import train  # noqa: E402
from trainer.target import this_machine  # noqa: E402


def project(code) -> str | None:
    path = code.co_filename
    return None if not path.startswith(ROOT) or "/.venv/" in path else os.path.relpath(path, ROOT)


class Recorder:
    def __init__(self):
        self.chain, self.run_files, self.step_files = [], set(), set()
        self.building, self.in_step = False, 0

    def __call__(self, frame, event, arg):
        code, where = frame.f_code, project(frame.f_code)
        if where == "trainer/step.py" and code.co_name == "train_step":
            self.in_step += {"call": 1, "return": -1}.get(event, 0)
        if event != "call" or where is None:
            return
        self.building |= where == "trainer/program.py" and code.co_name == "__init__"
        if self.building:
            self.run_files.add(where)
        if self.in_step:
            self.step_files.add(where)
        if where == "model/llama.py" and code.co_name == "block" and not self.chain:
            while frame:
                if (outer := project(frame.f_code)) is not None:
                    self.chain.insert(0, (outer, frame.f_code.co_name))
                frame = frame.f_back


def main() -> None:
    recorder, target = Recorder(), this_machine()
    setup = train.resolve("llama405b-offload", ["steps=1", "seq=32", "model.n_layers=1",
                                                "quant=none", "out_dir=/tmp/reading-path"],
                          target.devices)
    sys.setprofile(recorder)
    train.train(setup, target)
    sys.setprofile(None)
    start = recorder.chain.index(("train.py", "train"))
    path = recorder.chain[start:]
    print(f"calls from train.py's train() to the layer body: {len(path) - 1}, in "
          f"{len({f for f, _ in path})} files")
    print("\n".join(f"  {f}: {name}" for f, name in path))
    for what, files in (("the step's function runs", recorder.step_files),
                        ("a run executes from its program to its first step's result",
                         recorder.run_files)):
        print(f"project files {what}: {len(files)}\n  {', '.join(sorted(files))}")


if __name__ == "__main__":
    main()
