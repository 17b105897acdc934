"""A multi-turn chat on a hybrid linear-attention model with and without the prefix cache (issue
76: its state snapshots, runtime/scheduler/state_reuse.py): each turn's prompt is the last one, its
answer and a new message; reported per turn, the prompt's tokens, those the cache served, and the
time to the first token with the cache on and off (two engines side by side in one process, turns
alternating; the answers are checked equal). Dummy weights of bench_hybrid_decode.py's hybrid,
float32 by default: in bfloat16 a prompt run from a snapshot is chunked otherwise than one run
whole, and with random weights the rounding alone turned a greedy answer by the third turn.

    .venv/bin/python benchmarks/bench_hybrid_prefix.py --system-tokens 256 --turns 4
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_hybrid_decode import MODELS  # noqa: E402
from xlaserve.offline import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--message-tokens", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(MODELS["hybrid"]))
        common = dict(load_format="dummy", dtype=args.dtype, skip_tokenizer_init=True,
                      max_running_requests=4, context_length=8192, max_total_tokens=32768,
                      chunked_prefill_size=512, max_prefill_tokens=512, skip_server_warmup=True)
        engines = {"cache": Engine(directory, **common),
                   "no cache": Engine(directory, disable_radix_cache=True, **common)}
        greedy = {"temperature": 0, "ignore_eos": True}
        prompt = [(7 * i) % 30000 + 1 for i in range(args.system_tokens)]
        print(f"hybrid of bench_hybrid_decode.py, {args.dtype}, dummy weights; a chat of "
              f"{args.turns} turns, {args.system_tokens} system tokens, {args.message_tokens}-token "
              f"messages, {args.answer_tokens}-token answers")
        for turn in range(args.turns):
            prompt = prompt + [(11 * i + turn) % 30000 + 1 for i in range(args.message_tokens)]
            first, answers = {}, {}
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.generate(input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 1})
                first[name] = time.perf_counter() - start
                # The turn's answer (and the snapshot the next turn reuses): a request of its own.
                out = engine.generate(input_ids=prompt,
                                      sampling_params={**greedy,
                                                       "max_new_tokens": args.answer_tokens})
                answers[name] = (out["output_ids"], out["meta_info"]["cached_tokens"])
            if answers["cache"][0] != answers["no cache"][0]:
                raise SystemExit(f"turn {turn}: the answers differ with and without the cache")
            cached = answers["cache"][1]
            print(f"  turn {turn}: prompt {len(prompt):5d} tokens, cached {cached:5d} "
                  f"({cached / len(prompt):5.1%}); first token {first['cache'] * 1e3:8.1f} ms with "
                  f"the cache, {first['no cache'] * 1e3:8.1f} ms without "
                  f"(x{first['no cache'] / first['cache']:.2f})")
            prompt = prompt + answers["cache"][0]
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
