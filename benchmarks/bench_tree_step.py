"""What a speculative tree row costs against a chain of as many tokens and a plain decode step,
side by side in one process: the model's serving step on hand-made batches (every row at
`--context` tokens of context, random ids), each shape's program precompiled, the median of
`--rounds` timed steps per case, cases interleaved so that the machine's drift hits all alike.

A tree step runs the attention in two parts (the kernel's prefix part and the masked tree
tokens: pallas_kernels/ragged_paged_attention/tree_tokens.py) and moves the kept path's KV;
a chain step is the causal kernel alone. The rows keep nothing here (random drafts), so the
move is of nothing; what is measured is the attention's and the step's cost.

    .venv/bin/python benchmarks/bench_tree_step.py                 # the embedded model, CPU
    python benchmarks/bench_tree_step.py --model-path benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --seqs 1,32                            # an accelerator
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

# Root, two children; a child under each; one more under the first: 6 tokens, depth 3.
TREE = [-1, 0, 0, 1, 2, 3]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the embedded model")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seqs", default="1,16", help="sequences per step")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    from xlaserve.runtime.executor.buckets import buckets_for_limits, pow2_buckets
    from xlaserve.runtime.executor.forward_batch import make_forward_batch
    from xlaserve.runtime.executor.model_runner import ModelRunner
    from xlaserve.runtime.executor.step_inputs import greedy_sampling
    from xlaserve.runtime.scheduler.page_allocator import pages_for_tokens
    from xlaserve.runtime.scheduler.request import SeqChunk
    from xlaserve.weights.loader import load_model

    loaded = load_model(args.model_path, dtype=args.dtype, load_format=args.load_format,
                        skip_tokenizer_init=True, progress=False)
    seq_counts = [int(s) for s in args.seqs.split(",")]
    most = max(seq_counts) * len(TREE)
    page_size = 16
    pages_per_seq = pages_for_tokens(args.context + len(TREE), page_size)
    runner = ModelRunner(loaded, num_pages=1 + most * pages_per_seq, page_size=page_size,
                         max_running_requests=most, verify_tokens=len(TREE))
    # Every power of two from 1 (the CPU's buckets): a decode row is not padded to 8 tokens.
    buckets = buckets_for_limits(most, most, pages_per_seq, token_paddings=pow2_buckets(1, most),
                                 page_paddings=[pages_per_seq], verify_tokens=len(TREE),
                                 tree=True)
    runner.max_seqs = buckets.seqs[-1]
    runner.precompile(buckets.all_shapes(), tree_shapes=buckets.tree_shapes(),
                      tree_width=buckets.tree_width, progress=False)
    rng = np.random.default_rng(0)
    vocab = loaded.config.vocab_size

    def batch(kind: str, seqs: int):
        tokens = 1 if kind == "decode" else len(TREE)
        chunks = []
        for i in range(seqs):
            ids = rng.integers(3, vocab, tokens).tolist()
            if kind == "tree":
                ids[1] = (ids[2] + 1) % vocab  # siblings distinct
            pages = list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq))
            chunks.append(SeqChunk(ids, args.context, pages, num_drafts=tokens - 1,
                                   tree_parents=TREE if kind == "tree" else None))
        fb = make_forward_batch(chunks, buckets, page_size)
        slots = np.zeros(fb.shape[1], np.int32)
        slots[:seqs] = np.arange(1, seqs + 1)
        return fb, greedy_sampling(fb.num_sample_rows), slots

    cases = [(kind, seqs) for seqs in seq_counts for kind in ("decode", "chain", "tree")]
    batches = {case: batch(*case) for case in cases}
    times = {case: [] for case in cases}
    compiled = runner.compile_count()
    for case in cases:  # warm-up
        jax.block_until_ready(runner.step(*batches[case]).sample.tokens)
    for _ in range(args.rounds):
        for case in cases:
            start = time.perf_counter()
            jax.block_until_ready(runner.step(*batches[case]).sample.tokens)
            times[case].append(time.perf_counter() - start)
    assert runner.compile_count() == compiled, "a case compiled after precompile"
    rows = []
    for seqs in seq_counts:
        ms = {kind: statistics.median(times[(kind, seqs)]) * 1e3
              for kind in ("decode", "chain", "tree")}
        rows.append({"seqs": seqs, "tokens_a_row": len(TREE), "context": args.context,
                     **{f"{k}_ms": v for k, v in ms.items()},
                     "tree_vs_chain": ms["tree"] / ms["chain"],
                     "tree_vs_decode": ms["tree"] / ms["decode"]})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'seqs':>5} {'decode ms':>10} {'chain ms':>9} {'tree ms':>8} {'tree/chain':>11} "
          f"{'tree/decode':>12}")
    for r in rows:
        print(f"{r['seqs']:>5} {r['decode_ms']:>10.2f} {r['chain_ms']:>9.2f} {r['tree_ms']:>8.2f} "
              f"{r['tree_vs_chain']:>10.2f}x {r['tree_vs_decode']:>11.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
