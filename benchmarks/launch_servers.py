"""Starting the servers bench_serving.py measures side by side: xlaserve, llama-cpp-python's
server (llama.cpp) and llama.cpp's C++ llama-server, each waited for until it serves."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

LLAMA_KINDS = ("llama.cpp", "llama-server")


def kv_tokens(args: argparse.Namespace) -> int:
    """The KV capacity llama-server and xlaserve both get side by side: per request, the longest
    prompt twice over (each server tokenizes the decoded prompts itself) and the output."""
    longest = int(args.input_len.split("-")[1])
    return (args.max_concurrency or 64) * (2 * longest + args.output_len)


def gguf_file(kind: str, llama_server_bin: str | None) -> str:
    """The embedded model's GGUF of `kind`: Q4_1, the file itself (Q4_1 matrices, a Q8_0
    embedding); F32, Q8_0, Q4_K_M made once (peers.py), the quantized ones by the llama-quantize
    beside `llama_server_bin` (else the one on PATH)."""
    import peers

    if kind == "Q4_1":
        from xlaserve.weights.loader import default_model_file
        return default_model_file()
    if kind == "F32":
        return peers.f32_gguf()
    quantize = (os.path.join(os.path.dirname(llama_server_bin), "llama-quantize")
                if llama_server_bin else "llama-quantize")
    return peers.quantized_gguf(kind, quantize)


def launch(kind: str, port: int, args: argparse.Namespace, model_flags: Sequence[str] = (),
           gguf: str | None = None) -> subprocess.Popen:
    """Starts `kind` and waits until it serves. `gguf`: the file llama.cpp's servers load (default
    the embedded model as F32); xlaserve's model is in `model_flags`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if kind in LLAMA_KINDS and gguf is None:
        gguf = gguf_file("F32", None)
    if kind == "xlaserve":
        command = [sys.executable, "-m", "xlaserve.launch_server", "--port", str(port),
                   "--max-running-requests", str(args.max_concurrency or 64),
                   *model_flags, *args.xlaserve_arg]
    elif kind == "llama.cpp":
        command = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
                   "--n_ctx", "2048", "--n_threads", str(os.cpu_count()),
                   "--interrupt_requests", "False"]  # else a new request cuts the running one off
    elif kind == "llama-server":
        threads = str(args.llama_server_threads or os.cpu_count())
        command = [args.llama_server_bin, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                   "-np", str(args.max_concurrency or 64), "-c", str(kv_tokens(args)),
                   "-t", threads, "-tb", threads, "--cont-batching", "--cache-ram", "0",
                   *args.llama_server_arg]
    else:
        raise ValueError(f"unknown server {kind!r}: xlaserve, llama.cpp or llama-server")
    log = open(os.path.join(args.log_dir, f"{kind}.log"), "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{kind} exited; see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200 and (
                    kind == "llama.cpp" or httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200):
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.kill()
    raise TimeoutError(f"{kind} did not start; see {log.name}")


def llama_server_version(binary: str) -> str:
    """`llama-server --version`'s version line, e.g. 'version: 0.5.0-dev (build 1, commit 0c1e570)'."""
    result = subprocess.run([binary, "--version"], capture_output=True, text=True)
    lines = (result.stdout + result.stderr).splitlines()
    return next((line for line in lines if line.startswith("version:")), lines[0] if lines else "?")


def launch_flags(engine_model_args: dict) -> list[str]:
    """launch_server flags for model_options.engine_model_args (only those not at defaults)."""
    flags = []
    if engine_model_args["model_path"]:
        flags += ["--model-path", engine_model_args["model_path"]]
    if engine_model_args["load_format"] != "auto":
        flags += ["--load-format", engine_model_args["load_format"]]
    if engine_model_args["skip_tokenizer_init"]:
        flags.append("--skip-tokenizer-init")
    return flags
