"""Predicted step times and decode throughput on H100 and TPU v6e, from the compiled programs
(issue 33, item 1): no accelerator is used; XLA compiles the serving step for a compile-only
target (runtime/executor/aot.py) and its own analyses give the figures.

    .venv/bin/python benchmarks/predict_accelerators.py            # Llama-3.1-8B, H100 and v6e 2x2
    .venv/bin/python benchmarks/predict_accelerators.py --all      # + Qwen3-8B on v6e tp 1 and 4
    .venv/bin/python benchmarks/predict_accelerators.py --weights --tokens 8,256
        # Llama-3.1-8B decode with bf16, int8 and fp8 weights on H100, bf16 and int8 on v6e 2x2
    .venv/bin/python benchmarks/predict_accelerators.py --target h100 --tp-size 1 \
        --model benchmarks/configs/qwen3-8b --tokens 8,256
    .venv/bin/python benchmarks/predict_accelerators.py --target h100 --tokens 8,256 \
        --variants plain,sampled,everything   # each program variant of the buckets
    .venv/bin/python benchmarks/predict_accelerators.py --target v6e:2x2 --tp-size 4 \
        --model qwen3-8b --tokens 256,4096 --workload 1024,1024,256   # a serving benchmark
    .venv/bin/python benchmarks/predict_accelerators.py --target h100 --tokens 64 \
        --lora 16,4          # with and without 4 LoRA slots of rank 16 on every module

Per bucket (tokens, seqs) of the server's own bucket list (--max-running-requests 256 unless given,
--max-prefill-tokens 4096, so a 256-row decode bucket and a 4096-token prefill bucket exist):
- flops and bytes accessed: XLA's cost analysis of the optimised program, per device. The
  deviceless GPU executable returns none, so the optimised module's text is analysed by the
  CPU client's HloCostAnalysis (the same pass, target-independent).
- cache writes: XLA charges each in-place KV-cache update (a scatter fused into the donated
  cache) as a read and a write of the whole cache; the row is that charge taken back and the
  rows really written (tokens x 2 x kv heads x head dim) put in. Where the GPU attention writes
  them itself (one-token items), XLA charges nothing and the rows are put in alone.
- the experts' grouped matmul on GPU (pallas_kernels/grouped_matmul_gpu.py), also a custom call:
  each call's FLOPs and bytes expected of a uniform routing, from its compiled shapes
  (`grouped_matmul_calls`), added to XLA's figures.
- active FLOPs ratio ("xact"): flops / (2 x active parameters x tokens), the parameters a token
  multiplies (top_k of the routed experts; not the embedding table, which is gathered), with the
  LM head's counted for the rows that get logits only (seqs). Near 1 for a dense model; the dense
  ragged_dot of the experts made it E / top_k times the experts' share.
- attention KV read (analytic): the Pallas attention is a custom call, which the cost analysis
  counts as nothing. Added: layers x seqs x context x 2 x kv heads x head dim x dtype bytes / tp,
  every sequence at --context tokens (an assumption, printed).
- predicted time = max(bytes / HBM bandwidth, flops / peak), the data sheets' figures (below);
  collectives (tp > 1) and launch gaps are not in it, so it is a lower bound on a step.
- floor: the same, with the bytes a step must move (each weight once, the KV read, the rows
  written; of an MoE's experts, those a uniform routing of the step's tokens reaches) in place of
  XLA's; XLA's figure is above it where the variant computes more than a
  greedy argmax (the sampled variant's truncation search, the prompt logprobs' LM head), the
  analysis charges a gather its whole table, or the program moves more than it must.
- decode tok/s = seqs / time for a decode bucket (one token per row); tokens / time for prefill.
  On TPU and GPU the smallest bucket is 8 tokens: a batch of 1 to 8 runs that step.
- weights: --quantization's (int8, fp8) or the model dtype's; the peaks stay bfloat16's (H100's
  FP8 tensor cores are twice as fast, which only a compute-bound step would show).
- variant: which of the accelerator's programs per bucket (runtime/sampling/step_needs.py): "plain"
  (greedy rows, nothing else: the default, what a greedy decode runs), "sampled" (penalties,
  grammar mask, random draw, top_k/top_p/min_p and logprobs, branch-free), "everything" (+ the
  prompt logprobs' LM head over every token row).
- counts from the optimised HLO: conditionals and while loops (on GPU a conditional reads its
  predicate on the host between kernels; so does a while loop whose trip count XLA does not
  know), custom calls by target, fusions, and weight copies: copies and transposes of an array
  of a weight's per-device shape, in a fusion or not (a weight relaid out every step; on v6e
  with the default layouts, 64 inside the matmuls' fusions, which the cost analysis charges no
  bytes). The weights are in the layouts XLA chose at the first compile of a run, as a server
  stores them (runtime/executor/weight_args.py).
These are predictions from compiled programs, not measurements.
"""
from __future__ import annotations

