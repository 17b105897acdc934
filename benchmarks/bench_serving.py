"""Serving benchmark in the spirit of `sglang.bench_serving`: random prompts of given input and
output lengths sent to an OpenAI-compatible `/v1/completions` (streamed), at a request rate
and/or a maximum concurrency, after a warm-up; prints request throughput, output tok/s, and
TTFT / ITL / end-to-end latency mean, median and p99.

    # against any running server
    .venv/bin/python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --max-concurrency 16
    # side by side: start each server in turn on the same weights, same workload, one table
    .venv/bin/python benchmarks/bench_serving.py --launch xlaserve,llama.cpp --max-concurrency 16
    # a real model's shapes with random weights (configs in benchmarks/configs)
    .venv/bin/python benchmarks/bench_serving.py --launch xlaserve --max-concurrency 16 \\
        --model-path benchmarks/configs/qwen2.5-0.5b --load-format dummy

Prompts are random token ids of the default model's vocabulary, decoded to text (every server
tokenizes them itself, so lengths match within a few tokens). End-of-text tokens are banned with
`logit_bias`, which llama.cpp's server honours too, so every request generates all its tokens.
A model without tokenizer files (the configs in benchmarks/configs) is served with
--skip-tokenizer-init: prompts stay token ids, sent to SGLang's native /generate as `input_ids`
with `ignore_eos`, and its stream's `output_ids` are counted.
`--launch llama.cpp` runs llama-cpp-python's server (`pip install 'llama-cpp-python[server]'`) on
an F32 GGUF of the very weights xlaserve serves (see peers.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import httpx
import numpy as np

import model_options

BANNED = {"0": -100, "2": -100}  # <|endoftext|>, <|im_end|> of the default model


def make_prompts(num: int, input_len: tuple[int, int], seed: int,
                 vocabulary: model_options.Vocabulary) -> list[str] | list[list[int]]:
    """Random token ids, decoded to text when the model has a tokenizer."""
    rng = random.Random(seed)
    id_lists = [[rng.choice(vocabulary.allowed_ids) for _ in range(rng.randint(*input_len))]
                for _ in range(num)]
    if vocabulary.tokenizer is None:
        return id_lists
    return [vocabulary.tokenizer.decode(ids) for ids in id_lists]


def request_body(model: str, prompt: str | list[int], output_len: int,
                 logit_bias: dict) -> tuple[str, dict]:
    """(route, body): text to /v1/completions, token ids to /generate (no tokenizer needed)."""
    if isinstance(prompt, str):
        return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": output_len,
                                   "temperature": 0.0, "stream": True, "logit_bias": logit_bias}
    return "/generate", {"input_ids": prompt, "stream": True, "sampling_params": {
        "max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}}


def new_tokens(chunk: dict, seen: int) -> int:
    """Tokens a stream event adds: /generate's events hold every output id so far; a
    /v1/completions chunk with text counts as one."""
    if "output_ids" in chunk:
        return len(chunk["output_ids"]) - seen
    return int(bool(chunk.get("choices") and chunk["choices"][0].get("text")))


async def one_request(http: httpx.AsyncClient, model: str, prompt: str | list[int],
                      output_len: int, logit_bias: dict = BANNED) -> dict:
    route, body = request_body(model, prompt, output_len, logit_bias)
    start = time.perf_counter()
    token_times, tokens = [], 0
    async with http.stream("POST", route, json=body) as response:
        if response.status_code != 200:
            return {"ok": False, "error": (await response.aread()).decode()[:300]}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            added = new_tokens(json.loads(line[6:]), tokens)
            if added > 0:
                token_times.append(time.perf_counter())
                tokens += added
    end = time.perf_counter()
    if not token_times:
        return {"ok": False, "error": "no tokens"}
    itl = np.diff(token_times).tolist()
    return {"ok": True, "ttft": token_times[0] - start, "itl": itl, "e2e": end - start,
            "output_tokens": tokens}


async def run_load(base_url: str, model: str, prompts: list, output_len: int,
                   max_concurrency: int | None, request_rate: float, seed: int,
                   logit_bias: dict = BANNED) -> dict:
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts))
    semaphore = asyncio.Semaphore(max_concurrency or len(prompts))
    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as http:
        await one_request(http, model, prompts[0], min(output_len, 8), logit_bias)  # warm-up

        async def limited(prompt):
            async with semaphore:
                return await one_request(http, model, prompt, output_len, logit_bias)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration)


def summarize(results: list[dict], duration: float) -> dict:
    done = [r for r in results if r["ok"]]
    if not done:
        raise RuntimeError(f"every request failed, e.g. {results[0].get('error')}")
    ttft = np.array([r["ttft"] for r in done]) * 1000
    itl = np.array([x for r in done for x in r["itl"]] or [0.0]) * 1000
    e2e = np.array([r["e2e"] for r in done])
    output_tokens = sum(r["output_tokens"] for r in done)
    stats = {"completed": len(done), "failed": len(results) - len(done), "duration_s": round(duration, 2),
             "request_throughput": round(len(done) / duration, 3),
             "output_tok_s": round(output_tokens / duration, 1)}
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl), ("e2e_s", e2e)):
        stats[f"mean_{name}"] = round(float(values.mean()), 2)
        stats[f"median_{name}"] = round(float(np.median(values)), 2)
        stats[f"p99_{name}"] = round(float(np.percentile(values, 99)), 2)
    return stats


# --- launching servers side by side ------------------------------------------------------------

def launch(kind: str, port: int, args: argparse.Namespace, model_flags: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if kind == "xlaserve":
        command = [sys.executable, "-m", "xlaserve.launch_server", "--port", str(port),
                   "--max-running-requests", str(args.max_concurrency or 64),
                   *model_flags, *args.xlaserve_arg]
    elif kind == "llama.cpp":
        from peers import f32_gguf

        command = [sys.executable, "-m", "llama_cpp.server", "--model", f32_gguf(), "--port", str(port),
                   "--n_ctx", "2048", "--n_threads", str(os.cpu_count()),
                   "--interrupt_requests", "False"]  # else a new request cuts the running one off
    else:
        raise ValueError(f"unknown server {kind!r}: xlaserve or llama.cpp")
    log = open(os.path.join(args.log_dir, f"{kind}.log"), "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{kind} exited; see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200 and (
                    kind != "xlaserve" or httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200):
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.kill()
    raise TimeoutError(f"{kind} did not start; see {log.name}")


def _model_flags(engine_model_args: dict) -> list[str]:
    """launch_server flags for model_options.engine_model_args (only those not at defaults)."""
    flags = []
    if engine_model_args["model_path"]:
        flags += ["--model-path", engine_model_args["model_path"]]
    if engine_model_args["load_format"] != "auto":
        flags += ["--load-format", engine_model_args["load_format"]]
    if engine_model_args["skip_tokenizer_init"]:
        flags.append("--skip-tokenizer-init")
    return flags


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running OpenAI-compatible server")
    parser.add_argument("--launch", help="comma-separated servers to start in turn: xlaserve, llama.cpp")
    parser.add_argument("--model", default="default", help="the model name to send")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="32-64", help="prompt length range in tokens, 'lo-hi'")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=30100, help="port for --launch")
    parser.add_argument("--xlaserve-arg", action="append", default=[], help="extra launch_server flag")
    parser.add_argument("--log-dir", default="/tmp", help="server logs for --launch")
    parser.add_argument("--json", action="store_true")
    model_options.add_model_args(parser)  # with --base-url: the model the server runs
    args = parser.parse_args(argv)
    if bool(args.base_url) == bool(args.launch):
        parser.error("give --base-url or --launch")
    custom_model = args.model_path or args.load_format != "auto"
    if custom_model and "llama.cpp" in (args.launch or ""):
        parser.error("llama.cpp runs the embedded model only: --launch xlaserve with --model-path "
                     "or --load-format dummy")
    vocabulary = model_options.model_vocabulary(args.model_path, args.load_format)
    # The default model's end-of-text ids are not another model's.
    logit_bias = {str(i): -100 for i in vocabulary.stop_ids} if custom_model else BANNED
    model_flags = _model_flags(model_options.engine_model_args(args, vocabulary))
    lo, hi = (int(x) for x in args.input_len.split("-"))
    prompts = make_prompts(args.num_prompts, (lo, hi), args.seed, vocabulary)
    workload = {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len",
                                              "max_concurrency", "request_rate", "model_path",
                                              "load_format")}
    print(f"workload: {workload}", file=sys.stderr)
    results = {}
    targets = [("server", args.base_url, None)] if args.base_url else [
        (kind, f"http://127.0.0.1:{args.port}", kind) for kind in args.launch.split(",")]
    for name, url, kind in targets:
        process = launch(kind, args.port, args, model_flags) if kind else None
        try:
            results[name] = asyncio.run(run_load(url, args.model, prompts, args.output_len,
                                                 args.max_concurrency, args.request_rate, args.seed,
                                                 logit_bias))
        finally:
            if process is not None:
                process.terminate()
                process.wait(timeout=60)
        print(f"{name}: {results[name]}", file=sys.stderr)
    if args.json:
        print(json.dumps({"workload": workload, **results}))
        return
    columns = ["request_throughput", "output_tok_s", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
               "mean_itl_ms", "median_itl_ms", "p99_itl_ms"]
    print(f"\n{'':<12}" + "".join(f"{c:>17}" for c in columns))
    for name, stats in results.items():
        print(f"{name:<12}" + "".join(f"{stats[c]:>17}" for c in columns))


if __name__ == "__main__":
    main()
