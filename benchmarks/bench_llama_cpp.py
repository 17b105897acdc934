"""xlaserve against llama.cpp on the CPU, on the same GGUF file (the embedded default model's
Q4_1), side by side in one invocation, with the same threads: what issue 52 measures.

    .venv/bin/python benchmarks/bench_llama_cpp.py --llama-bin-dir BUILD/bin [--out DIR]

BUILD/bin holds llama.cpp's llama-server and llama-bench, built from llama-cpp-python's sdist
(docs/performance.md, "GGUF files against llama.cpp's llama-server", says how). It measures:
- serving: bench_serving.py with both servers launched in turn, 1 request at a time (8 prompts)
  and 64 at once (128 prompts), 32-64 token prompts, 128 output tokens;
- prefill: the time to the first token of one long prompt (512 and 5,721 tokens by default) as
  xlaserve's Engine.generate of one token, against llama-bench's prompt processing of as many
  tokens (-p N -n 0), both on all the cores;
- offline throughput (64 output tokens per prompt, all prompts at once) at 1-128 rows for the
  file kept quantized with q8 activations (the default), with float32 ones, and for the same
  weights dequantized to float32 (the F32 GGUF peers.py makes), each system in a process of its
  own, `--rounds` times in turn;
and writes the figures, a table and a plot of offline tok/s over rows to --out
(docs/results/cpu-<cpu>-<date>/ by default): llama_cpp.json, llama_cpp.md, llama_cpp_offline.svg.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time

from bench_quantized_gemm import cpu_description
from svg_plot import line_svg

HERE = os.path.dirname(os.path.abspath(__file__))
OFFLINE_SYSTEMS = ("q8", "float32", "dequantized")


def child_prefill(lengths: list[int]) -> dict:
    """{tokens: seconds to the first token} of one prompt of each length (random ids)."""
    import xlaserve

    engine = xlaserve.Engine(None, max_total_tokens=2 * max(lengths) + 64,
                             context_length=max(lengths) + 64, log_level="warning")
    rng, vocab = random.Random(0), engine.tokenizer.vocab_size
    engine.generate(input_ids=[5] * 64, sampling_params={"max_new_tokens": 1})  # warm
    result = {}
    for length in lengths:
        ids = [rng.randrange(100, vocab - 100) for _ in range(length)]
        start = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
        result[length] = time.perf_counter() - start
    engine.shutdown()
    return result


def child_offline(system: str, sizes: list[int]) -> dict:
    """{rows: output tok/s} of `system` (OFFLINE_SYSTEMS) for prompts of 32-64 random ids."""
    import xlaserve

    if system == "dequantized":
        import peers
        engine = xlaserve.Engine(peers.f32_gguf(), max_running_requests=max(sizes),
                                 log_level="warning")
    else:
        engine = xlaserve.Engine(None, quantized_activations=system, max_running_requests=max(sizes),
                                 log_level="warning")
    rng, vocab = random.Random(0), engine.tokenizer.vocab_size
    greedy = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=[[7] * 40] * 2, sampling_params=greedy)  # warm
    result = {}
    for rows in sizes:
        prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(32, 64))]
                   for _ in range(rows)]
        start = time.perf_counter()
        outputs = engine.generate(input_ids=prompts, sampling_params=greedy)
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
        result[rows] = tokens / (time.perf_counter() - start)
    engine.shutdown()
    return result


def _child(*args: str) -> dict:
    """Runs this file's --child in a process of its own; its last output line (JSON)."""
    command = [sys.executable, os.path.abspath(__file__), "--child", *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_bench(binary: str, gguf: str, lengths: list[int], threads: int) -> dict:
    """{tokens: seconds} of llama-bench's prompt processing of that many tokens."""
    done = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-p",
                           ",".join(map(str, lengths)), "-n", "0", "-r", "1", "-o", "json"],
                          capture_output=True, text=True, check=True)
    return {str(run["n_prompt"]): run["n_prompt"] / run["avg_ts"]
            for run in json.loads(done.stdout)}


