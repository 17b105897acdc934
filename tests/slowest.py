"""The slowest tests of a `make test` run, from the JUnit XML files of its pytest processes
(tests/run_suite.sh): each test's setup, call and teardown summed, as pytest's --durations
would list them across the processes.

    python tests/slowest.py N FILE.xml [FILE.xml ...]
"""
import sys
from xml.etree import ElementTree


def slowest(paths: list[str], count: int) -> list[tuple[float, str]]:
    times = []
    for path in paths:
        try:
            root = ElementTree.parse(path).getroot()
        except (OSError, ElementTree.ParseError):  # a process that died writes none
            continue
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            times.append((float(case.get("time") or 0), name))
    return sorted(times, reverse=True)[:count]


if __name__ == "__main__":
    for seconds, name in slowest(sys.argv[2:], int(sys.argv[1])):
        print(f"{seconds:8.2f}s  {name}")
