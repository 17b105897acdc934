"""Serving benchmark in the spirit of `sglang.bench_serving`: random prompts of given input and
output lengths sent to an OpenAI-compatible `/v1/completions` (streamed), at a request rate
and/or a maximum concurrency, after a warm-up; prints request throughput, output tok/s, TTFT /
TPOT / ITL / end-to-end latency mean, median and p99, and a launched server's peak memory.

    # against any running server
    .venv/bin/python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --max-concurrency 16
    # side by side: start each server in turn on the same weights, same workload, one table
    .venv/bin/python benchmarks/bench_serving.py --launch xlaserve,llama.cpp --max-concurrency 16
    # against llama.cpp's C++ llama-server on the same Q8_0 GGUF, single stream then 64 concurrent
    .venv/bin/python benchmarks/bench_serving.py --launch xlaserve,llama-server --gguf Q8_0 \\
        --llama-server-bin /tmp/llamacpp/build/bin/llama-server --max-concurrency 1,64 \\
        --num-prompts 8,128
    # a real model's shapes with random weights (configs in benchmarks/configs)
    .venv/bin/python benchmarks/bench_serving.py --launch xlaserve --max-concurrency 16 \\
        --model-path benchmarks/configs/qwen2.5-0.5b --load-format dummy
    # structured outputs: the same prompts unconstrained, then each under a JSON schema, one server
    .venv/bin/python benchmarks/bench_serving.py --launch xlaserve --max-concurrency 16 \\
        --num-prompts 64 --json-schema benchmarks/schemas/long_records.json [--repeat 3]

Prompts are random token ids of the default model's vocabulary, decoded to text (every server
tokenizes them itself, so lengths match within a few tokens). End-of-text tokens are banned with
`logit_bias`, which llama.cpp's server honours too, so every request generates all its tokens.
A model without tokenizer files (the configs in benchmarks/configs) is served with
--skip-tokenizer-init: prompts stay token ids, sent to SGLang's native /generate as `input_ids`
with `ignore_eos`, and its stream's `output_ids` are counted.
`--launch llama.cpp` runs llama-cpp-python's server (`pip install 'llama-cpp-python[server]'`) on
an F32 GGUF of the very weights xlaserve serves (see peers.py). Output tokens are the server's
`usage.completion_tokens` where the stream reports it (xlaserve does, asked with
`stream_options`), else one per chunk with text.

`--launch llama-server` runs llama.cpp's C++ server (a build of your own, --llama-server-bin) with
`-np` = the largest --max-concurrency, continuous batching, a thread per core (or
--llama-server-threads), and no prompt cache in host RAM (`--cache-ram 0`: it would keep prompts'
KV states between passes, and count in the memory).
`--gguf F32|Q8_0|Q4_K_M` makes every launched server serve one file: the embedded model as an F32
GGUF, or quantized from it by the llama-quantize beside --llama-server-bin (peers.py; cached in
~/.cache/xlaserve/bench); xlaserve gets it as --model-path. With llama-server launched, both hold
the same KV capacity: its `-c` and xlaserve's --max-total-tokens are the largest --max-concurrency
x (2 x the longest prompt + --output-len) tokens (each llama-server slot gets 1/np of `-c`).
Several --max-concurrency values (`1,64`) are passes on the same launched server, each on prompts
of its own (--seed + its index, so no pass finds another's prompts cached), with --num-prompts
one value or one per pass. A launched server's row has its peak RSS during the pass
(`peak_rss_mib`: VmHWM of it and its children, reset before the pass; process_memory.py) and at
start-up (`startup_peak_rss_mib`, in --json).

Structured outputs: with `--json-schema FILE` each server gets, after a warm-up of both, two
passes over the same prompts: unconstrained (as above) and constrained, each request also
carrying the schema (SGLang's extra body key `json_schema`, a JSON string; on /generate
`sampling_params.json_schema`; a model without a tokenizer cannot be constrained). With
`--repeat K`, K rounds alternate which pass goes first, each row the median over its rounds. The
prefix cache is flushed (SGLang's POST /flush_cache) before each pass, as they share prompts.
It prints both rows and the ratio of their output tok/s. For a fair ratio the schema should not
fit in --output-len, so that constrained requests too run to max_tokens (finish "length"), with
the same end-of-text ban: benchmarks/schemas/long_records.json asks for 50+ records (2000+
tokens). The constrained row counts finish reasons, and the outputs that begin with "{" (0 would
mean the server ignored the schema).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx
import numpy as np

import model_options
import process_memory
from launch_servers import (LLAMA_KINDS, gguf_file, kv_tokens, launch, launch_flags,
                            llama_server_version)

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
                 logit_bias: dict, json_schema: str | None = None) -> tuple[str, dict]:
    """(route, body): text to /v1/completions, token ids to /generate (no tokenizer needed);
    `json_schema` (a JSON string) constrains the output (SGLang's key on both routes)."""
    if isinstance(prompt, str):
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "logit_bias": logit_bias}
        if json_schema is not None:
            body["json_schema"] = json_schema
        return "/v1/completions", body
    sampling_params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    if json_schema is not None:
        sampling_params["json_schema"] = json_schema
    return "/generate", {"input_ids": prompt, "stream": True, "sampling_params": sampling_params}


