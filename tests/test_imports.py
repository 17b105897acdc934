"""The dependency direction of docs/architecture.md ("Layers"), enforced: `lint-imports` checks
the contracts in pyproject.toml over every import of the package, function-local ones included;
and no two files import each other, even for annotations only (`if TYPE_CHECKING:`, which the
contracts leave out), since a newcomer reads such a pair as one tangle.

And each folder's `__init__.py` curates its public names (`__all__`, read lazily from the modules
that define them: xlaserve/_lazy.py): code outside a folder imports only those."""
import ast
import importlib
import os
import subprocess
import sys
import tomllib
import types

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


def _modules() -> dict[str, str]:
    """Every module of xlaserve by dotted name -> its file (a folder's is its __init__.py)."""
    modules = {}
    for folder, subfolders, files in os.walk(os.path.join(ROOT, "xlaserve")):
        subfolders[:] = [f for f in subfolders if f != "__pycache__"]
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                name = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
                modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = _modules()
FOLDERS = sorted(m for m, path in MODULES.items()
                 if path.endswith("__init__.py") and m != "xlaserve")


def _folder_of(module: str) -> str:
    """The folder a module's file is in (a folder's __init__.py is in that folder)."""
    return module if MODULES[module].endswith("__init__.py") else module.rpartition(".")[0]


def _names_imported(module: str):
    """(line, holder, name) for each name `module` imports from xlaserve: `from holder import
    name`, or `import holder.name` (a module is a name of the module or folder that holds it)."""
    tree = ast.parse(open(MODULES[module]).read(), MODULES[module])
    for node in ast.walk(tree):  # function-local and `if TYPE_CHECKING:` imports too
        if isinstance(node, ast.ImportFrom):
            holder = node.module or ""
            if node.level:  # relative: from the folder `level - 1` folders above this file's
                base = _folder_of(module).split(".")
                base = base[:len(base) - (node.level - 1)]
                holder = ".".join(base + ([holder] if holder else []))
            for alias in node.names:
                yield node.lineno, holder, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                holder, _, name = alias.name.rpartition(".")
                yield node.lineno, holder, name


def _folder_offering(holder: str, importer: str) -> str | None:
    """The folder whose `__all__` must offer a name of `holder` to `importer`: the nearest folder
    that holds `holder` (or is it) and that `importer` is outside of; None for a name of
    xlaserve's top level or of another package."""
    inside = _folder_of(importer)
    folder = holder if holder in MODULES and MODULES[holder].endswith("__init__.py") \
        else holder.rpartition(".")[0]
    while folder.startswith("xlaserve."):
        if inside != folder and not inside.startswith(folder + "."):
            return folder
        folder = folder.rpartition(".")[0]
    return None


def test_code_outside_a_folder_imports_only_the_names_its_init_offers():
    offered = {folder: set(importlib.import_module(folder).__all__) for folder in FOLDERS}
    wrong = []
    for importer in sorted(MODULES):
        for line, holder, name in _names_imported(importer):
            folder = _folder_offering(holder, importer)
            if folder is not None and name not in offered[folder]:
                wrong.append(f"{os.path.relpath(MODULES[importer], ROOT)}:{line}: imports {name} "
                             f"(from {holder}), which {folder}'s __all__ does not offer")
    assert not wrong, "\n".join(wrong)


def test_the_nearest_folder_an_importer_is_outside_of_offers_the_name():
    engine, http = "xlaserve.runtime.engine", "xlaserve.http"
    assert _folder_offering(f"{engine}.core", "xlaserve.http.chat") == engine
    assert _folder_offering(engine, "xlaserve.offline") == engine  # from the folder itself
    assert _folder_offering("xlaserve.runtime", "xlaserve.offline") == "xlaserve.runtime"
    assert _folder_offering(f"{engine}.core", "xlaserve.runtime.scheduler.request") == engine
    assert _folder_offering(f"{engine}.core", f"{engine}.startup") is None  # inside
    assert _folder_offering(f"{http}.parsing.tools", "xlaserve.http.chat") == f"{http}.parsing"
    assert _folder_offering(f"{http}.errors", "xlaserve.http.parsing.tools") is None
    assert _folder_offering(f"{http}.parsing.tools", "xlaserve.http.parsing") is None
    assert _folder_offering("xlaserve", "xlaserve.offline") is None  # `from xlaserve import x`
    assert _folder_offering("jax.numpy", "xlaserve.offline") is None


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_name_a_folder_offers_resolves(folder):
    package = importlib.import_module(folder)
    assert package.__all__ and len(set(package.__all__)) == len(package.__all__)
    assert sorted(dir(package)) == sorted(package.__all__)
    for name in package.__all__:
        value = getattr(package, name)  # raises AttributeError where it does not
        if f"{folder}.{name}" in MODULES:  # a module's name is that module, never a namesake
            assert value is sys.modules[f"{folder}.{name}"], name
        else:
            assert not isinstance(value, types.ModuleType), name


def test_a_folder_imports_none_of_its_modules_until_a_name_is_used():
    code = ("import importlib, sys\n"
            f"for folder in {FOLDERS!r}:\n"
            "    importlib.import_module(folder)\n"
            "print(sorted(m for m in sys.modules if m.startswith('xlaserve')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert ast.literal_eval(result.stdout) == sorted(["xlaserve", "xlaserve._lazy", *FOLDERS])
