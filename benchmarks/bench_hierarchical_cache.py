"""The prefix cache's host tier (--enable-hierarchical-cache) on a multi-turn chat workload whose
shared prefixes outgrow the device KV pool: prefix hit rate and time to first token with and
without the tier, side by side in one run, on the embedded default model (SmolLM2-135M) through
the offline Engine.

    .venv/bin/python benchmarks/bench_hierarchical_cache.py [--conversations 16] [--turns 4]

The workload: `--systems` long system prompts (~`--system-tokens` each), each shared by
`--conversations` / `--systems` conversations; each turn adds a user message and an assistant
reply (fixed text, so both runs see the same prompts) to its conversation's history. Turns go
round-robin across conversations (every conversation's first turn, then every second...), one
request at a time, so a request's time is its time to first token (a prefill and one token,
`max_new_tokens` 1). The device pool (`--max-total-tokens`) holds about two system prompts; the
working set is every system prompt and history. Hit rate: cached prompt tokens / prompt tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fp8_kv_quality import TEXT  # noqa: E402
from xlaserve.offline import Engine  # noqa: E402

WORDS = TEXT.split()


def system_prompt(index: int, tokens: int) -> str:
    words = WORDS[index * 7:] + WORDS[:index * 7]  # each a rotation: no shared prefix
    text = f"System {index}: you are assistant number {index}. "
    while len(text.split()) < tokens * 3 // 4:
        text += " ".join(words) + " "
    return text


def workload(systems: int, system_tokens: int, conversations: int, turns: int):
    """The requests' texts in order: (conversation, turn, prompt text)."""
    histories = [system_prompt(c % systems, system_tokens) for c in range(conversations)]
    order = []
    for turn in range(turns):
        for c in range(conversations):
            histories[c] += f"\nUser: question {turn} of conversation {c}: what happens next?"
            order.append((c, turn, histories[c] + "\nAssistant:"))
            histories[c] += (f"\nAssistant: in turn {turn} the keepers wrote the weather down "
                             "twice a day, and the library keeps the books.")
    return order


def run(order, tier: bool, max_total_tokens: int, hicache_ratio: float) -> dict:
    options = dict(max_total_tokens=max_total_tokens, quantized_activations="float32",
                   max_running_requests=1, log_level="warning")
    if tier:
        options.update(enable_hierarchical_cache=True, hicache_ratio=hicache_ratio)
    with Engine(None, **options) as engine:
        ids = [engine.tokenizer.encode(text) for _, _, text in order]
        engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})  # warm
        times, cached, prompt = [], 0, 0
        for prompt_ids in ids:
            start = time.perf_counter()
            out = engine.generate(input_ids=prompt_ids,
                                  sampling_params={"max_new_tokens": 1, "temperature": 0})
            times.append(time.perf_counter() - start)
            cached += out["meta_info"]["cached_tokens"]
            prompt += len(prompt_ids)
        host = engine.core.scheduler.cache.host
        return {"tier": tier, "hit_rate": cached / prompt, "prompt_tokens": prompt,
                "ttft_mean_ms": statistics.mean(times) * 1e3,
                "ttft_p50_ms": statistics.median(times) * 1e3,
                "ttft_p90_ms": statistics.quantiles(times, n=10)[-1] * 1e3,
                "total_s": sum(times),
                "host_pages_saved": host.saved_pages if host else 0,
                "host_pages_loaded": host.loaded_pages if host else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=600)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-total-tokens", type=int, default=1536)
    parser.add_argument("--hicache-ratio", type=float, default=8.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    order = workload(args.systems, args.system_tokens, args.conversations, args.turns)
    rows = [run(order, tier, args.max_total_tokens, args.hicache_ratio) for tier in (False, True)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{len(order)} requests ({args.conversations} conversations x {args.turns} turns, "
          f"{args.systems} system prompts of ~{args.system_tokens} tokens), device pool "
          f"{args.max_total_tokens} tokens, host tier {args.hicache_ratio:g}x; "
          f"{rows[0]['prompt_tokens']} prompt tokens in all")
    print("| host tier | prefix hit rate | TTFT mean / p50 / p90 (ms) | total (s) | pages saved / "
          "loaded |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {'on' if r['tier'] else 'off'} | {r['hit_rate']:.1%} | "
              f"{r['ttft_mean_ms']:.0f} / {r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} | "
              f"{r['total_s']:.1f} | {r['host_pages_saved']} / {r['host_pages_loaded']} |")
    print(f"TTFT ratio (tier on / off, mean): {rows[1]['ttft_mean_ms'] / rows[0]['ttft_mean_ms']:.2f}")


if __name__ == "__main__":
    main()
