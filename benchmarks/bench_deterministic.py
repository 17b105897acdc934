"""The cost of --enable-deterministic-inference on this machine (the CPU; a TPU or GPU where one
runs it): the same engine with and without it, side by side in one process (runs alternate,
medians reported), on a model's config with dummy weights: time to first token of one long
prompt, and decode throughput at 1 and 16 requests.

    .venv/bin/python benchmarks/bench_deterministic.py --model-path benchmarks/configs/smollm2-135m
"""
from __future__ import annotations

import argparse
import statistics
import time

from xlaserve.offline import Engine


def _timed(engine, prompts, new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default="benchmarks/configs/smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    common = dict(load_format="dummy", dtype=args.dtype, skip_tokenizer_init=True,
                  max_running_requests=16, context_length=1024, max_total_tokens=16 * 1024,
                  chunked_prefill_size=512, max_prefill_tokens=512, skip_server_warmup=True,
                  disable_radix_cache=True)  # every run computes its prompt
    engines = {"default": Engine(args.model_path, **common),
               "deterministic": Engine(args.model_path, enable_deterministic_inference=True,
                                       **common)}
    long_prompt = [[(7 * i) % 1000 + 1 for i in range(500)]]
    short = [[(3 * i + r) % 1000 + 1 for i in range(32)] for r in range(16)]
    work = {"first token, 500-token prompt (s)": (long_prompt, 1),
            "decode, 1 request x 64 tokens (tokens/s)": (short[:1], 64),
            "decode, 16 requests x 64 tokens (tokens/s)": (short, 64)}
    times: dict = {(w, e): [] for w in work for e in engines}
    for _ in range(args.repeats):
        for name, (prompts, new) in work.items():
            for label, engine in engines.items():
                times[(name, label)].append(_timed(engine, prompts, new))
    print(f"{args.model_path}, {args.dtype}, dummy weights; medians of {args.repeats}")
    for name, (prompts, new) in work.items():
        default, invariant = (statistics.median(times[(name, e)]) for e in engines)
        if "tokens/s" in name:
            default, invariant = (len(prompts) * new / default, len(prompts) * new / invariant)
        print(f"  {name:45s} default {default:8.3f}  deterministic {invariant:8.3f}  "
              f"ratio {invariant / default:.3f}")
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
