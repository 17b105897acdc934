"""The README stays a front page that is true: every shell command in it names a module, script,
make target, extra and flag that exist (each command's arguments parsed by that command's own
argparse parser, nothing started), its cheap commands run, its Python examples compile, its links
and paths resolve, and it stays short. The docs/ pages are held to the same links and paths.
Seconds in all: the parsers run in subprocesses that load no model."""
from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from xlaserve.server_args import ServerArgs

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 260

SHELL_LANGUAGES = ("bash", "sh", "shell")
INTERPRETERS = ("python", "python3", ".venv/bin/python")
# Shell variables the README's commands use, with a value of the right kind for parsing.
SHELL_VARIABLES = {"RANK": "1", "WORKER0_IP": "10.0.0.2"}
# `python -m` modules that are not xlaserve's, each with how its arguments are checked.
EXTERNAL_MODULES = {"pip", "pytest", "sglang_router.launch_router"}

# Runs a command's `main` up to its `parse_args` call, takes the parser it built there, and
# parses the given arguments with it: argparse's own error and exit status 2 on a bad flag or
# value, exit 0 (and the help text) for --help; nothing after parse_args runs.
PARSE_WITH_OWN_PARSER = r"""
import argparse, os, runpy, sys

class Found(Exception):
    pass

def capture(self, args=None, namespace=None):
    raise Found(self)

parse_args = argparse.ArgumentParser.parse_args
argparse.ArgumentParser.parse_args = capture
kind, target, *args = sys.argv[1:]
sys.argv = [target]
try:
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
except Found as found:
    parser = found.args[0]
else:
    sys.exit(f"{target} returned without parsing its arguments")
argparse.ArgumentParser.parse_args = parse_args
parser.parse_args(args)
"""


def _blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
            if m.group(1) in languages]


def _commands(text: str, strict: bool = True) -> list[list[str]]:
    """Each shell command of the fenced shell blocks as argv: continued lines joined, comments
    dropped, split at ; && || |, shell variables replaced by SHELL_VARIABLES (one it lacks is a
    KeyError if `strict`, else left as it is)."""
    def variable(match):
        name = match.group(1)
        return SHELL_VARIABLES[name] if strict else SHELL_VARIABLES.get(name, match.group(0))

    commands = []
    for block in _blocks(text, SHELL_LANGUAGES):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            command: list[str] = []
            for token in lexer:
                if set(token) <= set(";&|"):
                    commands.append(command)
                    command = []
                else:
                    command.append(re.sub(r"\$(\w+)", variable, token))
            commands.append(command)
    return [c for c in commands if c]


def _text_outside_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


README_TEXT = README.read_text()
COMMANDS = _commands(README_TEXT)
PYTHON_COMMANDS = [c for c in COMMANDS  # xlaserve's modules and the scripts: each has a parser
                   if c[0] in INTERPRETERS and not (c[1] == "-m" and c[2] in EXTERNAL_MODULES)]
MAKE_COMMANDS = [c for c in COMMANDS if c[0] == "make"]


def _id(command: list[str]) -> str:
    return " ".join(command)[:90]


def _target(command: list[str]) -> tuple[str, str, list[str]]:
    """("module" | "script", the module or script, its arguments) of a python command."""
    if command[1] == "-m":
        return "module", command[2], command[3:]
    return "script", command[1], command[2:]


def _parse(kind: str, target: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PARSE_WITH_OWN_PARSER, kind, target, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def _last_line(stderr: str) -> str:
    """argparse's error (or a traceback's exception), without the usage text above it."""
    return (stderr.strip().splitlines() or ["(no output)"])[-1]


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M))


def _make_variables() -> set[str]:
    return set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*[?:]?=", (ROOT / "Makefile").read_text(), re.M))


def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, re.M))


def _server_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return set(parser._option_string_actions)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    heading = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", _text_outside_code(path.read_text()), re.M)}


# --- the commands ---------------------------------------------------------------------------


def test_readme_shows_the_two_commands_and_the_sdk_example():
    assert ["make", "serve"] in COMMANDS and ["make", "test"] in COMMANDS
    assert "from openai import OpenAI" in _blocks(README_TEXT, ("python",))[0]


def test_every_shell_command_is_of_a_kind_this_test_checks():
    known = ("make", "pip", *INTERPRETERS)
    assert [c for c in COMMANDS if c[0] not in known] == []


@pytest.mark.parametrize("command", MAKE_COMMANDS, ids=_id)
def test_make_commands_name_targets_and_variables_the_makefile_has(command):
    targets = [a for a in command[1:] if "=" not in a]
    assigned = [a.split("=", 1)[0] for a in command[1:] if "=" in a]
    assert targets and set(targets) <= _make_targets(), targets
    assert set(assigned) <= _make_variables(), assigned


