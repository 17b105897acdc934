"""Batch API throughput against the live endpoint: the same N `/v1/completions` requests run once
as a batch (upload the JSONL, create, poll to `completed`, read the output file) and once sent
all at once to the live endpoint; prints output tok/s for each and their ratio.

    # against a running server
    .venv/bin/python benchmarks/bench_batch.py --base-url http://127.0.0.1:30000 --num-requests 1000
    # start xlaserve on the default model (its own storage folder), run, stop it
    .venv/bin/python benchmarks/bench_batch.py --launch --num-requests 1000

Prompts are random token ids decoded to text (bench_serving.make_prompts); greedy, end-of-text
tokens banned, so both runs generate exactly the same tokens. A batch runs below interactive
requests with `--batch-concurrency` lines in flight; the live run has every request in flight.
The prefix cache is flushed before each run (the second would otherwise find every prompt
cached); `--rounds 2` runs batch, live, live, batch and reports the best of each.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time

import httpx

from bench_serving import BANNED, launch, make_prompts


def bodies(args) -> list[dict]:
    lo, hi = (int(x) for x in args.input_len.split("-"))
    return [{"model": args.model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
             "logit_bias": BANNED} for prompt in make_prompts(args.num_requests, (lo, hi), args.seed)]


async def run_live(base_url: str, requests: list[dict]) -> dict:
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as http:
        start = time.perf_counter()
        responses = await asyncio.gather(*[http.post("/v1/completions", json=body) for body in requests])
        duration = time.perf_counter() - start
    failed = [r.text[:200] for r in responses if r.status_code != 200]
    if failed:
        raise RuntimeError(f"{len(failed)} live requests failed, e.g. {failed[0]}")
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in responses)
    return _stats(len(responses), tokens, duration)


def run_batch(base_url: str, requests: list[dict], poll_s: float = 0.1) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="EMPTY", max_retries=0, timeout=600)
    content = "".join(json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": "/v1/completions",
                                  "body": body}) + "\n" for i, body in enumerate(requests)).encode()
    start = time.perf_counter()
    uploaded = client.files.create(file=("bench.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                  completion_window="24h")
    while batch.status not in ("completed", "failed", "cancelled"):
        time.sleep(poll_s)
        batch = client.batches.retrieve(batch.id)
    duration = time.perf_counter() - start
    if batch.status != "completed" or batch.request_counts.failed:
        raise RuntimeError(f"the batch ended {batch.status} with {batch.request_counts}: {batch.errors}")
    lines = client.files.content(batch.output_file_id).read().decode().splitlines()
    tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in lines)
    client.files.delete(batch.output_file_id)
    client.files.delete(uploaded.id)
    return _stats(len(lines), tokens, duration)


def _stats(num: int, tokens: int, duration: float) -> dict:
    return {"requests": num, "output_tokens": tokens, "duration_s": round(duration, 2),
            "output_tok_s": round(tokens / duration, 1)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running xlaserve server")
    parser.add_argument("--launch", action="store_true", help="start xlaserve on the default model")
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--input-len", default="32-64", help="prompt length range in tokens, 'lo-hi'")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each (best reported)")
    parser.add_argument("--port", type=int, default=30100, help="port for --launch")
    parser.add_argument("--xlaserve-arg", action="append", default=[], help="extra launch_server flag")
    parser.add_argument("--log-dir", default="/tmp", help="the server log for --launch")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if bool(args.base_url) == args.launch:
        parser.error("give --base-url or --launch")
    requests = bodies(args)
    process = None
    base_url = args.base_url
    if args.launch:
        args.max_concurrency = None  # launch(): --max-running-requests 64, the server default
        args.xlaserve_arg += ["--file-storage-path", tempfile.mkdtemp(prefix="bench-batch-")]
        process = launch("xlaserve", args.port, args)
        base_url = f"http://127.0.0.1:{args.port}"
    runs = {"batch": lambda: run_batch(base_url, requests),
             "live": lambda: asyncio.run(run_live(base_url, requests))}
    order = (["batch", "live", "live", "batch"] * args.rounds)[:2 * args.rounds]
    results = {}
    try:
        for name in order:
            httpx.post(base_url + "/flush_cache", timeout=60).raise_for_status()
            stats = runs[name]()
            print(f"{name}: {stats}", file=sys.stderr)
            if name not in results or stats["output_tok_s"] > results[name]["output_tok_s"]:
                results[name] = stats
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    ratio = results["batch"]["output_tok_s"] / results["live"]["output_tok_s"]
    if args.json:
        print(json.dumps({**results, "batch_over_live": round(ratio, 3)}))
        return
    print(f"\n{args.num_requests} requests, {args.input_len} prompt tokens, {args.output_len} output tokens")
    for name, stats in results.items():
        print(f"{name:<6} {stats['output_tok_s']:>10} output tok/s  ({stats['output_tokens']} tokens "
              f"in {stats['duration_s']} s)")
    print(f"batch / live: {ratio:.2f}x")


if __name__ == "__main__":
    main()
