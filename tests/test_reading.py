"""What a reader follows, held by reading the source (docs/reading.md): train() a stage a
line, in order, none inside another's arguments; and the step's route from train() to the
Llama layer body, each hop a name the caller's own source says, at most 8 calls in 5 files."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The route by reading: (file, function; "A.b" a method or a function nested in A).
ROUTE = [("train.py", "train"), ("trainer/program.py", "Program.compile_run"),
         ("trainer/program.py", "Program.traced"), ("trainer/step.py", "train_step"),
         ("trainer/step.py", "loss_fn"), ("model/llama.py", "trunk"),
         ("model/layers.py", "scan_layers"), ("model/llama.py", "trunk.layer"),
         ("model/llama.py", "block")]
# train()'s stages, each the call its line makes.
STAGES = ["program_for", "compile_run", "read", "check_machine", "start_state", "create",
          "write", "lines", "tensorboard", "StepLog", "Saver", "loop", "summary"]
COMPOUND = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef)


def function(path: str, dotted: str) -> ast.AST:
    node = ast.parse((ROOT / path).read_text())
    for name in dotted.split("."):
        node = next(n for n in ast.walk(node) if isinstance(
            n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
    return node


def names_in(node: ast.AST) -> set[str]:
    """Every name and attribute the node's source says."""
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def called(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
    return None


def test_each_hop_of_the_route_is_a_name_its_caller_says():
    """Guards the class: a step reached through an injected function (a `loss=` argument) or a
    wrapper added between two hops: the caller then no longer names the next function."""
    for (path, caller), (_, callee) in zip(ROUTE, ROUTE[1:]):
        assert callee.split(".")[-1] in names_in(function(path, caller)), (caller, callee)
    assert len(ROUTE) - 1 <= 8 and len({path for path, _ in ROUTE}) <= 5


def test_docs_reading_gives_the_route_held_here():
    text = (ROOT / "docs/reading.md").read_text()
    chain = " -> ".join(f"`{name.split('.')[-1]}`" for _, name in ROUTE)
    assert chain in re.sub(r"\s+", " ", text)
    assert f"{len(ROUTE) - 1} calls in {len({p for p, _ in ROUTE})} files" in text


def test_train_reads_as_its_stages_a_line_each():
    """train()'s lines make its stage calls in order, none inside another stage's arguments:
    nothing compiles, writes or prints inside a check's argument or a constructor's. Guards
    the class: the step first traced in check_machine's argument, the run folder made inside
    the step log's constructor."""
    statements = sorted((s for s in ast.walk(function("train.py", "train"))
                         if isinstance(s, ast.stmt) and not isinstance(s, COMPOUND)),
                        key=lambda s: s.lineno)
    calls = [n for s in statements for n in ast.walk(s) if called(n) in STAGES]
    assert [called(n) for n in calls] == STAGES
    for call in calls:
        inside = {called(n) for arg in [*call.args, *(k.value for k in call.keywords)]
                  for n in ast.walk(arg)}
        assert not inside & set(STAGES), (called(call), inside & set(STAGES))
