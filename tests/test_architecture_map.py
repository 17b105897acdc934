"""docs/architecture.md is a map a newcomer reads in 20 minutes: short, and every path and name it
cites exists. (The reference behind it is docs/internals.md; tests/test_readme.py checks the links
and `xlaserve/...` paths of every page in docs/.)

What is checked, in the page's inline code spans (`...`, outside fenced blocks):

- A path: a span without spaces that contains a `/` or ends in a file suffix (.py, .md, .toml,
  .cc, .h, .json, .txt), and does not start with `/` (a route such as `/v1/models`) or `-` (a
  flag). It is resolved from the repository root, or under xlaserve/ when its first folder is one
  of xlaserve's packages (`runtime/engine/core.py`, `http/`); it must exist.
- A code name, one of:
  - a capitalized identifier with a lowercase letter in it (`EngineCore`, `Request`): a class,
    function or module/class-level assignment of that name somewhere in xlaserve/. ALL_CAPS
    constants are not checked;
  - `A.b` with `A` capitalized (`EngineCore._loop`, `Scheduler.schedule`): a class named `A` in
    xlaserve/ defines `b` in its own body (a method, or an assignment or annotated field);
  - `m.b` with `m` the name of one of xlaserve's modules (`startup.build`, `serving.parse_off_loop`):
    that module defines `b` at its top level; `m.b` for any other `m` (`asyncio.Queue`,
    `xlaserve.Engine`) is not checked;
  - `f()` (`sampling_params()`) and `A.b()` / `m.b()`: as above, the name without its
    parentheses; `f` must be a function or class defined somewhere in xlaserve/.
  Other spans (flags, JSON, lowercase words without parentheses, types like `list[int]`) are
  prose and not checked.

The fenced text blocks (the diagrams) are held to the `A.b` and `f()` rules: every `A.b` and
`f()` in them names something that exists. A "definition" is any `class`/`def` (nested ones too:
a route is a function inside `create_app`) or an assignment at module or class level.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "xlaserve"
REQUEST_PATH_TEST = ROOT / "tests" / "http" / "test_request_path.py"
MAX_LINES = 220

FILE_SUFFIXES = (".py", ".md", ".toml", ".cc", ".h", ".json", ".txt")
IDENT = r"[A-Za-z_]\w*"


class Definitions:
    """What xlaserve/ defines, read with `ast` (nothing imported)."""

    def __init__(self, package: Path):
        self.anywhere: set[str] = set()  # classes, functions, module/class-level assignments
        self.functions: set[str] = set()  # classes and functions, any depth
        self.class_members: dict[str, set[str]] = defaultdict(set)  # class name -> its body's names
        self.module_members: dict[str, set[str]] = defaultdict(set)  # module stem -> top level
        self.packages = {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
        for path in sorted(package.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            top = _body_names(tree.body)
            self.anywhere |= top
            if path.name != "__init__.py":
                self.module_members[path.stem] |= top
            for node in ast.walk(tree):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions.add(node.name)
                    self.anywhere.add(node.name)
                if isinstance(node, ast.ClassDef):
                    members = _body_names(node.body)
                    self.class_members[node.name] |= members
                    self.anywhere |= members

    def missing(self, name: str) -> str | None:
        """Why `name` (one code-name span, see the module docstring) is not defined; None if it
        is, or if it is not of a kind this test checks."""
        call = name.endswith("()")
        name = name.removesuffix("()")
        if match := re.fullmatch(rf"({IDENT})\.({IDENT})", name):
            owner, member = match.groups()
            if owner[0].isupper():
                if owner not in self.class_members:
                    return f"no class {owner}"
                if member not in self.class_members[owner]:
                    return f"class {owner} defines no {member}"
            elif owner in self.module_members and member not in self.module_members[owner]:
                return f"module {owner} defines no {member}"
            return None
        if not re.fullmatch(IDENT, name):
            return None
        if call:
            return None if name in self.functions else f"no function or class {name}"
        if name[0].isupper() and re.search("[a-z]", name):
            return None if name in self.anywhere else f"nothing named {name}"
        return None


def _body_names(body: list[ast.stmt]) -> set[str]:
    names = set()
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:`, optional imports' fallbacks
            names |= _body_names(node.body)
    return names


FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
TEXT = PAGE.read_text()
PROSE = FENCE.sub("", TEXT)
SPANS = sorted(set(re.findall(r"`([^`\n]+)`", PROSE)))
DIAGRAMS = "\n".join(m.group(2) for m in FENCE.finditer(TEXT) if m.group(1) in ("", "text"))
DEFINED = Definitions(PACKAGE)


def _is_path(span: str) -> bool:
    return (not re.search(r"\s", span) and not span.startswith(("/", "-"))
            and ("/" in span or span.endswith(FILE_SUFFIXES)))


def _resolve(span: str) -> Path:
    first = span.split("/", 1)[0]
    return (PACKAGE / span) if first in DEFINED.packages else (ROOT / span)


PATHS = [s for s in SPANS if _is_path(s)]
NAMES = [s for s in SPANS if not _is_path(s)]


def test_the_map_is_short():
    assert len(TEXT.splitlines()) <= MAX_LINES


def test_it_cites_paths_and_names():
    assert len(PATHS) >= 20 and len(NAMES) >= 20, (len(PATHS), len(NAMES))


def test_every_path_it_cites_exists():
    assert sorted(p for p in PATHS if not _resolve(p).exists()) == []


def test_every_name_it_cites_is_defined_in_xlaserve():
    missing = {name: why for name in NAMES if (why := DEFINED.missing(name))}
    assert missing == {}


def test_every_name_in_its_diagrams_is_defined_in_xlaserve():
    names = set(re.findall(rf"(?<![\w.])({IDENT}\.{IDENT}(?:\(\))?|{IDENT}\(\))", DIAGRAMS))
    assert names, "the diagrams name the code they show"
    missing = {name: why for name in sorted(names) if (why := DEFINED.missing(name))}
    assert missing == {}


def test_it_states_the_request_path_bounds_the_trace_sets():
    source = REQUEST_PATH_TEST.read_text()
    max_files = re.search(r"^MAX_FILES = (\d+)", source, re.M).group(1)
    max_types = re.search(r"^MAX_TYPES = (\d+)", source, re.M).group(1)
    assert f"{max_files} files" in TEXT and f"{max_types} named types" in TEXT


@pytest.mark.parametrize("name, defined", [
    ("EngineCore", True), ("EngineCore._loop", True), ("Scheduler.schedule", True),
    ("sampling_params()", True), ("startup.build", True), ("asyncio.Queue", True),
    ("MAX_FILES", True),
    ("EngineCorez", False), ("EngineCore.make_tea", False), ("make_tea()", False),
    ("startup.make_tea", False), ("NoSuchClass.run", False),
])
def test_the_name_rule_itself(name, defined):
    assert (DEFINED.missing(name) is None) is defined, DEFINED.missing(name)
