#!/usr/bin/env bash
# `make test`: the whole suite on the one JAX the project runs on, in a few pytest processes one
# after the other, then the 15 slowest tests of them all (tests/slowest.py), the wall time and the
# machine, for docs/testing.md's table.
#
# Several processes, not one: every compiled CPU program holds memory mappings (its JIT code), and
# one process running the whole suite on JAX 0.11 reached the kernel's limit of 65,530
# (vm.max_map_count) near the end of tests/http and died inside XLA (SIGSEGV or abort, 2026-11-28).
# Outside tests/http they were garbage in reference cycles (tests/conftest.py collects them); what
# keeps the HTTP tests' alive is not yet found (docs/testing.md). The parts run one after the
# other, each in a few workers (below).
#
# From the Makefile: PY (the venv's python), PYTEST_ARGS (pytest options, such as --slow or -x).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
# The JUnit files of the last run stay in .pytest_cache/make-test/ (ignored by git) for
# `python tests/slowest.py --files 40 .pytest_cache/make-test/part*.xml`: the minutes by file.
results=.pytest_cache/make-test
rm -rf "$results" && mkdir -p "$results"

# Each part: "workers|paths". Two pytest workers (pytest-xdist, a file to a worker, the longest
# folders first so that the many short files of the last ones fill the end) run a part's files
# side by side: the real-size compiles (TPU and H100, XLA's compilers on one thread) keep ~1 core
# busy, so two fill a 2-core machine (tests/kernels to tests/weights: 607 s in one process, 487 s
# in two workers; tests/executor to tests/engine and the top-level tests: 1223 s, 938 s;
# 2026-11-28, Zen 4). Every folder but tests/http is one part: apart, each part's end left a
# worker idle behind the other's last file, and each paid its workers' start. The HTTP tests that
# time something (/health answering while a 30 MB prompt is refused, shutdown and cancel
# deadlines, the fuzzers' per-answer bound) need the machine to themselves: one worker, last.
# (test_batch_durability.py is not one of them: a slower server only widens its window to kill a
# batch in progress, and its deadlines are 120 s.)
WORKERS=${XLASERVE_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
TIMED_HTTP="test_batches test_event_loop test_exposure test_fuzz test_fuzz_found test_shutdown test_structured_outputs"
timed=() untimed=()
for file in tests/http/test_*.py; do
  name=$(basename "$file" .py)
  if [[ " $TIMED_HTTP " == *" $name "* ]]; then timed+=("$file"); else untimed+=("$file"); fi
done
GROUPS_OF_TESTS=(
  "$WORKERS|$(echo tests/test_*.py) tests/executor tests/distributed tests/engine tests/kernels tests/model tests/lora tests/vision tests/embeddings tests/sampling tests/weights tests/scheduler"
  "$WORKERS|${untimed[*]}"
  "1|${timed[*]}"
)
status=0
summary=""
for i in "${!GROUPS_OF_TESTS[@]}"; do
  workers=${GROUPS_OF_TESTS[$i]%%|*}
  group=${GROUPS_OF_TESTS[$i]#*|}
  parallel=()
  [ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
  group_start=$SECONDS
  echo "---------------- make test, part $((i + 1)) of ${#GROUPS_OF_TESTS[@]} ($workers worker(s)): ${group:0:90} ----------------"
  # --durations-min=1e9 hides each part's own list (pyproject's addopts ask for one): the list of
  # all parts comes after the last.
  # shellcheck disable=SC2086  # the group and PYTEST_ARGS are lists
  "$PY" -m pytest -q "${parallel[@]}" --durations=0 --durations-min=1e9 --junitxml="$results/part$i.xml" $group $PYTEST_ARGS
  code=$?
  # 5: no tests collected (a -k or -m that selects none of this part)
  [ "$code" -ne 0 ] && [ "$code" -ne 5 ] && status=1
  summary+="  part $((i + 1)): exit $code, $(( SECONDS - group_start )) s"$'\n'
done

echo "---------------- the 15 slowest tests (setup + call + teardown) ----------------"
"$PY" tests/slowest.py 15 "$results"/part*.xml
cpu=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')
versions=$("$PY" -c 'import sys, jax; print(f"Python {sys.version.split()[0]}, JAX {jax.__version__}")')
printf "%s" "$summary"
echo "make test: exit $status, wall $(awk -v s=$((SECONDS - start)) 'BEGIN { printf "%.1f min", s / 60 }')" \
     "($versions; ${cpu:-unknown CPU}, $(nproc) cores)"
exit "$status"