def serving(args, threads: int) -> dict:
    command = [sys.executable, os.path.join(HERE, "bench_serving.py"), "--launch",
               "xlaserve,llama-server", "--gguf", "Q4_1", "--llama-server-bin",
               os.path.join(args.llama_bin_dir, "llama-server"), "--llama-server-threads",
               str(threads), "--max-concurrency", "1,64", "--num-prompts", "8,128",
               "--output-len", "128", "--json"]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(result: dict) -> str:
    serve, prefill, offline = result["serving"], result["prefill"], result["offline"]
    lines = [f"# xlaserve and llama.cpp on one GGUF ({result['date']})", "",
             f"CPU: {result['cpu']}. File: {os.path.basename(result['gguf'])}. "
             f"{result['llama_cpp']}. Command: `{result['command']}`", "",
             "| | llama.cpp | xlaserve | xlaserve / llama.cpp |", "|---|---|---|---|"]
    for level in ("1", "64"):
        ours = serve.get(f"xlaserve c={level}", serve.get("xlaserve", {}))["output_tok_s"]
        theirs = serve.get(f"llama-server c={level}", serve.get("llama-server", {}))["output_tok_s"]
        lines.append(f"| {level} concurrent, output tok/s | {theirs:.1f} | {ours:.1f} | "
                     f"{ours / theirs:.2f}x |")
    for length, seconds in prefill["xlaserve"].items():
        theirs = prefill["llama-bench"][length]
        lines.append(f"| {length}-token prompt, seconds to the first token | {theirs:.2f} | "
                     f"{seconds:.2f} | {seconds / theirs:.2f}x the time |")
    lines += ["", "Offline output tok/s (64 tokens a prompt, all at once; median of rounds):", "",
              "| rows | " + " | ".join(OFFLINE_SYSTEMS) + " | q8 / dequantized |",
              "|---" * (len(OFFLINE_SYSTEMS) + 2) + "|"]
    for rows in offline["q8"]:
        figures = [offline[system][rows] for system in OFFLINE_SYSTEMS]
        lines.append(f"| {rows} | " + " | ".join(f"{f:.1f}" for f in figures) +
                     f" | {figures[0] / figures[2]:.2f}x |")
    lines += ["", "![offline tok/s over rows](llama_cpp_offline.svg)", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-bin-dir", help="folder of llama-server and llama-bench")
    parser.add_argument("--out", help="results folder (default docs/results/cpu-<cpu>-<date>)")
    parser.add_argument("--rounds", type=int, default=2, help="offline rounds, systems in turn")
    parser.add_argument("--rows", default="1,8,32,64,128", help="offline batch sizes")
    parser.add_argument("--prompt-lengths", default="512,5721", help="prefill prompts (tokens)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        out = (child_prefill([int(n) for n in rest[0].split(",")]) if kind == "prefill"
               else child_offline(rest[0], [int(n) for n in rest[1].split(",")]))
        print(json.dumps(out))
        return
    if not args.llama_bin_dir:
        parser.error("--llama-bin-dir is required")
    from xlaserve.weights.loader import default_model_file

    threads = os.cpu_count() or 1
    gguf = default_model_file()
    version = subprocess.run([os.path.join(args.llama_bin_dir, "llama-server"), "--version"],
                             capture_output=True, text=True).stderr.strip().splitlines()
    result = {"date": datetime.date.today().isoformat(), "cpu": cpu_description(), "gguf": gguf,
              "llama_cpp": next((v for v in version if v.startswith("version")), "llama.cpp"),
              "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
              "threads": threads}
    print("serving ...", flush=True)
    result["serving"] = serving(args, threads)
    print("prefill ...", flush=True)
    result["prefill"] = {
        "xlaserve": _child("prefill", args.prompt_lengths),
        "llama-bench": llama_bench(os.path.join(args.llama_bin_dir, "llama-bench"), gguf,
                                   [int(n) for n in args.prompt_lengths.split(",")], threads)}
    runs = {system: [] for system in OFFLINE_SYSTEMS}
    for round_ in range(args.rounds):
        for system in OFFLINE_SYSTEMS:
            print(f"offline {system}, round {round_ + 1} ...", flush=True)
            runs[system].append(_child("offline", system, args.rows))
    result["offline_runs"] = runs
    result["offline"] = {system: {rows: statistics.median(run[rows] for run in runs[system])
                                  for rows in runs[system][0]} for system in OFFLINE_SYSTEMS}
    cpu = result["cpu"].split(";")[0].lower().replace(" ", "-")
    out = args.out or os.path.join(os.path.dirname(HERE), "docs", "results",
                                   f"cpu-{cpu}-{result['date']}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "llama_cpp.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "llama_cpp.md"), "w") as f:
        f.write(report(result))
    series = [(system, [(int(r), v) for r, v in result["offline"][system].items()], False)
              for system in OFFLINE_SYSTEMS]
    with open(os.path.join(out, "llama_cpp_offline.svg"), "w") as f:
        f.write(line_svg(series, "rows (requests at once)", "tok/s"))
    print(report(result))


if __name__ == "__main__":
    main()
