"""Features are objects, not branches (issue 72; docs/architecture.md, "Features are objects").

The three central files, which every request runs through, ask which features a server has in at
most two places each: the engine loop (runtime/engine/core.py), the runner
(runtime/executor/model_runner.py) and the scheduler (runtime/scheduler/scheduler.py). A feature
is built at start-up (runtime/engine/startup.py, the composition root) as an object: a hook in
the step pipeline's list (runtime/engine/steps.py) where it is on, or a do-nothing form where it
is off, which these files call without asking.

What counts as asking: a condition (an `if`, a conditional expression, a `while`, a
comprehension's `if`, an operand of `and` / `or`, a `match` case, an `isinstance`) that names a
feature's object or flag (FEATURE_NAMES: the attributes and names that hold LoRA adapters,
speculative decoding's drafts, the multi-host group, images, embeddings' pooling, the host tier,
data parallel replicas, hidden states, and the request fields that ask for one of them). Each
place the files still ask is listed in ALLOWED with the reason it stays; a new one fails here. Calling a feature's
object (`self.lora.compile()`, `self.speculator.drafts(...)`) is not asking.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "xlaserve"
CENTRAL = ("runtime/engine/core.py", "runtime/executor/model_runner.py",
           "runtime/scheduler/scheduler.py")
FEATURE_NAMES = {
    # LoRA adapters
    "lora", "lora_path", "enable_lora", "LoraAdapters", "LoadLora", "UnloadLora",
    # speculative decoding
    "speculator", "speculation", "speculative_algorithm", "drafter", "draft", "_draft",
    "draft_head", "draft_head_pool", "DraftTree", "DraftModel", "DraftHead", "num_drafts",
    "tree_parents",
    # several processes
    "leader", "_leader", "Leader", "nnodes", "sink", "replays",
    # images
    "images", "prompt_images", "takes_images", "multimodal", "vision",
    # embeddings and rerankers
    "pooling", "pooled", "embed", "classifier_head", "is_embedding",
    # the prefix cache's host tier
    "host_kv", "host_tier", "enable_hierarchical_cache",
    # data parallel replicas
    "dp_size", "dp_rank",
    # hidden states (--enable-return-hidden-states)
    "hidden_states", "return_hidden_states", "enable_return_hidden_states", "hidden_rows",
}
# (file, function, feature name): why it stays. At most two a file.
ALLOWED = {
    ("runtime/engine/core.py", "submit", "embed"):
        "an embedding request is built apart (the request's kind, not the server's: the steps "
        "refuse the wrong kind first, GenerationSteps.check_kind)",
    ("runtime/engine/core.py", "submit", "lora_path"):
        "a request naming an adapter is resolved and queued under the adapters' lock, ahead of "
        "any unload of it; a plain request skips the lock",
    ("runtime/executor/model_runner.py", "precompile", "replays"):
        "over several processes an idle step of each bucket runs on every process (the "
        "followers compile as they replay it) instead of being compiled here",
    ("runtime/scheduler/scheduler.py", "process_results", "num_drafts"):
        "a verified row (its drafts are the batch's data) gives its tokens through the "
        "Speculator; a plain row takes its one token here",
}


def _names(node: ast.AST) -> set[str]:
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
        elif isinstance(sub, ast.MatchClass) and isinstance(sub.cls, ast.Name):
            found.add(sub.cls.id)
    return found & FEATURE_NAMES


def feature_tests(path: str) -> list[tuple[str, set[str], int]]:
    """(function, feature names, line) of each condition of `path` that names a feature."""
    tree = ast.parse((ROOT / path).read_text())
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        conditions: list[ast.AST] = []
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            conditions = [node.test]
        elif isinstance(node, ast.comprehension):
            conditions = list(node.ifs)
        elif isinstance(node, ast.BoolOp):
            conditions = list(node.values)
        elif isinstance(node, ast.match_case):
            conditions = [node.pattern]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "isinstance"):
            conditions = [node]
        for condition in conditions:
            if names := _names(condition):
                found.append((function, names, condition.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found


@pytest.mark.parametrize("path", CENTRAL)
def test_a_central_file_asks_which_features_are_on_in_at_most_two_places(path):
    asked = feature_tests(path)
    unexplained = sorted(f"{path}:{line}: {function}() tests {', '.join(sorted(names))}"
                         for function, names, line in asked
                         if not any((path, function, name) in ALLOWED for name in names))
    assert not unexplained, ("a feature's object or flag tested in a central file: build it at "
                             "start-up as a hook or a do-nothing object instead (this file's "
                             "docstring)\n" + "\n".join(unexplained))
    allowed_here = [key for key in ALLOWED if key[0] == path]
    assert len(allowed_here) <= 2
    seen = {(path, function, name) for function, names, _ in asked for name in names}
    assert all(key in seen for key in allowed_here), "an allowed test is gone: drop it here"


def test_the_check_sees_a_feature_test():
    """The check itself: a branch on an adapter, a draft tree and a pooled request is found."""
    source = ("def f(self, r):\n    if self.lora is not None:\n        pass\n"
              "    x = 1 if isinstance(r, DraftTree) else 2\n    return r.pooled and x\n")
    tree = ast.parse(source)
    conditions = [n for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.BoolOp))]
    assert {name for c in conditions for name in _names(getattr(c, "test", c))} == {
        "lora", "DraftTree", "pooled"}


def test_no_file_over_450_lines_and_no_folder_over_20_modules():
    """Issue 72's bounds, kept: a central file that grows past 450 lines, or a folder past 20
    modules (its __init__ aside), is split by concern before it lands."""
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    crowded = {str(d.relative_to(ROOT)): n for d in [ROOT, *ROOT.rglob("*/")]
               if (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > 20}
    assert long == {} and crowded == {}, (long, crowded)
