"""The slowest tests of a `make test` run, from the JUnit XML files of its pytest processes
(tests/run_suite.sh keeps the last run's in .pytest_cache/make-test/): each test's setup, call and
teardown summed, as pytest's --durations would list them across the processes; with --files, the
seconds of each test file summed (where the minutes go, for docs/testing.md's table).

    python tests/slowest.py [--files] N FILE.xml [FILE.xml ...]
"""
import collections
import sys
from xml.etree import ElementTree


def test_times(paths: list[str]) -> list[tuple[float, str]]:
    times = []
    for path in paths:
        try:
            root = ElementTree.parse(path).getroot()
        except (OSError, ElementTree.ParseError):  # a process that died writes none
            continue
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            times.append((float(case.get("time") or 0), name))
    return times


def slowest(paths: list[str], count: int) -> list[tuple[float, str]]:
    return sorted(test_times(paths), reverse=True)[:count]


def slowest_files(paths: list[str], count: int) -> list[tuple[float, str]]:
    per_file: collections.Counter = collections.Counter()
    for seconds, name in test_times(paths):
        per_file[name.split("::")[0]] += seconds
    return [(seconds, name) for name, seconds in per_file.most_common(count)]


if __name__ == "__main__":
    args = sys.argv[1:]
    by_file = args[:1] == ["--files"]
    if by_file:
        args = args[1:]
    for seconds, name in (slowest_files if by_file else slowest)(args[1:], int(args[0])):
        print(f"{seconds:8.2f}s  {name}")