def new_tokens(chunk: dict, seen: int) -> int:
    """Tokens a stream event adds: /generate's events hold every output id so far; a
    /v1/completions chunk with text counts as one."""
    if "output_ids" in chunk:
        return len(chunk["output_ids"]) - seen
    return int(bool(chunk.get("choices") and chunk["choices"][0].get("text")))


def chunk_text(chunk: dict, text: str) -> str:
    """The output text so far: /generate's events hold all of it, completions chunks a piece."""
    if "output_ids" in chunk:
        return chunk.get("text") or text
    return text + "".join(c.get("text") or "" for c in chunk.get("choices") or ())


def finish_reason(chunk: dict) -> str | None:
    """The finish reason a stream event carries: /generate's meta_info, a completions choice."""
    if "meta_info" in chunk:
        return ((chunk["meta_info"] or {}).get("finish_reason") or {}).get("type")
    return next((c["finish_reason"] for c in chunk.get("choices") or () if c.get("finish_reason")), None)


async def one_request(http: httpx.AsyncClient, model: str, prompt: str | list[int],
                      output_len: int, logit_bias: dict = BANNED, json_schema: str | None = None) -> dict:
    route, body = request_body(model, prompt, output_len, logit_bias, json_schema)
    start = time.perf_counter()
    token_times, tokens, usage_tokens, text, finish = [], 0, None, "", None
    async with http.stream("POST", route, json=body) as response:
        if response.status_code != 200:
            return {"ok": False, "error": (await response.aread()).decode()[:300]}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk and "choices" not in chunk and "output_ids" not in chunk:
                return {"ok": False, "error": json.dumps(chunk["error"])[:300]}
            added = new_tokens(chunk, tokens)
            if added > 0:
                token_times.append(time.perf_counter())
                tokens += added
            if (chunk.get("usage") or {}).get("completion_tokens") is not None:
                usage_tokens = chunk["usage"]["completion_tokens"]
            text = chunk_text(chunk, text)
            finish = finish_reason(chunk) or finish
    end = time.perf_counter()
    if not token_times:
        return {"ok": False, "error": "no tokens"}
    itl = np.diff(token_times).tolist()
    return {"ok": True, "ttft": token_times[0] - start, "itl": itl, "e2e": end - start,
            "output_tokens": tokens if usage_tokens is None else usage_tokens,
            "finish_reason": finish, "text": text}


async def run_pass(http: httpx.AsyncClient, model: str, prompts: list, output_len: int,
                   max_concurrency: int | None, request_rate: float, seed: int,
                   logit_bias: dict = BANNED, json_schema: str | None = None) -> dict:
    """One pass over the prompts (arrivals seeded, so every pass has the same schedule)."""
    semaphore = asyncio.Semaphore(max_concurrency or len(prompts))
    rng = np.random.default_rng(seed)

    async def limited(prompt):
        async with semaphore:
            return await one_request(http, model, prompt, output_len, logit_bias, json_schema)

    start = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(limited(prompt)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.exponential(1.0 / request_rate))
    results = await asyncio.gather(*tasks)
    return summarize(results, time.perf_counter() - start, constrained=json_schema is not None)


