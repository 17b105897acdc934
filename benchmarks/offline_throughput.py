"""Offline throughput: xlaserve's Engine and its peers on the same workload, in one run, so the
figures that matter are ratios measured side by side on the same (noisy) machine. Every system
runs in a process of its own (see peers.py).

    .venv/bin/python benchmarks/offline_throughput.py                        # 256 prompts
    .venv/bin/python benchmarks/offline_throughput.py --systems xlaserve-bfloat16 --peers none
    .venv/bin/python benchmarks/offline_throughput.py --single-stream 5 \\
        --systems xlaserve-float32 --peers transformers-float32,llama.cpp
    .venv/bin/python benchmarks/offline_throughput.py --single-stream 5 --rounds 3 \\
        --systems xlaserve-float32 --peers llama.cpp
    # a real model's shapes with random weights (configs in benchmarks/configs), xlaserve only
    .venv/bin/python benchmarks/offline_throughput.py --model-path benchmarks/configs/qwen2.5-0.5b \\
        --load-format dummy --systems xlaserve-bfloat16 --peers none
    # ... and transformers on its own random weights of the same config
    .venv/bin/python benchmarks/offline_throughput.py --model-path benchmarks/configs/gemma-3-1b \\
        --load-format dummy --systems xlaserve-bfloat16 --peers transformers-bfloat16
    # the working tree against an earlier commit (a git worktree of it), before/after a change
    .venv/bin/python benchmarks/offline_throughput.py --rounds 4 --systems xlaserve-bfloat16 \\
        --peers xlaserve-bfloat16@1febdd7

With --rounds R every system runs R times, in turn (A, B, A, B, ...): each round gives a ratio
of runs minutes apart, and the table shows the median ratio and each round's, so that the
machine's drift over a run (25-40% on a shared 2-core VM) shows as spread instead of bias.

The workload is SGLang's "random" dataset: prompts of random token ids (lengths uniform in
--input-len), --output-len new tokens each, greedy, EOS ignored so every request makes all of them.
xlaserve's figure excludes start-up (load, precompile): it times `engine.generate` of every prompt
at once, as `sglang.bench_offline_throughput` does. transformers runs batched `generate` with left
padding at each of --peer-batch-sizes on --peer-num-prompts prompts and reports its best.
llama.cpp (llama-cpp-python, F32 weights) decodes one sequence at a time: single stream only.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import model_options
import peers

XLASERVE = ("xlaserve-float32", "xlaserve-bfloat16")
PEERS = ("transformers-float32", "transformers-bfloat16", "llama.cpp")


def make_prompts(num_prompts: int, input_len: tuple[int, int], allowed_ids: list[int],
                 seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = np.array(allowed_ids)
    lengths = rng.integers(input_len[0], input_len[1] + 1, size=num_prompts)
    return [rng.choice(allowed, size=int(n)).tolist() for n in lengths]


def run_xlaserve(prompts, output_len: int, single: int, engine_args: dict) -> dict:
    import xlaserve

    start = time.perf_counter()
    engine = xlaserve.Engine(**engine_args)
    result = {"startup_s": round(time.perf_counter() - start, 1),
              "source": os.path.dirname(os.path.dirname(xlaserve.__file__))}
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    try:
        engine.generate(input_ids=prompts[:2], sampling_params=params)  # warm caches and threads
        if single:
            one = lambda p: engine.generate(input_ids=p, sampling_params=params)
            return result | peers.single_stream(one, prompts[:single], output_len)
        start = time.perf_counter()
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - start
        generated = sum(len(o["output_ids"]) for o in outputs)
        assert generated == output_len * len(prompts), "a request stopped early"
        return result | peers.throughput(prompts, generated, elapsed)
    finally:
        engine.shutdown()


def child(kind: str, options: dict) -> dict:
    prompts, output_len, single = options["prompts"], options["output_len"], options["single"]
    if kind.startswith("xlaserve-"):  # "xlaserve-DTYPE" or "xlaserve-DTYPE@REV"
        dtype = kind.split("@", 1)[0].split("-", 1)[1]
        args = {"log_level": "warning", "dtype": dtype, **options["engine_args"]}
        return run_xlaserve(prompts, output_len, single, args)
    if kind.startswith("transformers-"):
        return peers.run_transformers(prompts[:options["peer_num_prompts"]], output_len,
                                      kind.split("-", 1)[1], options["peer_batch_sizes"], single,
                                      options["model_path"], options["load_format"])
    if kind == "llama.cpp":
        return peers.run_llama_cpp(prompts, output_len, single, options.get("threads"))
    raise ValueError(f"unknown system {kind!r}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", default="32-64", help="prompt length range, 'lo-hi'")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default=",".join(XLASERVE),
                        help=f"xlaserve configurations: {', '.join(XLASERVE)}")
    parser.add_argument("--max-running-requests", type=int, default=128)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="any other ServerArgs field, e.g. --engine-arg max_prefill_tokens=1024")
    parser.add_argument("--peers", default="transformers-float32,transformers-bfloat16",
                        help=f"comma-separated: {', '.join(PEERS)}, xlaserve-DTYPE@REV (an "
                             "earlier commit, from a git worktree), or none")
    # transformers' best batch was 16 on a Xeon with AMX and 128 on a Zen 4 (bfloat16 and float32)
    parser.add_argument("--peer-batch-sizes", default="16,32,64,128")
    parser.add_argument("--peer-num-prompts", type=int, default=128)
    parser.add_argument("--single-stream", type=int, default=0, metavar="N",
                        help="instead of throughput, time N requests one at a time (median)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every system this many times, in turn; report median ratios")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    model_options.add_model_args(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-options", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, json.loads(args.child_options))))
        return

    vocabulary = model_options.model_vocabulary(args.model_path, args.load_format)
    lo, hi = (int(x) for x in args.input_len.split("-"))
    prompts = make_prompts(args.num_prompts, (lo, hi), vocabulary.allowed_ids, args.seed)
    engine_args = {"max_running_requests": args.max_running_requests,
                   **model_options.engine_model_args(args, vocabulary)}
    for item in args.engine_arg:
        name, value = item.split("=", 1)
        engine_args[name] = _parse_value(value)
    options = {"prompts": prompts, "output_len": args.output_len, "single": args.single_stream,
               "engine_args": engine_args, "peer_num_prompts": args.peer_num_prompts,
               "peer_batch_sizes": [int(b) for b in args.peer_batch_sizes.split(",")],
               "model_path": args.model_path, "load_format": args.load_format}
    systems = [s for s in args.systems.split(",") if s]
    peer_names = [p for p in args.peers.split(",") if p and p != "none"]
    for name in systems + peer_names:
        if name.split("@", 1)[0] not in XLASERVE + PEERS or (
                "@" in name and not name.startswith("xlaserve-")):
            parser.error(f"unknown system {name!r}")
    if "llama.cpp" in peer_names and (args.model_path or args.load_format != "auto"):
        parser.error("llama.cpp runs the embedded model only: leave it out of --peers with "
                     "--model-path or --load-format dummy")
    results = {"workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                            "output_len": args.output_len, "single_stream": args.single_stream,
                            "max_running_requests": args.max_running_requests,
                            "model": args.model_path or "default", "load_format": args.load_format}}
    print(f"workload: {results['workload']}", file=sys.stderr)
    rounds = {name: [] for name in systems + peer_names}
    with contextlib.ExitStack() as stack:
        trees = {name: stack.enter_context(_worktree(name.split("@", 1)[1]))
                 for name in systems + peer_names if "@" in name}
        for round_index in range(args.rounds):
            for name in systems + peer_names:
                rounds[name].append(peers.run_in_child(__file__, name, options, trees.get(name)))
                print(f"round {round_index + 1} {name}: {rounds[name][-1]}", file=sys.stderr)
    for name, runs in rounds.items():
        tok_s = [r["output_tok_s"] for r in runs]
        results[name] = {**runs[-1], "output_tok_s": round(float(np.median(tok_s)), 1)}
        if args.rounds > 1:
            results[name]["output_tok_s_by_round"] = tok_s
    if peer_names:
        best = max(peer_names, key=lambda p: results[p]["output_tok_s"])
        results["best_peer"] = best
        for name in systems:
            by_round = [round(mine["output_tok_s"] / theirs["output_tok_s"], 2)
                        for mine, theirs in zip(rounds[name], rounds[best], strict=True)]
            results[name]["ratio_vs_best_peer"] = round(float(np.median(by_round)), 2)
            if args.rounds > 1:
                results[name]["ratio_by_round"] = by_round
    if args.json:
        print(json.dumps(results))
    else:
        _print_table(results, systems + peer_names)


@contextlib.contextmanager
def _worktree(rev: str):
    """A detached git worktree of `rev` in a temporary folder, removed afterwards."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = tempfile.mkdtemp(prefix=f"xlaserve-{rev}-")
    subprocess.run(["git", "-C", root, "worktree", "add", "-f", "--detach", "-q", folder, rev],
                   check=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", root, "worktree", "remove", "--force", folder], check=False)


def _parse_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _print_table(results: dict, names: list[str]) -> None:
    print(f"\n{'system':<24}{'output tok/s':>14}{'ratio vs best peer':>20}  by round")
    for name in names:
        ratio = results[name].get("ratio_vs_best_peer", "")
        by_round = results[name].get("ratio_by_round") or results[name].get("output_tok_s_by_round", "")
        print(f"{name:<24}{results[name]['output_tok_s']:>14}{ratio:>20}  {by_round}")


if __name__ == "__main__":
    main()