import argparse
import collections
import math
import re
import sys
import time
from pathlib import Path

from xlaserve.runtime.executor import aot
from xlaserve.runtime.sampling.step_needs import VARIANT_NAMES

CONFIGS = Path(__file__).resolve().parent / "configs"
# Data sheets: H100 SXM5 (NVIDIA: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16); TPU v6e (Google Cloud
# TPU v6e page: 1638 GB/s HBM, 918 TFLOP/s bf16 per chip; v5e: 819 GB/s, 197 TFLOP/s). Measured on an H100 80 GB
# (shared/MEASURED.md): ~3.0 TB/s copy, ~798 TFLOP/s matmul, so real steps are >= 10% slower.
PEAKS = {"h100": (3.35e12, 989e12), "h100x8": (3.35e12, 989e12),
         "v6e:2x2": (1.638e12, 918e12), "v6e:2x4": (1.638e12, 918e12),
         "v5e:2x2": (0.819e12, 197e12)}
DTYPE_NAMES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16",
               "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2"}
# (target, model, tp): the default set, and what --all adds. "v6e-1" is tp 1 on the first chip of
# the 2x2 topology (libtpu refuses a single-chip v6e:1x1 topology).
DEFAULT_RUNS = [("h100", "llama-3.1-8b", 1), ("v6e:2x2", "llama-3.1-8b", 4)]
MORE_RUNS = [("v6e:2x2", "qwen3-8b", 1), ("v6e:2x2", "qwen3-8b", 4)]
# --weights: (target, model, tp, --quantization), the weight formats each platform serves.
WEIGHT_RUNS = [("h100", "llama-3.1-8b", 1, None), ("h100", "llama-3.1-8b", 1, "int8"),
               ("h100", "llama-3.1-8b", 1, "fp8"), ("v6e:2x2", "llama-3.1-8b", 4, None),
               ("v6e:2x2", "llama-3.1-8b", 4, "int8")]


def unfused_computations(hlo: str) -> list[str]:
    """The bodies of the computations that run as a program (the entry, while and conditional
    bodies), not those inside fusions, which a fusion's one kernel computes."""
    blocks = re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ \()", hlo)
    fused = set(re.findall(r" fusion\(.*?calls=%([\w.\-]+)", hlo))
    names = [re.match(r"(?:ENTRY )?%([\w.\-]+) \(", block) for block in blocks]
    return [block for block, name in zip(blocks, names) if name and name.group(1) not in fused]


def hlo_counts(hlo: str) -> dict:
    """What one step runs, counted in the optimised HLO text outside fusions: conditionals,
    while loops, fusions and custom calls (by target), each one kernel or host decision."""
    text = "\n".join(unfused_computations(hlo))
    return {"conditional": len(re.findall(r" conditional\(", text)),
            "while": len(re.findall(r" while\(", text)),
            "fusion": len(re.findall(r" fusion\(", text)),
            "custom_calls": dict(collections.Counter(
                re.findall(r'custom-call\(.*?custom_call_target="([^"]+)"', text))),
            "command_buffers": len(re.findall(r"command_buffer", text))}


