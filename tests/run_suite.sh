#!/usr/bin/env bash
# `make test`: the whole suite on JAX 0.10 and what depends on JAX's version on JAX 0.11 (make
# test-jax011, in .venv-jax011, installed here on its first run), side by side, then the HTTP tests
# alone. One pytest keeps ~1.25 of a 2-core machine's cores busy (XLA's thread pool, the servers'
# threads), so two at once finish sooner than one after the other; the HTTP tests hold the
# timing checks (/health answering while a 30 MB prompt is refused, shutdown deadlines), which
# run with the machine to themselves. Figures: docs/testing.md.
#
# From the Makefile: PY (the JAX 0.10 venv's python), PYTHON312, PYTEST_ARGS (pytest options, such
# as --slow or -x, given to every run).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
minutes() { awk -v s="$1" 'BEGIN { printf "%.1f min", s / 60 }'; }

jax011_log=$(mktemp -t xlaserve-jax011-XXXXXX.log)
jax011_pid=""
if "$PYTHON312" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
  echo "JAX 0.11 (make test-jax011) runs beside the JAX 0.10 suite; its output follows that suite's"
  make --no-print-directory test-jax011 >"$jax011_log" 2>&1 &
  jax011_pid=$!
else
  echo "No Python 3.12 ($PYTHON312): the JAX 0.11 suite (make test-jax011) did not run"
fi

# shellcheck disable=SC2086  # PYTEST_ARGS is a list of options
"$PY" -m pytest -q --ignore=tests/http $PYTEST_ARGS
suite=$?
suite_time=$((SECONDS - start))

jax011=0
jax011_time=0
if [ -n "$jax011_pid" ]; then
  wait "$jax011_pid"
  jax011=$?
  jax011_time=$((SECONDS - start))  # from the start: it ran beside the JAX 0.10 suite
  echo "---------------- JAX 0.11: make test-jax011 (exit $jax011) ----------------"
  cat "$jax011_log"
fi
rm -f "$jax011_log"

echo "---------------- JAX 0.10: tests/http, alone ----------------"
http_start=$SECONDS
# shellcheck disable=SC2086
"$PY" -m pytest -q tests/http $PYTEST_ARGS
http=$?
http_time=$((SECONDS - http_start))

echo "make test: JAX 0.10 suite exit $suite ($(minutes $suite_time)), JAX 0.11 exit $jax011" \
     "(ended at $(minutes $jax011_time)), HTTP exit $http ($(minutes $http_time));" \
     "wall $(minutes $((SECONDS - start)))"
[ "$suite" -eq 0 ] && [ "$jax011" -eq 0 ] && [ "$http" -eq 0 ]
