"""The dependency direction of docs/architecture.md ("Layers"), enforced: `lint-imports` checks
the contracts in pyproject.toml over every import of the package, function-local ones included;
and no two files import each other, even for annotations only (`if TYPE_CHECKING:`, which the
contracts leave out), since a newcomer reads such a pair as one tangle."""
import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_import_contract_is_kept():
    lint_imports = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    result = subprocess.run([lint_imports, "--no-cache", "--no-logo"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("contract", ["layers", "scheduler-pure", "fastapi-in-http", "no-cycles"])
def test_the_contracts_docs_architecture_promises_are_configured(contract):
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    assert contract in {c["id"] for c in contracts}


def test_no_files_import_each_other_even_for_annotations():
    import grimp

    graph = grimp.build_graph("xlaserve", exclude_type_checking_imports=False)
    modules = {m for m in graph.modules if m.startswith("xlaserve")}
    imports = {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}
    assert _circles(imports) == []


def _circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], [0]
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(sorted(imports[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(imports[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    return circles


def test_the_circle_finder_finds_a_circle_and_only_that():
    imports = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(imports) == [["a", "b", "c"]]
