"""A hybrid linear-attention model's decode step against a pure-attention model of the same width,
at long contexts (issue 76): the point of Gated DeltaNet layers is that their cost per token does
not grow with the context, where attention's read of the KV cache does.

Two models with dummy weights, side by side in one process (runs alternate, medians reported):
a Qwen3.5-style hybrid (three Gated DeltaNet layers, then a gated full-attention layer, x3) and a
Qwen3 of the same width, layers, heads and MLP (every layer full attention). Each decode step runs
`--batch` sequences whose caches hold `--contexts` tokens (the pages' contents are not read for
their values: the step's cost is the same), through the forward the server runs (weights packed
for the native GEMM on a CPU).

    .venv/bin/python benchmarks/bench_hybrid_decode.py --contexts 4096 16384 --batch 1 8
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.greedy_driver import PagedBatch, make_forward  # noqa: E402
from xlaserve.model.weight_types.packed import pack_model  # noqa: E402
from xlaserve.runtime.executor.kv_pool import init_kv_pool  # noqa: E402
from xlaserve.weights.loader import load_model  # noqa: E402

SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
             num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=32000,
             rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True)
MODELS = {
    "hybrid": dict(SHAPE, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text",
                   layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3,
                   linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
                   linear_value_head_dim=128, linear_conv_kernel_dim=4,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                    "partial_rotary_factor": 0.25}),
    "attention": dict(SHAPE, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                      rope_theta=1e7),
}


def _model(name: str, directory: Path, dtype: str, pack: bool):
    folder = directory / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MODELS[name]))
    loaded = load_model(str(folder), dtype=dtype, load_format="dummy", skip_tokenizer_init=True,
                        progress=False)
    if pack:
        pack_model(loaded.model, loaded.config.tie_word_embeddings)
    return loaded


def _step_time(loaded, context: int, batch_size: int, page_size: int, repeats: int):
    """Median seconds of a decode step of `batch_size` sequences at `context` tokens."""
    batch = PagedBatch(batch_size, context // page_size + 1, page_size)
    caches = init_kv_pool(loaded.config, batch.num_pages, page_size, loaded.dtype, loaded.mesh,
                          state_slots=batch.num_slots)
    forward = make_forward(loaded.model)
    _, state = nnx.split(loaded.model)
    times = []
    for _ in range(repeats + 1):  # the first compiles
        batch.lengths[:] = context
        ids, positions, metadata, rows, _ = batch.step_inputs([[7]] * batch_size)
        start = time.perf_counter()
        logits, caches = forward(state, ids, positions, caches, metadata, rows)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-pack", action="store_true", help="XLA's dots, not the native GEMM")
    args = parser.parse_args()
    pack = not args.no_pack and jax.default_backend() == "cpu"
    with tempfile.TemporaryDirectory() as directory:
        models = {name: _model(name, Path(directory), args.dtype, pack) for name in MODELS}
        print(f"{jax.devices()[0].device_kind}, {args.dtype}, "
              f"{'packed' if pack else 'XLA dots'}; medians of {args.repeats} decode steps (ms)")
        for context in args.contexts:
            for batch_size in args.batch:
                ms = {name: 1e3 * _step_time(loaded, context, batch_size, args.page_size,
                                             args.repeats) for name, loaded in models.items()}
                print(f"  context {context:6d}, {batch_size:3d} sequences: hybrid "
                      f"{ms['hybrid']:8.2f}  attention {ms['attention']:8.2f}  "
                      f"ratio {ms['hybrid'] / ms['attention']:.3f}")


if __name__ == "__main__":
    main()