async def run_load(base_url: str, model: str, prompts: list, output_len: int,
                   max_concurrency: int | None, request_rate: float, seed: int,
                   logit_bias: dict = BANNED, json_schema: str | None = None,
                   repeat: int = 1) -> dict:
    """Without `json_schema` and `repeat`: one pass's stats. Otherwise {"unconstrained": stats,
    "json_schema": stats (with a schema), "ratio": constrained / unconstrained output tok/s}:
    after a warm-up of both kinds, `repeat` rounds, the first unconstrained then constrained, the
    next the other way round, and so on; each kind's stats the median over its rounds."""
    # A new connection per request: llama-server (cpp-httplib) now and then dropped a kept-alive
    # connection as the next request went out on it ("Server disconnected without sending a
    # response"). A local connect costs well under a millisecond.
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts), max_keepalive_connections=0)
    kinds = {"unconstrained": None} | ({} if json_schema is None else {"json_schema": json_schema})
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as http:
        for schema in kinds.values():  # warm-up (with a schema: its compile, the mask path)
            warm = await one_request(http, model, prompts[0], min(output_len, 8), logit_bias, schema)
            if not warm["ok"] and schema is not None:
                raise RuntimeError(f"the constrained warm-up request failed: {warm['error']}")
        if json_schema is None and repeat == 1:
            return await run_pass(http, model, prompts, output_len, max_concurrency,
                                  request_rate, seed, logit_bias)
        rounds = {kind: [] for kind in kinds}
        for i in range(repeat):
            for kind in (list(kinds) if i % 2 == 0 else list(kinds)[::-1]):
                # The passes share their prompts: without a flush the later one would find every
                # prompt in the prefix cache. Servers without SGLang's /flush_cache keep theirs.
                await http.post("/flush_cache")
                stats = await run_pass(http, model, prompts, output_len, max_concurrency,
                                       request_rate, seed, logit_bias, kinds[kind])
                print(f"  round {i + 1}/{repeat} {kind}: {stats['output_tok_s']} output tok/s",
                      file=sys.stderr)
                rounds[kind].append(stats)
    combined = {kind: median_stats(runs) for kind, runs in rounds.items()}
    if json_schema is not None:
        combined["ratio"] = round(combined["json_schema"]["output_tok_s"]
                                  / combined["unconstrained"]["output_tok_s"], 3)
        if repeat > 1:
            combined["round_ratios"] = [round(c["output_tok_s"] / u["output_tok_s"], 3) for u, c in
                                        zip(rounds["unconstrained"], rounds["json_schema"])]
    return combined


def median_stats(runs: list[dict]) -> dict:
    """Several passes' stats as one: request counts and finish reasons summed, the rest medians
    (each its own: the rows need not come from one pass); `round_output_tok_s` lists them all."""
    if len(runs) == 1:
        return runs[0]
    combined = {}
    for key, value in runs[0].items():
        values = [run[key] for run in runs]
        if key in ("completed", "failed", "starts_with_brace"):
            combined[key] = sum(values)
        elif isinstance(value, str):
            combined[key] = value
        elif key == "finish_reasons":
            combined[key] = {k: sum(v.get(k, 0) for v in values) for k in sorted({k for v in values for k in v})}
        else:
            combined[key] = round(float(np.median(values)), 3)
    combined["round_output_tok_s"] = [run["output_tok_s"] for run in runs]
    return combined


