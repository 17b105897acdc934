"""Start-up benchmark: seconds from launching `python -m xlaserve.launch_server` (the default
model, a free port) to the first token of a /v1/completions request (max_tokens 1), cold and warm.

    .venv/bin/python benchmarks/bench_startup.py [--rounds 3] [--xlaserve-arg=--dtype=bfloat16]
    # a real model's shapes with random weights (no tokenizer: token ids to /generate)
    .venv/bin/python benchmarks/bench_startup.py --rounds 1 \
        --xlaserve-arg=--model-path=benchmarks/configs/llama-3.1-8b \
        --xlaserve-arg=--load-format=dummy --xlaserve-arg=--skip-tokenizer-init ...

- cold: an empty persistent compilation cache (--compilation-cache-dir) and an empty conversion
  cache (--conversion-cache-dir), fresh temporary folders each round: XLA compiles every program
  and the GGUF file is converted;
- warm: both caches as the first cold round left them.
Everything goes to temporary folders, removed at the end; the user's own caches are neither read
nor touched. The native CPU kernels' cache (~/.cache/xlaserve/kernels, built once per machine) is
left as it is. Each row is the median of --rounds launches; the server's own "Start-up:" line
(where the seconds went) and "Serving steps:" line (loaded or compiled) of the median launch are
printed under the table. Targets (issue 23): warm < 10 s, cold < 60 s on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

TARGETS = {"cold": 60.0, "warm": 10.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(port: int, caches: str, storage: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "xlaserve.launch_server", "--port", str(port),
            "--compilation-cache-dir", os.path.join(caches, "xla"),
            "--conversion-cache-dir", os.path.join(caches, "converted"),
            "--file-storage-path", storage, *extra]


def first_token_request(command: list[str]) -> tuple[str, dict, callable]:
    """(route, body, answered) of the request that waits for the first token: a completion, or
    with --skip-tokenizer-init (a dummy-weight config without tokenizer files) SGLang's native
    /generate with token ids."""
    if "--skip-tokenizer-init" in command:
        return ("/generate", {"input_ids": [1, 450, 7483, 310, 3444, 338],
                              "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
                lambda reply: bool(reply["output_ids"]))
    return ("/v1/completions", {"model": "default", "prompt": "The capital of France is",
                                "max_tokens": 1, "temperature": 0.0},
            lambda reply: bool(reply["choices"][0]["text"]))


def time_to_first_token(command: list[str], port: int, log_path: str, timeout: float) -> float:
    """Seconds from Popen to the answer of `first_token_request`; the server is stopped."""
    route, body, answered = first_token_request(command)
    with open(log_path, "w") as log:
        started = time.monotonic()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            with httpx.Client(timeout=timeout) as client:
                while time.monotonic() - started < timeout:
                    if process.poll() is not None:
                        raise RuntimeError(f"the server exited ({process.returncode}); see {log_path}")
                    try:
                        response = client.post(f"http://127.0.0.1:{port}{route}", json=body)
                        if response.status_code == 200 and answered(response.json()):
                            seconds = time.monotonic() - started
                            # A request may be answered before the server's own warm-up ends
                            # (a large model): give it time to log its "Start-up:" line.
                            wait_for_startup_line(log_path, process, 120)
                            return seconds
                    except httpx.TransportError:  # not listening yet
                        pass
                    time.sleep(0.05)
            raise TimeoutError(f"no first token in {timeout} s; see {log_path}")
        finally:
            process.terminate()
            process.wait(timeout=60)


def wait_for_startup_line(log_path: str, process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with open(log_path) as f:
            if "Start-up:" in f.read():
                return
        time.sleep(0.1)


def startup_lines(log_path: str) -> str:
    """The server's "Start-up:" line (where the seconds went) and its "Serving steps:" line (steps
    loaded from the executable cache and compiled: a warm start that compiles one is slow)."""
    found = {}
    with open(log_path) as f:
        for line in f:
            for mark in ("Start-up:", "Serving steps:"):
                if mark in line:
                    found[mark] = line.strip().split("] ", 1)[-1]
    return "; ".join(found.get(mark, f"(no {mark} line in the log)")
                     for mark in ("Start-up:", "Serving steps:"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="launches per row (median)")
    parser.add_argument("--modes", default="cold,warm", help="rows to run: cold, warm or both")
    parser.add_argument("--xlaserve-arg", action="append", default=[],
                        help="extra launch_server flag (repeat; --xlaserve-arg=--flag=value)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch at most")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    root = tempfile.mkdtemp(prefix="bench_startup_")
    results: dict[str, list[float]] = {}
    breakdown: dict[str, list[str]] = {}
    command = None
    try:
        warm_caches = os.path.join(root, "caches-cold-1")
        for mode in modes:
            for i in range(1, args.rounds + 1):
                caches = os.path.join(root, f"caches-cold-{i}") if mode == "cold" else warm_caches
                if mode == "warm" and not os.path.isdir(warm_caches):  # fill them, not counted
                    port = free_port()
                    time_to_first_token(server_command(port, caches, os.path.join(root, "fill"),
                                                       args.xlaserve_arg),
                                        port, os.path.join(root, "fill.log"), args.timeout)
                port = free_port()
                command = server_command(port, caches, os.path.join(root, f"storage-{mode}-{i}"),
                                         args.xlaserve_arg)
                log_path = os.path.join(root, f"{mode}-{i}.log")
                seconds = time_to_first_token(command, port, log_path, args.timeout)
                results.setdefault(mode, []).append(seconds)
                breakdown.setdefault(mode, []).append(startup_lines(log_path))
                print(f"{mode} round {i}/{args.rounds}: {seconds:.1f} s", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    shown = " ".join(command or [])
    if args.json:
        print(json.dumps({"command": shown, "seconds": results,
                          "median": {m: statistics.median(v) for m, v in results.items()}}))
        return
    print(f"\ncommand: {shown}\n(launch -> first token of POST {first_token_request(command or [])[0]}, max_tokens 1; "
          f"CACHES: a temporary folder per cold round, the first cold round's for warm)\n")
    print(f"{'':<6}" + "".join(f"{f'round {i}':>10}" for i in range(1, args.rounds + 1))
          + f"{'median':>10}{'target':>10}")
    for mode, values in results.items():
        median = statistics.median(values)
        verdict = "ok" if median < TARGETS[mode] else "MISSED"
        print(f"{mode:<6}" + "".join(f"{v:>9.1f}s" for v in values)
              + f"{median:>9.1f}s{f'< {TARGETS[mode]:.0f}s':>8} {verdict}")
    for mode, values in results.items():
        median_round = sorted(range(len(values)), key=values.__getitem__)[len(values) // 2]
        print(f"{mode} (median round): {breakdown[mode][median_round]}")


if __name__ == "__main__":
    main()