def weight_copies(hlo: str, weights) -> list[str]:
    """Copies and transposes, in fusions or not, whose result has the per-device shape of one of
    `weights` (ShapeDtypeStructs with their shardings), or of one layer of a stack of them (TPU's
    weights stacked over the layers, weight_args.py): each a weight relaid out every step."""
    shapes = set()
    for w in weights:
        shape = w.sharding.shard_shape(w.shape)
        shapes.add(",".join(map(str, shape)))
        if len(shape) > 2:  # a layer of a stack (a stack of vectors: norms, too common a shape)
            shapes.add(",".join(map(str, shape[1:])))
    found = re.findall(r"= \w+\[([\d,]+)\]\S* (?:copy|transpose)\(", hlo)
    return [shape for shape in found if shape in shapes]


def grouped_matmul_calls(hlo: str) -> list[dict]:
    """The experts' GPU grouped matmuls of a compiled step (by kernel name, gate_up's with the
    SwiGLU fused too), each with the (flops, bytes) expected of a uniform routing
    (`grouped_matmul_gpu.expected_cost`, from its rows per visit in its name and its operands'
    shapes: x [rows + block_m, K], experts [E, K, N] or gate_up [E, K, 2, I])."""
    from xlaserve.pallas_kernels import grouped_matmul_gpu

    calls = []
    names = f"({grouped_matmul_gpu.NAME}|{grouped_matmul_gpu.SWIGLU_NAME})"
    for line in hlo.splitlines():
        name = re.search(rf'name = "{names}_m(\d+)"', line)
        if not name or " custom-call(" not in line:
            continue
        block_m = int(name.group(2))
        operands = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", line).group(1)
        padded_rows = int(re.findall(r"\w+\[(\d+),\d+\]", operands)[0])
        # experts [E, K, N], or gate_up [E, K, 2, I] (the fused SwiGLU: N = 2I, I out)
        dtype, dims = re.findall(r"(\w+)\[(\d+(?:,\d+){2,3})\]", operands)[-1]
        groups, k, *columns = map(int, dims.split(","))
        itemsizes = {"bf16": 2, "f16": 2, "f32": 4}
        out_dtype, out_columns = re.search(r"= (\w+)\[\d+,(\d+)\]\S* custom-call\(",
                                           line).groups()
        flops, nbytes = grouped_matmul_gpu.expected_cost(
            block_m, padded_rows - block_m, groups, k, math.prod(columns), itemsizes[dtype],
            itemsizes[out_dtype], int(out_columns))
        calls.append({"flops": flops, "bytes": nbytes})
    return calls


def active_flops(config, parameters: int, tokens: int, seqs: int) -> tuple[float, float]:
    """(2 x the parameters each token multiplies x tokens, with the LM head's only for the seqs'
    rows that get logits; parameters of the experts no token of the step is expected to reach
    under a uniform routing), of all devices, from the step's `parameters` (its weights' element
    count) and the config."""
    lm_head = config.vocab_size * config.hidden_size
    body = parameters - lm_head * (1 if config.tie_word_embeddings else 2)  # + a gathered table
    unreachable = 0
    if config.num_experts:
        per_expert = expert_parameters(config)
        moe_layers = sum(config.moe_layers)
        body -= moe_layers * (config.num_experts - config.num_experts_per_tok) * per_expert
        # Each token picks a given expert with probability k / E under a uniform routing.
        idle_share = (1 - config.num_experts_per_tok / config.num_experts) ** tokens
        unreachable = moe_layers * config.num_experts * idle_share * per_expert
    return 2 * (body * tokens + lm_head * seqs), unreachable


