"""The peers the benchmarks measure xlaserve against, on the same default model:

- Hugging Face `transformers` batched `generate` (PyTorch CPU), float32 or bfloat16;
- llama.cpp through `llama-cpp-python` (`pip install 'llama-cpp-python[server]'`), on an F32 GGUF
  made from the embedded model's GGUF (`f32_gguf`), so it runs the very weights xlaserve runs;
- llama.cpp's C++ `llama-server` (bench_serving.py), on that F32 GGUF or on a Q8_0 / Q4_K_M one
  made from it by llama.cpp's own `llama-quantize` (`quantized_gguf`), served by both.

Each runs in a process of its own (`run_in_child`): two runtimes in one process share its two
cores' threads and memory, and measured each other (transformers ran 3-6x slower after JAX had
run in the same process).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np


def run_in_child(script: str, kind: str, options: dict, source_tree: str | None = None) -> dict:
    """Runs `script --child KIND --child-options JSON` and returns the JSON of its last line;
    with `source_tree`, the child imports xlaserve from there (an earlier commit's worktree)."""
    command = [sys.executable, script, "--child", kind, "--child-options", json.dumps(options)]
    env = None
    if source_tree is not None:  # PYTHONPATH goes before the editable install's finder
        env = {**os.environ, "PYTHONPATH": source_tree}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=source_tree)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])


def _bench_gguf_path(kind: str, cache_dir: str | None) -> str:
    """Where the embedded model's GGUF of `kind` (F32, Q8_0...) is cached: ~/.cache/xlaserve/bench."""
    from xlaserve.weights.loader import default_model_file

    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "xlaserve", "bench")
    stem = os.path.basename(default_model_file()).rsplit(".", 2)[0]  # SmolLM2-135M-Instruct
    return os.path.join(cache_dir, f"{stem}.{kind}.gguf")


def f32_gguf(cache_dir: str | None = None) -> str:
    """The embedded model as an all-F32 GGUF (its Q4_1/Q8_0 tensors dequantized, metadata kept),
    written once to ~/.cache/xlaserve/bench."""
    import gguf

    from xlaserve.weights.loader import default_model_file

    source = default_model_file()
    target = _bench_gguf_path("F32", cache_dir)
    if os.path.exists(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target + ".partial", arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        value_type = field.types[0]
        if value_type == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), value_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(target + ".partial", target)
    return target


QUANTIZED_KINDS = ("Q8_0", "Q4_K_M")


def quantized_gguf(kind: str, llama_quantize: str, cache_dir: str | None = None) -> str:
    """The embedded model quantized to `kind` (Q8_0 or Q4_K_M) by llama.cpp's `llama-quantize`
    from `f32_gguf`, written once beside it. The F32 file holds the embedded Q4_1 weights
    dequantized, so these are requantized weights (a peer comparison, not a quality one). The
    model's hidden size (576) is no multiple of the 256-wide K-quant blocks, so llama-quantize
    stores the tensors whose rows are 576 long in its fallback types: this Q4_K_M file (101 MiB)
    holds Q5_0 (q, k, v, o, gate, up: 51 MiB), Q8_0 (the embedding and some v: 30 MiB), Q6_K and
    Q4_K (down only: 9.7 and 7.6 MiB), so its figures are mostly Q5_0's, not Q4_K's."""
    if kind not in QUANTIZED_KINDS:
        raise ValueError(f"GGUF kind {kind!r} is not one of {', '.join(QUANTIZED_KINDS)}")
    target = _bench_gguf_path(kind, cache_dir)
    if os.path.exists(target):
        return target
    source = f32_gguf(cache_dir)
    result = subprocess.run([llama_quantize, source, target + ".partial", kind],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{llama_quantize} {kind} failed (exit {result.returncode}):\n"
                           f"{result.stderr[-3000:]}")
    os.replace(target + ".partial", target)
    return target


# --- measurements, each run inside its child process ------------------------------------------


def single_stream(generate_one, prompts, output_len: int) -> dict:
    """Requests one at a time; the median request time gives tok/s."""
    times = []
    for prompt in prompts:
        start = time.perf_counter()
        generate_one(prompt)
        times.append(time.perf_counter() - start)
    median = float(np.median(times))
    return {"requests": len(prompts), "median_request_s": round(median, 3),
            "output_tok_s": round(output_len / median, 1)}


def throughput(prompts, generated: int, elapsed: float) -> dict:
    return {"requests": len(prompts), "elapsed_s": round(elapsed, 1),
            "output_tok_s": round(generated / elapsed, 1),
            "total_tok_s": round((generated + sum(map(len, prompts))) / elapsed, 1)}


def run_transformers(prompts, output_len: int, dtype: str, batch_sizes: list[int],
                     single: int, model_path: str | None = None,
                     load_format: str = "auto") -> dict:
    """Batched greedy `generate` with left padding; the best of `batch_sizes` (each on every
    prompt), or `single` requests one at a time. The embedded model, or `model_path`'s
    (`load_format` "dummy": transformers' own random weights of its config.json)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from xlaserve.weights.loader import default_model_file

    if model_path is None:
        directory, filename = os.path.split(default_model_file())
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename,
                                                     dtype=torch.float32)
    elif load_format == "dummy":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path),
                                                 dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = model.to(getattr(torch, dtype)).eval()

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
    if single:
        return single_stream(lambda p: generate([p]), prompts[:single], output_len)
    runs = {}
    for batch_size in batch_sizes:
        start = time.perf_counter()
        generated = sum(generate(prompts[i:i + batch_size]).numel()
                        for i in range(0, len(prompts), batch_size))
        runs[batch_size] = throughput(prompts, generated, time.perf_counter() - start)
    best = max(runs, key=lambda b: runs[b]["output_tok_s"])
    return {**runs[best], "batch_size": best,
            "by_batch_size": {b: r["output_tok_s"] for b, r in runs.items()}}


def run_llama_cpp(prompts, output_len: int, single: int, threads: int | None) -> dict:
    """llama.cpp (llama-cpp-python) on the F32 GGUF, one request at a time, greedy, EOS ignored
    (llama-cpp-python decodes one sequence at a time, so this is its single-stream speed)."""
    from llama_cpp import Llama

    llm = Llama(model_path=f32_gguf(), n_ctx=1024, n_batch=512, verbose=False,
                n_threads=threads or os.cpu_count())

    def generate(prompt):
        llm.reset()
        for count, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True), start=1):
            if count == output_len:  # EOS never ends it early: we stop by count
                return

    generate(prompts[0][:8])  # warm-up
    return single_stream(generate, prompts[:max(single, 1)], output_len)
