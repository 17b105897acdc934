"""Offline throughput: xlaserve's Engine and Hugging Face transformers on the same workload, in
one run, so the figures that matter are ratios measured side by side on the same (noisy) machine.

    .venv/bin/python benchmarks/offline_throughput.py                       # 256 prompts, all peers
    .venv/bin/python benchmarks/offline_throughput.py --num-prompts 64 --peers none
    .venv/bin/python benchmarks/offline_throughput.py --single-stream 3     # one request at a time

The workload is SGLang's "random" dataset: prompts of random token ids (lengths uniform in
--input-len), --output-len new tokens each, greedy, EOS ignored so every request makes all of them.
xlaserve's figure excludes start-up (load, precompile): it times `engine.generate` of every prompt
at once, as `sglang.bench_offline_throughput` does. transformers runs batched `generate` with left
padding at --peer-batch-size (its best on this machine was 16), on --peer-num-prompts prompts: its
throughput per batch is the same for every batch, so a subset measures it (and saves minutes).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def make_prompts(num_prompts: int, input_len: tuple[int, int], vocab_size: int, seed: int,
                 special_ids: set[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = np.array([t for t in range(vocab_size) if t not in special_ids])
    lengths = rng.integers(input_len[0], input_len[1] + 1, size=num_prompts)
    return [rng.choice(allowed, size=int(n)).tolist() for n in lengths]


def start_xlaserve(engine_args: dict):
    import xlaserve

    start = time.perf_counter()
    engine = xlaserve.Engine(**engine_args)
    return engine, time.perf_counter() - start


def run_xlaserve(engine, startup: float, prompts, output_len: int, single_stream: int) -> dict:
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    try:
        engine.generate(input_ids=prompts[:2], sampling_params=params)  # warm caches and threads
        result = {"startup_s": round(startup, 1)}
        if single_stream:
            result.update(_single_stream(lambda p: engine.generate(input_ids=p, sampling_params=params),
                                         prompts[:single_stream], output_len))
            return result
        start = time.perf_counter()
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - start
        generated = sum(len(o["output_ids"]) for o in outputs)
        assert generated == output_len * len(prompts), "a request stopped early"
        result.update(_throughput(prompts, generated, elapsed))
        return result
    finally:
        engine.shutdown()


def run_transformers(prompts, output_len: int, dtype: str, batch_size: int, single_stream: int,
                     threads: int | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from xlaserve.model.loader import default_model_file

    if threads:
        torch.set_num_threads(threads)
    directory, filename = os.path.split(default_model_file())
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=filename, dtype=torch.float32).to(getattr(torch, dtype)).eval()

    def generate(batch):
        width = max(len(p) for p in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding, as batched generation needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        return out[:, width:]

    generate(prompts[:2])  # warm-up
    if single_stream:
        return _single_stream(lambda p: generate([p]), prompts[:single_stream], output_len)
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(prompts), batch_size):
        generated += generate(prompts[i:i + batch_size]).numel()
    elapsed = time.perf_counter() - start
    return _throughput(prompts, generated, elapsed) | {"batch_size": batch_size}


def _single_stream(generate_one, prompts, output_len: int) -> dict:
    times = []
    for prompt in prompts:
        start = time.perf_counter()
        generate_one(prompt)
        times.append(time.perf_counter() - start)
    median = float(np.median(times))
    return {"requests": len(prompts), "median_request_s": round(median, 3),
            "output_tok_s": round(output_len / median, 1)}


def _throughput(prompts, generated: int, elapsed: float) -> dict:
    return {"requests": len(prompts), "elapsed_s": round(elapsed, 1),
            "output_tok_s": round(generated / elapsed, 1),
            "total_tok_s": round((generated + sum(map(len, prompts))) / elapsed, 1)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", default="32-64", help="prompt length range, 'lo-hi'")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-path", default=None, help="xlaserve's model (default: embedded)")
    parser.add_argument("--max-running-requests", type=int, default=None)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="any other ServerArgs field, e.g. --engine-arg max_prefill_tokens=1024")
    parser.add_argument("--peers", default="transformers-float32,transformers-bfloat16",
                        help="comma-separated: transformers-float32, transformers-bfloat16, or none")
    parser.add_argument("--peer-batch-size", type=int, default=16)
    parser.add_argument("--peer-num-prompts", type=int, default=64)
    parser.add_argument("--peer-threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--single-stream", type=int, default=0, metavar="N",
                        help="instead of throughput, time N requests one at a time (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = parser.parse_args(argv)

    lo, hi = (int(x) for x in args.input_len.split("-"))
    engine_args = {"model_path": args.model_path, "log_level": "warning"}
    if args.max_running_requests:
        engine_args["max_running_requests"] = args.max_running_requests
    for item in args.engine_arg:
        name, value = item.split("=", 1)
        engine_args[name] = _parse_value(value)

    engine, startup = start_xlaserve(engine_args)
    special_ids = set(engine.tokenizer.all_special_ids) if engine.tokenizer is not None else set()
    prompts = make_prompts(args.num_prompts, (lo, hi), engine.core.loaded.config.vocab_size,
                           args.seed, special_ids)
    results = {"workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                            "output_len": args.output_len, "single_stream": args.single_stream}}
    print(f"workload: {results['workload']}", file=sys.stderr)
    results["xlaserve"] = run_xlaserve(engine, startup, prompts, args.output_len, args.single_stream)
    print(f"xlaserve: {results['xlaserve']}", file=sys.stderr)
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    for peer in peers:
        if not peer.startswith("transformers-"):
            parser.error(f"unknown peer {peer!r}")
        if args.model_path is not None:
            parser.error("peers run the embedded default model; drop --model-path or use --peers none")
        peer_prompts = prompts[:args.peer_num_prompts]
        results[peer] = run_transformers(peer_prompts, args.output_len, peer.split("-", 1)[1],
                                         args.peer_batch_size, args.single_stream, args.peer_threads)
        results[peer]["xlaserve_ratio"] = round(
            results["xlaserve"]["output_tok_s"] / results[peer]["output_tok_s"], 2)
        print(f"{peer}: {results[peer]}", file=sys.stderr)
    if peers:
        best = max(peers, key=lambda p: results[p]["output_tok_s"])
        results["ratio_vs_best_peer"] = {"peer": best, "ratio": results[best]["xlaserve_ratio"]}
    if args.json:
        print(json.dumps(results))
    else:
        _print_table(results, peers)


def _parse_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _print_table(results: dict, peers: list[str]) -> None:
    print(f"\n{'system':<24}{'output tok/s':>14}{'ratio':>10}")
    print(f"{'xlaserve':<24}{results['xlaserve']['output_tok_s']:>14}{'':>10}")
    for peer in peers:
        r = results[peer]
        print(f"{peer:<24}{r['output_tok_s']:>14}{r['xlaserve_ratio']:>10}")


if __name__ == "__main__":
    main()
