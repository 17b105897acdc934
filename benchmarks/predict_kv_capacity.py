"""How many 4K-context requests fit at once with a bfloat16 and with an FP8 KV cache (issue 56),
predicted for one H100 (80 GB), one TPU v6e chip (32 GB) and four v5e chips (16 GB each,
tensor parallel: Llama-3.1-8B's 16 GB of weights do not fit one), from the compiled serving
steps of Llama-3.1-8B (no accelerator is used):

    .venv/bin/python benchmarks/predict_kv_capacity.py        # H100 needs JAX 0.11
    .venv/bin/python benchmarks/predict_kv_capacity.py --targets v6e,v5e

Per device: the memory a server gives its weights and KV pool (SGLang's --mem-fraction-static,
0.9 of what XLA may allocate, as xlaserve's default; an H100's XLA limit is 95% of it) less the
weights (the compiled step's argument sizes) and the largest step's temporaries (its memory
analysis, the 4096-token prefill bucket) is the pool; a token's K and V across the layers is
`kv_pool.bytes_per_token` / tp (an FP8 entry is one byte, bfloat16's two), and a request that
reaches 4096 tokens holds 4096 of them. The decode step at that many requests (or the server's
most, 256) reads every request's 4096 tokens of K and V: its time is the roofline's
(predict_accelerators.predict, with the KV read added analytically), so FP8 also halves that
read. A prediction, not a measurement.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.predict_accelerators import CONFIGS, predict  # noqa: E402

# target: (compile-only topology, tp, bytes of HBM a device has, XLA's share of it)
TARGETS = {"h100": ("h100", 1, 80e9, 0.95), "v6e": ("v6e:2x2", 1, 32e9, 1.0),
           "v5e": ("v5e:2x2", 4, 16e9, 1.0)}
MEM_FRACTION = 0.9  # platform_defaults.ACCELERATOR_MEM_FRACTION
CONTEXT = 4096
RUNNING = 256  # the accelerators' default --max-running-requests


def capacity(target: str, kv_cache_dtype: str, model: str = "llama-3.1-8b") -> dict:
    from xlaserve.runtime.executor import aot
    from xlaserve.runtime.executor.kv_pool import bytes_per_token
    from xlaserve.server_args import ServerArgs
    from xlaserve.weights.loader import read_config

    topology, tp, hbm, xla_share = TARGETS[target]
    args = ServerArgs(model_path=str(CONFIGS / model), tp_size=tp, max_running_requests=RUNNING,
                      max_prefill_tokens=4096, kv_cache_dtype=kv_cache_dtype,
                      context_length=CONTEXT)
    program, shapes, description = aot.server_step(topology, args)
    config, _ = read_config(args.model_path, load_format="dummy")
    weights = sum(leaf.size * leaf.dtype.itemsize for leaf in program.args[0]) / tp
    prefill = max(shapes)  # the largest bucket: the most temporaries
    temporaries = program.compile(*prefill).memory_analysis().temp_size_in_bytes
    kv_dtype = program.args[1][0].dtype
    per_token = bytes_per_token(config, kv_dtype, "tpu" if target.startswith("v") else "gpu") / tp
    pool = hbm * xla_share * MEM_FRACTION - weights - temporaries
    tokens = int(pool // per_token)
    requests = tokens // CONTEXT
    seqs = max(s for t, s, _ in shapes if t == s and s <= max(min(requests, RUNNING), 1))
    decode = next(shape for shape in shapes if shape[0] == shape[1] == seqs)
    row = predict(program, program.compile(*decode), topology, seqs, seqs, CONTEXT, config)
    return {"target": target, "tp": tp, "kv": kv_dtype.name, "weights_gb": weights / 1e9,
            "temporaries_gb": temporaries / 1e9, "pool_gb": pool / 1e9, "tokens": tokens,
            "requests": requests, "decode_seqs": seqs, "decode_ms": row["seconds"] * 1e3,
            "decode_tok_s": row["tok_s"], "kv_read_gb": row["kv_read"] / 1e9,
            "description": description}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="h100,v6e,v5e",
                        help=f"of {','.join(TARGETS)} (H100 needs JAX 0.11's CUDA plugin)")
    args = parser.parse_args(argv)
    from xlaserve.runtime.executor import aot

    aot.use_compile_only_packages()
    rows = []
    for target in args.targets.split(","):
        for kv_cache_dtype in ("auto", "fp8_e4m3"):
            try:
                rows.append(capacity(target, kv_cache_dtype))
                print(rows[-1]["description"], flush=True)
            except aot.TargetUnavailable as error:
                print(f"{target}: {error}", file=sys.stderr)
    print("\nLlama-3.1-8B, bfloat16 weights, 4096-token requests; per device; predicted")
    print("| target | KV cache | weights GB | step temporaries GB | KV pool GB | tokens | "
          "4K requests | decode step (rows) | decode tok/s | KV read a step GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['target']} tp {r['tp']} | {r['kv']} | {r['weights_gb']:.2f} | "
              f"{r['temporaries_gb']:.2f} | {r['pool_gb']:.2f} | {r['tokens']:,} | "
              f"{r['requests']} | {r['decode_ms']:.2f} ms ({r['decode_seqs']}) | "
              f"{r['decode_tok_s']:,.0f} | {r['kv_read_gb']:.2f} |")


if __name__ == "__main__":
    main()
