"""Predicted embeddings per second on H100 and TPU v6e (issue 54), from the compiled embedding
step (runtime/executor/embedding_step.compiled_for_target): no accelerator is used.

    .venv/bin/python benchmarks/predict_embeddings.py                  # every row below

Per model (BERT-base's shapes, 12 layers: bge-base, e5-base; Qwen3-Embedding-0.6B's: Qwen3-0.6B's
config, 28 layers) and target, one step of `--seqs` inputs of `--length` tokens (the bucket of
`--seqs` x `--length` tokens): XLA's cost analysis of the optimised program per device (flops,
bytes accessed; the deviceless GPU executable's through the CPU client's HloCostAnalysis, as
benchmarks/predict_accelerators.py), predicted time = max(bytes / HBM bandwidth, flops / peak)
with the data sheets' figures (predict_accelerators.PEAKS), embeddings/s = seqs / time. The
attention kernels are custom calls the analysis counts as nothing: added analytically (4 x
length x head dim x heads flops a token a layer; an encoder's whole input, a decoder's causal
half). Collectives and launch gaps are not in it: a lower bound on a step, not a measurement.
XLA's bytes accessed count every fusion's operands, float32 activations included: where that
makes a step memory-bound, the compute bound (flops / peak) is printed beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.predict_accelerators import roofline, xla_costs  # noqa: E402

BERT_BASE = dict(architectures=["BertModel"], model_type="bert", hidden_size=768,
                 intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 vocab_size=30522, max_position_embeddings=512, type_vocab_size=2,
                 hidden_act="gelu", layer_norm_eps=1e-12)
QWEN3_0_6B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                  intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151669,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=True, hidden_act="silu")
MODELS = {"bert-base": (BERT_BASE, "cls", True), "qwen3-embedding-0.6b": (QWEN3_0_6B, "last", False)}


def predict(target: str, model: str, tp: int, seqs: int, length: int) -> dict:
    from xlaserve.runtime.executor.embedding_step import compiled_for_target
    from xlaserve.server_args import ServerArgs

    config, mode, encoder = MODELS[model]
    folder = tempfile.mkdtemp(prefix="predict-embeddings-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    args = ServerArgs(model_path=folder, tp_size=tp, max_running_requests=seqs,
                      is_embedding=True)
    tokens = seqs * length
    compiled, _, description = compiled_for_target(target, args, mode, tokens, seqs)
    costs = xla_costs(compiled)
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    attention = 4 * length * head_dim * heads * layers * tokens * (1.0 if encoder else 0.5) / tp
    seconds, flops, bound, compute = roofline(target, costs, attention)
    return {"target": target, "model": model, "tp": tp, "seqs": seqs, "length": length,
            "description": description, "gflops": flops / 1e9, "gbytes": costs["bytes"] / 1e9,
            "bound": bound, "step_ms": seconds * 1e3, "compute_ms": compute * 1e3,
            "embeddings_per_s": seqs / seconds, "compute_bound_per_s": seqs / compute}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default="h100,v6e:2x2")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--out", help="write the rows here as JSON")
    args = parser.parse_args()
    from xlaserve.runtime.executor.aot import use_compile_only_packages

    use_compile_only_packages()
    rows = []
    for target in args.targets.split(","):
        for model in args.models.split(","):
            # Qwen3-Embedding's 151669-row embedding does not split over 4 chips (tp must divide
            # a decoder's vocabulary); BERT's is whole on every device (model/encoders/encoder.py).
            for tp in ((1, 4) if target.startswith("v6e") and model == "bert-base" else (1,)):
                row = predict(target, model, tp, args.seqs, args.length)
                rows.append(row)
                print(f"{target:8} {model:22} tp {tp}: {row['step_ms']:8.3f} ms a step "
                      f"({row['bound']}-bound, {row['gflops']:.0f} GFLOP, {row['gbytes']:.2f} GB "
                      f"per device; compute alone {row['compute_ms']:.3f} ms) -> "
                      f"{row['embeddings_per_s']:,.0f} embeddings/s "
                      f"({row['compute_bound_per_s']:,.0f} at the compute bound)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