def test_serve_args_in_make_commands_are_launch_server_flags():
    serve_args = [a.split("=", 1)[1] for c in MAKE_COMMANDS for a in c
                  if a.startswith("SERVE_ARGS=")]
    assert serve_args, "the README shows how to pass flags to make serve"
    for args in serve_args:
        result = _parse("module", "xlaserve.launch_server", shlex.split(args))
        assert result.returncode == 0, _last_line(result.stderr)


@pytest.mark.parametrize("command", PYTHON_COMMANDS, ids=_id)
def test_python_commands_name_a_real_module_or_script_and_real_flags(command):
    kind, target, args = _target(command)
    if kind == "module":
        assert target.startswith("xlaserve."), f"{target}: add it to EXTERNAL_MODULES if meant"
        assert importlib.util.find_spec(target) is not None, target
    else:
        assert (ROOT / target).is_file(), target
    result = _parse(kind, target, args)
    assert result.returncode == 0, _last_line(result.stderr)


@pytest.mark.parametrize("target", sorted({_target(c)[:2] for c in PYTHON_COMMANDS}),
                         ids=lambda t: t[1])
def test_every_command_the_readme_shows_answers_help(target):
    kind, name = target
    argv = ["-m", name] if kind == "module" else [name]
    result = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage:"), _last_line(result.stderr)


def test_launch_server_help_runs_as_the_readme_shows_it():
    assert [".venv/bin/python", "-m", "xlaserve.launch_server", "--help"] in COMMANDS
    result = subprocess.run([sys.executable, "-m", "xlaserve.launch_server", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "--model-path" in result.stdout and "--debug-step-hash-interval" in result.stdout


def test_pytest_commands_name_test_files_that_exist():
    runs = [c[3:] for c in COMMANDS if c[0] in INTERPRETERS and c[1:3] == ["-m", "pytest"]]
    assert runs
    for args in runs:
        paths = [a for a in args if not a.startswith("-")]
        assert paths and all((ROOT / p).exists() for p in paths), args


def test_pip_installs_name_extras_pyproject_defines():
    installs = [c[c.index("install") + 1:] for c in COMMANDS if "pip" in c[:3] and "install" in c]
    requested = {extra for args in installs for arg in args if arg.startswith(".[")
                 for extra in arg[2:-1].split(",")}
    assert {"tpu", "cuda", "bench"} <= requested and requested <= _extras(), requested
    named_in_text = set(re.findall(r"'\.\[([\w-]+)\]'", README_TEXT))  # ('.[cuda12]' ...)
    assert named_in_text <= _extras(), named_in_text - _extras()


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_xlaserve_modules_and_scripts_named_anywhere_exist(page):
    """Prose and docs/ too (the docs' commands are kept as they were run, so only what they
    name is checked, not their flags)."""
    text = page.read_text()
    modules = set(re.findall(r"python -m (xlaserve(?:\.\w+)+)", text))
    assert sorted(m for m in modules if importlib.util.find_spec(m) is None) == []
    scripts = {c[1] if c[0] in INTERPRETERS else c[0] for c in _commands(text, strict=False)
               if c[0] in INTERPRETERS and c[1] != "-m" or c[0].endswith(".sh")}
    assert sorted(s for s in scripts if not (ROOT / s).is_file()) == []


# --- flags named in the text ----------------------------------------------------------------


def test_the_flags_table_lists_only_real_launch_server_flags():
    section = README_TEXT.split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]
    first_cells = [row.split("|")[1] for row in section.splitlines() if row.startswith("| `--")]
    flags = {f for cell in first_cells for f in re.findall(r"--[a-z][a-z0-9-]*", cell)}
    assert len(flags) >= 20
    assert flags <= _server_flags(), flags - _server_flags()


def test_flags_the_readme_names_in_its_text_are_launch_server_flags():
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", _text_outside_code(README_TEXT)))
    assert named - _server_flags() - {"--help", "--no-deps"} == set()  # --no-deps: pip's


# --- python examples ------------------------------------------------------------------------


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_python_examples_compile(page):
    for number, source in enumerate(_blocks(page.read_text(), ("python",))):
        compile(source, f"{page.name}: python block {number}", "exec")


# --- links and paths ------------------------------------------------------------------------


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_links_lead_to_files_and_headings_that_exist(page):
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", _text_outside_code(page.read_text())):
        if re.match(r"[a-z]+:", link):
            continue  # a web address
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists() or (anchor and target.suffix == ".md"
                                   and anchor not in _anchors(target)):
            broken.append(link)
    assert broken == []


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_repository_paths_in_the_text_exist(page):
    text = page.read_text()
    paths = set(re.findall(r"(?<![\w./-])((?:benchmarks|docs|tests|xlaserve)/[\w./-]*[\w/])", text))
    assert paths, page
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []


def test_readme_links_every_page_in_docs():
    links = re.findall(r"\]\((docs/[^)#\s]+)", README_TEXT)
    linked = {(README.parent / link).resolve() for link in links}
    assert set(DOCS) <= linked, set(DOCS) - linked


def test_readme_is_a_front_page_not_a_diary():
    assert len(README_TEXT.splitlines()) < MAX_README_LINES
