#!/usr/bin/env bash
# Serving throughput of an earlier commit against the working tree, side by side: both servers run
# at once (the earlier one from a git worktree, on the same .venv), and bench_serving.py's rounds
# alternate between them, the order swapped every round, the prefix cache flushed before each.
#
#   benchmarks/compare_commits.sh 80180db [rounds] [extra bench_serving.py flags...]
#
# Prints one line per round and server: output tok/s, median ITL (ms), median TTFT (ms).
set -euo pipefail
old_rev=${1:?usage: compare_commits.sh OLD_REV [ROUNDS] [bench_serving flags...]}
rounds=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
old_tree=$(mktemp -d /tmp/xlaserve-$old_rev-XXXX)
git -C "$root" worktree add -f --detach "$old_tree" "$old_rev" -q
declare -A tree=([old]=$old_tree [new]=$root) port=([old]=31001 [new]=31002)
cleanup() {
  pkill -f "xlaserve.launch_server --port 3100[12]" || true
  git -C "$root" worktree remove --force "$old_tree" || true
}
trap cleanup EXIT
for name in old new; do
  (cd "${tree[$name]}" && PYTHONPATH="${tree[$name]}" "$py" -m xlaserve.launch_server \
     --port "${port[$name]}" --log-level warning > "/tmp/compare-$name.log" 2>&1 &)
done
for name in old new; do
  until curl -sf "http://127.0.0.1:${port[$name]}/health" > /dev/null; do sleep 2; done
done
for round in $(seq "$rounds"); do
  order="old new"; (( round % 2 == 0 )) && order="new old"
  for name in $order; do
    url=http://127.0.0.1:${port[$name]}
    curl -sf -X POST "$url/flush_cache" > /dev/null
    "$py" "$root/benchmarks/bench_serving.py" --base-url "$url" --max-concurrency 16 \
        --num-prompts 64 --json "$@" 2>/dev/null | tail -1 | "$py" -c "
import json, sys
r = json.loads(sys.stdin.read())['server']
print('round $round', '$name ($old_rev)' if '$name' == 'old' else 'new (working tree)',
      r['output_tok_s'], 'tok/s, ITL median', r['median_itl_ms'], 'ms, TTFT median', r['median_ttft_ms'], 'ms')"
  done
done
