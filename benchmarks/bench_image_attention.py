"""Gemma 3's and Gemma 4's image tokens' attention on this platform (pallas_kernels/
ragged_paged_attention/image_spans.py): one attention layer at gemma-3-4b's shapes (8 query heads,
4 KV heads of 256, images of `--image` tokens, 256; a sliding window of 1024 or none), a step of
one prompt's `--tokens` new tokens after `--prefix` cached ones, timed three ways: the causal
kernel alone (a text model's step), with the image path and no image in the step (a text
request on an image server), and with the step's tokens all images (the most it costs).
`--fewest`: the fewest tokens an image may have (Gemma 4's: 124 of 280), which sizes the
step's image batch. Median of `--repeats` runs, ms.

    python benchmarks/bench_image_attention.py --tokens 512 --prefix 1024
    python benchmarks/bench_image_attention.py --tokens 560 --image 280 --fewest 124
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.pallas_kernels.ragged_paged_attention.image_spans import (image_span_attention,
                                                                        image_spans)
from xlaserve.runtime.executor.kernels import kernels_for

HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 4, 256, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--window", type=int, default=0, help="0: a full layer")
    parser.add_argument("--image", type=int, default=256, help="tokens an image (the most)")
    parser.add_argument("--fewest", type=int, default=0, help="0: every image --image long")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    attention = kernels_for().attention
    tokens, kv_len = args.tokens, args.prefix + args.tokens
    pages = -(-kv_len // PAGE)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((tokens, HEADS, HEAD_DIM)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((tokens, KV_HEADS, HEAD_DIM)), dtype)
            for _ in range(2))
    cache = jnp.asarray(rng.standard_normal((pages + 1, PAGE, 2 * KV_HEADS * HEAD_DIM)), dtype)
    kv_lens = jnp.asarray([kv_len], jnp.int32)
    page_indices = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
    cu_q_lens = jnp.asarray([0, tokens], jnp.int32)
    num_seqs = jnp.asarray([1], jnp.int32)
    positions = jnp.arange(args.prefix, kv_len, dtype=jnp.int32)
    window = args.window or None
    scale = HEAD_DIM ** -0.5

    def step(q, k, v, cache, ids, images: bool):
        out, cache = attention(q, k, v, cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                               sm_scale=scale, sliding_window=window)
        if images:
            spans = image_spans(ids, positions, cu_q_lens, page_indices, args.image,
                                args.fewest or None)
            out, cache = image_span_attention(attention, q, k, v, cache, out, spans,
                                              sm_scale=scale, sliding_window=window)
        return out, cache

    text = jnp.full((tokens,), 7, jnp.int32)
    all_images = -1 - jnp.arange(tokens, dtype=jnp.int32) // args.image
    cases = [("causal kernel alone", text, False), ("image path, no image", text, True),
             (f"image path, {-(-tokens // args.image)} images", all_images, True)]
    for name, ids, images in cases:
        program = jax.jit(step, static_argnums=5, donate_argnums=3)
        times = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            out, cache = program(q, k, v, cache, ids, images)
            out.block_until_ready()
            times.append(time.perf_counter() - start)
        print(f"{name:32s} {1e3 * statistics.median(times[1:]):8.2f} ms")


if __name__ == "__main__":
    main()