def summarize(results: list[dict], duration: float, constrained: bool = False) -> dict:
    done = [r for r in results if r["ok"]]
    if not done:
        raise RuntimeError(f"every request failed, e.g. {results[0].get('error')}")
    ttft = np.array([r["ttft"] for r in done]) * 1000
    itl = np.array([x for r in done for x in r["itl"]] or [0.0]) * 1000
    # time per output token after the first, per request (sglang.bench_serving's TPOT)
    tpot = np.array([(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in done
                     if r["output_tokens"] > 1] or [0.0]) * 1000
    e2e = np.array([r["e2e"] for r in done])
    output_tokens = sum(r["output_tokens"] for r in done)
    stats = {"completed": len(done), "failed": len(results) - len(done), "duration_s": round(duration, 2),
             "request_throughput": round(len(done) / duration, 3),
             "output_tok_s": round(output_tokens / duration, 1)}
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_s", e2e)):
        stats[f"mean_{name}"] = round(float(values.mean()), 2)
        stats[f"median_{name}"] = round(float(np.median(values)), 2)
        stats[f"p99_{name}"] = round(float(np.percentile(values, 99)), 2)
    reasons = [str(r["finish_reason"]) for r in done]
    stats["finish_reasons"] = {k: reasons.count(k) for k in sorted(set(reasons))}
    if constrained:  # a server that ignored the schema would not start every output with "{"
        stats["starts_with_brace"] = sum(r["text"].lstrip().startswith("{") for r in done)
        stats["sample_output"] = done[0]["text"][:240]  # to eyeball (cut at max_tokens)
    return stats


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _record(results: dict, ratios: dict, row: str, result: dict, memory: dict) -> None:
    """One pass's rows (unconstrained, and constrained with --json-schema), printed to stderr."""
    if "unconstrained" not in result:  # one plain pass
        result = {"unconstrained": result}
    results[row] = result["unconstrained"] | memory
    if "json_schema" in result:
        results[f"{row} json_schema"] = result["json_schema"] | memory
        ratios[row] = {k: result[k] for k in ("ratio", "round_ratios") if k in result}
    for name in (row, f"{row} json_schema"):
        if name in results:
            print(f"{name}: {results[name]}", file=sys.stderr)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running OpenAI-compatible server")
    parser.add_argument("--launch", help="comma-separated servers to start in turn: xlaserve, llama.cpp "
                                         "(llama-cpp-python), llama-server (llama.cpp's C++ server)")
    parser.add_argument("--model", default="default", help="the model name to send")
    parser.add_argument("--num-prompts", type=_int_list, default=[64], metavar="N[,N...]",
                        help="prompts per pass: one, or one per --max-concurrency value (8,128)")
    parser.add_argument("--input-len", default="32-64", help="prompt length range in tokens, 'lo-hi'")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=_int_list, default=None,
                        dest="concurrency_levels", metavar="N[,N...]",
                        help="requests in flight at most; several (1,64) are passes in turn on the "
                             "same server, which is launched for the largest")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=30100, help="port for --launch")
    parser.add_argument("--xlaserve-arg", action="append", default=[], help="extra launch_server flag")
    parser.add_argument("--gguf", choices=["Q4_1", "F32", "Q8_0", "Q4_K_M"],
                        help="every launched server serves this GGUF of the embedded model "
                             "(Q4_1: its own file; the others made by peers.py; the quantized ones with the llama-quantize beside "
                             "--llama-server-bin, else on PATH); xlaserve as --model-path")
    parser.add_argument("--llama-server-bin", metavar="PATH", help="llama.cpp's llama-server, for "
                        "--launch llama-server (its llama-quantize beside it makes --gguf files)")
    parser.add_argument("--llama-server-threads", type=int, metavar="N",
                        help="llama-server's -t and -tb (default: one per core). Where others keep "
                             "the cores busy, 1: its threads meet at a barrier after every op, so "
                             "one descheduled thread stalls all (2-core machine, ~1.2 cores busy "
                             "elsewhere, Q8_0 single stream: 52 tok/s with 1 thread, 1.4-26 with 2)")
    parser.add_argument("--llama-server-arg", action="append", default=[],
                        help="extra llama-server flag, e.g. --llama-server-arg=--no-repack")
    parser.add_argument("--log-dir", default="/tmp", help="server logs for --launch")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--json-schema", metavar="FILE",
                        help="also run every prompt constrained by this JSON schema (same server, "
                             "same prompts) and report constrained / unconstrained output tok/s; "
                             "e.g. benchmarks/schemas/long_records.json")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of passes, alternating which kind goes first; medians reported")
    model_options.add_model_args(parser)  # with --base-url: the model the server runs
    args = parser.parse_args(argv)
    if bool(args.base_url) == bool(args.launch):
        parser.error("give --base-url or --launch")
    if args.repeat < 1:
        parser.error("--repeat takes 1 or more")
    kinds = args.launch.split(",") if args.launch else []
    if set(kinds) - {"xlaserve", *LLAMA_KINDS}:
        parser.error(f"--launch takes xlaserve, llama.cpp, llama-server, not {args.launch}")
    if "llama-server" in kinds and not args.llama_server_bin:
        parser.error("--launch llama-server needs --llama-server-bin PATH (a llama.cpp build)")
    if args.gguf and not kinds:
        parser.error("--gguf picks the file launched servers serve: give --launch")
    levels = args.concurrency_levels or [None]
    if len(args.num_prompts) not in (1, len(levels)):
        parser.error("--num-prompts takes one value or one per --max-concurrency value")
    num_prompts = args.num_prompts * len(levels) if len(args.num_prompts) == 1 else args.num_prompts
    args.max_concurrency = None if levels == [None] else max(levels)  # what launch() sizes for
    llama_launched = any(kind in LLAMA_KINDS for kind in kinds)
    json_schema = None
    if args.json_schema:
        if llama_launched:
            parser.error("--json-schema measures xlaserve's constrained decoding: --launch xlaserve")
        with open(args.json_schema) as f:
            json_schema = json.dumps(json.load(f))  # the JSON string SGLang's json_schema takes
    custom_model = args.model_path or args.load_format != "auto"
    if custom_model and (llama_launched or args.gguf):
        parser.error("llama.cpp, llama-server and --gguf run the embedded model only: --launch "
                     "xlaserve with --model-path or --load-format dummy")
    vocabulary = model_options.model_vocabulary(args.model_path, args.load_format)
    # The default model's end-of-text ids are not another model's.
    logit_bias = {str(i): -100 for i in vocabulary.stop_ids} if custom_model else BANNED
    model_flags = launch_flags(model_options.engine_model_args(args, vocabulary))
    gguf = gguf_file(args.gguf, args.llama_server_bin) if args.gguf else None
    if gguf:
        model_flags += ["--model-path", gguf]
    if "llama-server" in kinds:  # the same KV capacity as llama-server's -c
        model_flags += ["--max-total-tokens", str(kv_tokens(args))]
    lo, hi = (int(x) for x in args.input_len.split("-"))
    # Each pass its own prompts: a later pass would find an earlier one's in a prefix cache.
    passes = [(level, make_prompts(num, (lo, hi), args.seed + i, vocabulary))
              for i, (level, num) in enumerate(zip(levels, num_prompts))]
    workload = {"num_prompts": num_prompts if len(levels) > 1 else num_prompts[0],
                "max_concurrency": levels if len(levels) > 1 else levels[0],
                **{k: getattr(args, k) for k in ("input_len", "output_len", "request_rate",
                                                 "model_path", "load_format")}}
    if gguf:
        workload["gguf"] = gguf
    if "llama-server" in kinds:
        workload.update(llama_server=llama_server_version(args.llama_server_bin),
                        llama_server_threads=args.llama_server_threads or os.cpu_count(),
                        llama_server_args=args.llama_server_arg, kv_tokens=kv_tokens(args))
    if json_schema is not None or args.repeat > 1:
        workload.update(json_schema=args.json_schema, repeat=args.repeat)
    print(f"workload: {workload}", file=sys.stderr)
    results, ratios = {}, {}
    targets = [("server", args.base_url, None)] if args.base_url else [
        (kind, f"http://127.0.0.1:{args.port}", kind) for kind in kinds]
    for name, url, kind in targets:
        process = launch(kind, args.port, args, model_flags, gguf) if kind else None
        try:
            startup_peak = process_memory.peak_rss_mib(process.pid) if process else None
            for concurrency, prompts in passes:
                if process:
                    process_memory.reset_peak_rss(process.pid)
                result = asyncio.run(run_load(url, args.model, prompts, args.output_len,
                                              concurrency, args.request_rate, args.seed,
                                              logit_bias, json_schema, args.repeat))
                # with --json-schema or --repeat, the peak over all of the pass's rounds
                memory = {"peak_rss_mib": process_memory.peak_rss_mib(process.pid),
                          "startup_peak_rss_mib": startup_peak} if process else {}
                row = name if len(passes) == 1 else f"{name} c={concurrency}"
                _record(results, ratios, row, result, memory)
        finally:
            if process is not None:
                process.terminate()
                process.wait(timeout=60)
    if args.json:
        print(json.dumps({"workload": workload, **results,
                          **({"constrained_over_unconstrained": ratios} if ratios else {})}))
        return
    columns = ["request_throughput", "output_tok_s", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
               "median_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "peak_rss_mib"]
    width = max(12, *(len(name) + 1 for name in results))
    print(f"\n{'':<{width}}" + "".join(f"{c:>17}" for c in columns))
    for name, stats in results.items():
        print(f"{name:<{width}}" + "".join(f"{stats.get(c, '-'):>17}" for c in columns))
    for name, ratio in ratios.items():
        constrained = results[f"{name} json_schema"]
        rounds = f" (rounds: {ratio['round_ratios']})" if "round_ratios" in ratio else ""
        print(f"{name}: constrained / unconstrained output tok/s = {ratio['ratio']}{rounds}; "
              f"constrained finish reasons {constrained['finish_reasons']}, "
              f"{constrained['starts_with_brace']} of {constrained['completed']} outputs start with '{{'")
        if constrained["finish_reasons"].get("stop"):
            print(f"  (not like for like: {constrained['finish_reasons']['stop']} constrained requests "
                  "completed their schema before --output-len; give a longer schema)")


if __name__ == "__main__":
    main()