def expert_parameters(config) -> int:
    """One expert's gate, up and down projections."""
    return 3 * config.hidden_size * config.moe_intermediate_size


def routed_flops(config, tokens: int) -> int:
    """2 x the routed experts' parameters x tokens: what the experts must compute, all devices."""
    return (2 * tokens * config.num_experts_per_tok * expert_parameters(config)
            * sum(config.moe_layers))


def roofline(target: str, costs: dict, extra_flops: float = 0.0) -> tuple[float, float, str,
                                                                         float]:
    """(predicted seconds, flops, "memory" or "compute", the compute bound's seconds) of a
    program with `costs` (xla_costs) plus `extra_flops` (custom calls the analysis counts as
    nothing) on `target`: max(bytes / HBM bandwidth, flops / peak)."""
    bandwidth, peak = PEAKS[target]
    flops = costs["flops"] + extra_flops
    memory, compute = costs["bytes"] / bandwidth, flops / peak
    return max(memory, compute), flops, "memory" if memory > compute else "compute", compute


def xla_costs(compiled) -> dict:
    """flops and bytes accessed of a compiled step, per device (see the module's docstring)."""
    costs = compiled.cost_analysis()
    if isinstance(costs, list):
        costs = costs[0]
    if not costs:  # the deviceless GPU executable has no cost analysis of its own
        import jax
        from jax._src.lib import _jax
        from jaxlib import _hlo

        module = _hlo.hlo_module_from_text(compiled.as_text())
        costs = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    return {"flops": float(costs["flops"]), "bytes": float(costs["bytes accessed"])}


def cache_write_fusions(hlo: str, local_shape, dtype_name: str) -> int:
    """Instructions that write a whole cache-shaped array (the in-place updates of the donated
    caches): fusions, scatters or dynamic-update-slices producing the cache's per-device shape,
    outside fusions."""
    shape = re.escape(f"{DTYPE_NAMES[dtype_name]}[{','.join(map(str, local_shape))}]")
    pattern = rf"= {shape}(\{{[^}}]*\}})? (fusion|scatter|dynamic-update-slice)\("
    return sum(len(re.findall(pattern, block)) for block in unfused_computations(hlo))


def kernel_cache_writes(hlo: str, local_shape, dtype_name: str) -> int:
    """Custom calls (the GPU attention of one-token items) that return a cache-sized array: the
    kernel writes the new K/V into the cache in place, which XLA's cost analysis charges
    nothing (a custom call's traffic is invisible to it)."""
    size, name = math.prod(local_shape), DTYPE_NAMES[dtype_name]
    count = 0
    for block in unfused_computations(hlo):
        for result in re.findall(r"= (\(.*?\)|\S+) custom-call\(", block):
            shapes = re.findall(rf"{name}\[([\d,]+)\]", result)
            count += any(math.prod(map(int, dims.split(","))) == size for dims in shapes)
    return count


