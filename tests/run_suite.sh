#!/usr/bin/env bash
# `make test`: the whole suite in one pytest on the one JAX the project runs on (pyproject's
# addopts list the 15 slowest tests), then its wall time and the machine, for docs/testing.md's
# table. One pytest already keeps ~1.25 of a 2-core machine's cores busy (XLA's thread pool, the
# servers' threads), and tests/http holds timing checks (/health answering while a 30 MB prompt
# is refused, shutdown deadlines) that need the machine to themselves: no xdist.
#
# From the Makefile: PY (the venv's python), PYTEST_ARGS (pytest options, such as --slow or -x).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

# shellcheck disable=SC2086  # PYTEST_ARGS is a list of options
"$PY" -m pytest -q $PYTEST_ARGS
suite=$?

cpu=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')
versions=$("$PY" -c 'import sys, jax; print(f"Python {sys.version.split()[0]}, JAX {jax.__version__}")')
echo "make test: exit $suite, wall $(awk -v s=$((SECONDS - start)) 'BEGIN { printf "%.1f min", s / 60 }')" \
     "($versions; ${cpu:-unknown CPU}, $(nproc) cores)"
exit "$suite"
