"""Imports go one way: each module imports only from its own layer and those below it, so the
trainer never needs the study tools, and the module that starts JAX needs nothing at all; and
no module imports one that imports it back."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Bottom to top. The study tools sit above all of the trainer, their folders in the order of
# docs/reading.md (cli.py and __main__.py: "study", the top); runtime/backend.py (which starts
# JAX) below everything, importing nothing of the project.
LAYERS = ["runtime.backend", "data", "model", "configs", "offload", "trainer", "hf",
          "runtime", "train", "study.programs", "study.hardware",
          "study.command_line", "study.plan", "study.timing", "study.compiling", "study.search",
          "study.bench", "study"]
PACKAGES = {"data", "model", "configs", "offload", "trainer", "hf", "runtime", "study", "train"}


def layer(module: str) -> int:
    """A module's layer: that of its longest prefix in LAYERS."""
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS.index(prefix)


def project_imports(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every project module a file imports, at any depth in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from runtime import backend` imports runtime.backend, not all of runtime.
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return [(name, line) for name, line in found if name.split(".")[0] in PACKAGES]


def modules() -> list[tuple[str, Path]]:
    files = [ROOT / "train.py", *sorted(p for package in PACKAGES - {"train"}
                                        for p in (ROOT / package).rglob("*.py"))]
    return [(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"), p)
            for p in files]


def arrows_against_the_order() -> list[str]:
    wrong = []
    for module, path in modules():
        for imported, line in project_imports(path):
            if module == "runtime.backend" or layer(imported) > layer(module):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {imported}")
    return wrong


def test_every_import_goes_down_the_declared_order():
    assert arrows_against_the_order() == []


def test_the_check_sees_an_arrow_against_the_order(tmp_path, monkeypatch):
    """A trainer module importing the study tools, and the backend importing configs: both
    reported, with file and line."""
    for package, text in (("runtime", "import jax\nfrom runtime import setup\n"),
                          ("trainer", "from study import plan\n"),
                          ("study", "from trainer import program\n")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "mod.py").write_text(text)
    (tmp_path / "runtime" / "backend.py").write_text("from configs import ConfigError\n")
    (tmp_path / "train.py").write_text("from runtime import setup\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert arrows_against_the_order() == [
        "runtime/backend.py:1: runtime.backend imports configs.ConfigError",
        "trainer/mod.py:1: trainer.mod imports study.plan"]


def test_every_project_module_is_in_a_layer():
    for module, _ in modules():
        layer(module)  # max() of nothing raises: a new top-level folder must be placed


def import_cycles() -> list[str]:
    """`a -> b -> a` for each module that reaches itself through the modules its imports name
    (`from configs import get`: configs; `from configs import llama3`: configs.llama3). A
    package's own __init__ importing its modules is no cycle unless one imports it back."""
    known = {module for module, _ in modules()}
    graph = {module: {max((k for k in known if name == k or name.startswith(k + ".")), key=len)
                      for name, _ in project_imports(path)} for module, path in modules()}

    def path_back(start: str) -> list[str] | None:
        """A shortest chain of imports from `start` back to it (breadth first)."""
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            for step in sorted(graph[path[-1]]):
                if step == start:
                    return [*path, start]
                if step not in seen:
                    seen.add(step)
                    paths.append([*path, step])
        return None

    return [" -> ".join(path) for start in sorted(graph) if (path := path_back(start))]


def test_no_module_imports_one_that_imports_it_back():
    assert import_cycles() == []


def test_the_check_sees_a_cycle(tmp_path, monkeypatch):
    """configs/ registering its experiments by importing a family module that imports configs
    back (as it once did): both ends reported."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "__init__.py").write_text("from configs import llama3\n")
    (tmp_path / "configs" / "llama3.py").write_text("from configs import RunConfig\n")
    (tmp_path / "configs" / "settings.py").write_text("import dataclasses\n")
    (tmp_path / "train.py").write_text("import configs\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert import_cycles() == ["configs -> configs.llama3 -> configs",
                               "configs.llama3 -> configs -> configs.llama3"]