def predict(program, compiled, target: str, tokens: int, seqs: int, context: int,
            config) -> dict:
    """The row of the table for one compiled bucket."""
    tp = program.mesh.size
    hlo = compiled.as_text()
    costs = xla_costs(compiled)
    memory = compiled.memory_analysis()
    cache = program.args[1][0]
    local = (*cache.shape[:-1], cache.shape[-1] // tp)  # the caches split their last axis
    itemsize = cache.dtype.itemsize
    local_cache_bytes = itemsize * local[0] * local[1] * local[2]
    writes = cache_write_fusions(hlo, local, cache.dtype.name)
    kernel_writes = kernel_cache_writes(hlo, local, cache.dtype.name)
    row_bytes = 2 * config.num_kv_heads * config.head_dim * itemsize / tp  # a token's K and V
    write_bytes = config.num_layers * tokens * row_bytes
    cache_correction = write_bytes - 2 * writes * local_cache_bytes
    kv_read = config.num_layers * seqs * context * row_bytes
    grouped = grouped_matmul_calls(hlo)
    grouped_flops = sum(call["flops"] for call in grouped)
    costs["flops"] += grouped_flops
    total = costs["bytes"] + cache_correction + kv_read + sum(call["bytes"] for call in grouped)
    bandwidth, peak = PEAKS[target]
    seconds = max(total / bandwidth, costs["flops"] / peak)
    # The floor: each weight a step reaches read once, the KV read and the new rows written.
    weights = sum(leaf.size * leaf.dtype.itemsize for leaf in program.args[0]) / tp
    largest = max(program.args[0], key=lambda leaf: leaf.size)  # the experts' dtype, in an MoE
    active, unreachable = active_flops(config, sum(leaf.size for leaf in program.args[0]),
                                       tokens, seqs)
    reached = weights - unreachable * largest.dtype.itemsize / tp  # the weights a step reads
    floor_seconds = max((reached + kv_read + write_bytes) / bandwidth, costs["flops"] / peak)
    decode = tokens == seqs
    return {"target": target, "tp": tp, "tokens": tokens, "seqs": seqs, "context": context,
            "flops": costs["flops"], "xla_bytes": costs["bytes"],
            "active_flops_ratio": costs["flops"] / (active / tp),
            "grouped_matmuls": len(grouped),
            "experts_flops_ratio": (grouped_flops / routed_flops(config, tokens) * tp
                                    if grouped else None),
            "cache_write_correction": cache_correction, "cache_writes": writes + kernel_writes,
            "kv_read": kv_read, "bytes": total, "weights": weights, "reached_weights": reached,
            "floor_seconds": floor_seconds, "arguments": memory.argument_size_in_bytes,
            "temporaries": memory.temp_size_in_bytes, "seconds": seconds,
            "bound": "memory" if total / bandwidth >= costs["flops"] / peak else "compute",
            "tok_s": (seqs if decode else tokens) / seconds,
            "floor_tok_s": (seqs if decode else tokens) / floor_seconds, "kind": "decode" if decode else
            "prefill", "weight_copies": len(weight_copies(hlo, program.args[0])),
            **hlo_counts(hlo)}


def server_args(model: str, tp: int, quantization: str | None = None, running: int = 256,
                lora: tuple[int, int] | None = None):
    """`lora`: (rank, slots) of LoRA adapter slots on every module (issue 53), or None."""
    from xlaserve.server_args import ServerArgs
    adapters = {} if lora is None else dict(enable_lora=True, max_lora_rank=lora[0],
                                            max_loras_per_batch=lora[1],
                                            lora_target_modules=["all"])
    return ServerArgs(model_path=str(CONFIGS / model) if "/" not in model else model,
                      tp_size=tp, max_running_requests=running, max_prefill_tokens=4096,
                      quantization=quantization, **adapters)


VARIANTS = {name: needs for needs, name in VARIANT_NAMES.items() if needs is not None}


def run(target: str, model: str, tp: int, wanted_tokens, context: int,
        quantization: str | None = None, variants=("plain",), running: int = 256,
        lora: tuple[int, int] | None = None):
    """Rows for the buckets of `wanted_tokens` that the server has, each variant compiled once."""
    from xlaserve.weights.loader import read_config

    args = server_args(model, tp, quantization, running, lora)
    program, shapes, description = aot.server_step(target, args)
    config, _ = read_config(args.model_path, load_format="dummy")
    print(description, flush=True)
    have = {tokens: (tokens, seqs, pages) for tokens, seqs, pages in shapes}
    missing = [t for t in wanted_tokens if t not in have]
    if missing:
        print(f"  no bucket of {missing} tokens (buckets: {sorted(have)})")
    rows = []
    for tokens, variant in [(t, v) for t in wanted_tokens if t in have for v in variants]:
        start = time.perf_counter()
        compiled = program.compile(*have[tokens], VARIANTS[variant])
        row = predict(program, compiled, target, tokens, have[tokens][1], context, config)
        row["model"], row["compile_s"] = Path(model).name, time.perf_counter() - start
        row["weight_format"] = ((quantization or DTYPE_NAMES[program.args[1][0].dtype.name])
                                + ("+L" if lora else ""))
        row["lora"] = lora
        row["variant"] = variant
        rows.append(row)
        print(f"  compiled {tokens} tokens / {row['seqs']} seqs ({variant}) in "
              f"{row['compile_s']:.0f} s", flush=True)
    return rows


def print_table(rows, context: int) -> None:
    gb = 1e9
    print(f"\nPredicted from compiled programs (not measured); attention KV read at {context} "
          "tokens of context per sequence; per device; time = max(bytes/HBM, flops/peak)")
    print(f"{'model':<13}{'target':<9}{'tp':>3}{'wts':>5}{'variant':>11}{'tokens':>7}{'seqs':>5}"
          f"{'GFLOP':>8}{'xact':>6}"
          f"{'XLA GB':>8}{'cacheW':>8}{'KV GB':>7}{'GB':>7}{'args GB':>8}{'temp GB':>8}"
          f"{'ms':>7} {'bound':<8}{'tok/s':>9}{'floor ms':>9}{'tok/s':>8}{'cond':>5}{'while':>6}{'fus':>5}{'cc':>4}"
          f"{'wcopy':>6}")
    for r in rows:
        calls = sum(r["custom_calls"].values())
        print(f"{r['model']:<13}{r['target']:<9}{r['tp']:>3}{r['weight_format']:>5}"
              f"{r['variant']:>11}{r['tokens']:>7}{r['seqs']:>5}"
              f"{r['flops'] / 1e9:>8.0f}{r['active_flops_ratio']:>6.2f}{r['xla_bytes'] / gb:>8.2f}"
              f"{r['cache_write_correction'] / gb:>8.2f}{r['kv_read'] / gb:>7.2f}"
              f"{r['bytes'] / gb:>7.2f}{r['arguments'] / gb:>8.2f}{r['temporaries'] / gb:>8.2f}"
              f"{r['seconds'] * 1e3:>7.2f} {r['bound']:<8}{r['tok_s']:>9.0f}"
              f"{r['floor_seconds'] * 1e3:>9.2f}{r['floor_tok_s']:>8.0f}"
              f"{r['conditional']:>5}{r['while']:>6}{r['fusion']:>5}{calls:>4}"
              f"{r['weight_copies']:>6}")
    print("\ncustom calls by target (first row of each target):")
    seen = set()
    for r in rows:
        if (r["target"], r["model"], r["tp"], r["weight_format"]) not in seen:
            seen.add((r["target"], r["model"], r["tp"], r["weight_format"]))
            print(f"  {r['model']} {r['target']} tp {r['tp']} {r['weight_format']}: "
                  f"{r['custom_calls']}; "
                  f"command-buffer names in the HLO: {r['command_buffers']}")


def workload(rows: list[dict], input_len: int, output_len: int, concurrency: int) -> dict:
    """Output tok/s of a serving benchmark (`concurrency` requests of `input_len` prompt and
    `output_len` output tokens, a new one starting as one ends) from the compiled decode bucket
    of `concurrency` rows and the largest prefill bucket: per request, input_len / prefill tokens
    of a prefill step and output_len / concurrency of a decode step, whose KV read is taken at
    the mean context, input_len + output_len / 2 (the rows' KV read scales with it)."""
    decode = next(r for r in rows if r["kind"] == "decode" and r["seqs"] == concurrency)
    prefill = max((r for r in rows if r["kind"] == "prefill"), key=lambda r: r["tokens"])
    bandwidth, peak = PEAKS[decode["target"]]
    context = input_len + output_len / 2
    kv_read = decode["kv_read"] * context / decode["context"]

    def step_seconds(row, kv, floor: bool):
        moved = (row["reached_weights"] if floor else row["bytes"] - row["kv_read"]) + kv
        return max(moved / bandwidth, row["flops"] / peak)

    figures = {}
    for name, floor in (("predicted", False), ("floor", True)):
        per_request = (input_len / prefill["tokens"] * step_seconds(prefill, prefill["kv_read"], floor)
                       + output_len / concurrency * step_seconds(decode, kv_read, floor))
        figures[name] = output_len / per_request
    return {"decode_ms": 1e3 * step_seconds(decode, kv_read, False), "context": context,
            "prefill_ms": 1e3 * step_seconds(prefill, prefill["kv_read"], False),
            "tok_s": figures["predicted"], "floor_tok_s": figures["floor"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also Qwen3-8B on v6e, tp 1 and 4")
    parser.add_argument("--weights", action="store_true",
                        help="Llama-3.1-8B with bf16, int8 and fp8 weights on H100, bf16 and "
                             "int8 on v6e 2x2 (tp 4), instead of the default set")
    parser.add_argument("--quantization", choices=["int8", "fp8"], help="with --target")
    parser.add_argument("--target", choices=sorted(PEAKS), help="one target instead of the set")
    parser.add_argument("--model", default="llama-3.1-8b", help="with --target: a config folder")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--tokens", default="8,256,4096", help="token buckets to compile")
    parser.add_argument("--variants", default="plain",
                        help=f"program variants to compile, of {','.join(VARIANTS)}")
    parser.add_argument("--context", type=int, default=1024,
                        help="tokens of context each sequence's attention reads (assumed)")
    parser.add_argument("--max-running-requests", type=int, default=256,
                        help="the server's, which sets the largest decode bucket")
    parser.add_argument("--lora", help="RANK,SLOTS: each run also with LoRA adapter slots on "
                                       "every module (issue 53), wts column +L")
    parser.add_argument("--workload", help="IN,OUT,CONCURRENCY: a serving benchmark's output "
                                           "tok/s from the decode bucket of CONCURRENCY rows and "
                                           "the largest prefill bucket (add both to --tokens)")
    args = parser.parse_args(argv)
    aot.use_compile_only_packages()
    if args.target:
        runs = [(args.target, args.model, args.tp_size, args.quantization)]
    elif args.weights:
        runs = WEIGHT_RUNS
    else:
        runs = [(*r, None) for r in DEFAULT_RUNS + (MORE_RUNS if args.all else [])]
    wanted = [int(t) for t in args.tokens.split(",")]
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"--variants: unknown {unknown}; of {list(VARIANTS)}")
    rows = []
    loras = [None] + ([tuple(map(int, args.lora.split(",")))] if args.lora else [])
    for (target, model, tp, quantization), lora in [(r, lo) for r in runs for lo in loras]:
        try:
            rows += run(target, model, tp, wanted, args.context, quantization, variants,
                        args.max_running_requests, lora)
        except aot.TargetUnavailable as error:
            print(f"{target}: {error}", file=sys.stderr)
    print_table(rows, args.context)
    if args.workload:
        input_len, output_len, concurrency = map(int, args.workload.split(","))
        for target, model, tp, quantization in runs:
            own = [r for r in rows if (r["target"], r["tp"]) == (target, tp)
                   and r["model"] == Path(model).name and r["lora"] is None]
            w = workload(own, input_len, output_len, concurrency)
            print(f"\n{Path(model).name} {target} tp {tp}, {input_len} in / {output_len} out, "
                  f"{concurrency} concurrent: {w['tok_s']:,.0f} output tok/s predicted "
                  f"(decode step {w['decode_ms']:.2f} ms at {w['context']:.0f} tokens of context, "
                  f"prefill step {w['prefill_ms']:.2f} ms), floor {w['floor_tok_s']:,.0f}")


if __name__ == "__main__":
    main()
