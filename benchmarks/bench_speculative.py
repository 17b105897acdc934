"""Speculative decoding against plain decoding, side by side in one process: the same model
twice, one engine with `--speculative-algorithm` (NGRAM by default) and one without, their runs
alternated. `--algorithm EAGLE3 --random-eagle3-head` gives the model a random EAGLE-3 head
(random_heads.py), whose drafts are noise: it measures what a head costs where it never helps.

Two workloads through the model's chat template, greedy (so the texts must be identical):
  copy  the model repeats a passage of its prompt (what n-gram drafting is for: edits, quotes,
        code rewrites);
  chat  a short story, where little of the output is in the prompt.
Single stream: decode tokens/s of one request at a time (tokens after the first over the time
after the first), the median of `--rounds`; then `--concurrency` requests at once: output
tokens/s of the whole run. Each row gives the mean tokens a verified row kept
(meta_info `spec_accept_length`).

    .venv/bin/python benchmarks/bench_speculative.py                 # the embedded model
    .venv/bin/python benchmarks/bench_speculative.py --concurrency 16,64 --max-new-tokens 128
    .venv/bin/python benchmarks/bench_speculative.py --algorithm EAGLE3 --random-eagle3-head
    .venv/bin/python benchmarks/bench_speculative.py --algorithm EAGLE3 --random-eagle3-head \
        --eagle-topk 2 --num-steps 3                                # a tree's cost
    python benchmarks/bench_speculative.py --model-path benchmarks/configs/llama-3.1-8b \
        --load-format dummy --algorithm EAGLE3 \
        --draft-model-path benchmarks/configs/eagle3-llama-3.1-8b      # a GPU: the head's cost
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import numpy as np

PASSAGE = (
    "A paged KV cache stores the keys and values of every sequence in fixed-size pages drawn "
    "from one shared pool, so that memory is allocated as a sequence grows rather than reserved "
    "for the longest sequence the server might see. Each sequence keeps a page table, a list of "
    "the pages that hold its tokens in order, and the attention kernel reads the pages through "
    "that table. When a request finishes, its pages go back to the pool, or stay in a prefix "
    "cache when later prompts may begin with the same tokens. Continuous batching then adds new "
    "requests to the running batch at every step, and a prompt that is too long for one step is "
    "split into chunks that run beside the decoding requests.")
WORKLOADS = {
    "copy": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "chat": "Write a short story about a robot who learns to paint.",
}


def prompt_ids(engine, text: str) -> list[int]:
    """The workload's prompt through the chat template; with dummy weights (no tokenizer), 128
    random token ids (the text is noise then; what is measured is what the steps cost)."""
    tokenizer = engine.core.tokenizer
    if tokenizer is None:
        rng = np.random.default_rng(len(text))
        return rng.integers(3, engine.core.loaded.config.vocab_size, 128).tolist()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


async def single_stream(engine, ids: list[int], params: dict) -> dict:
    stream = await engine.async_generate(input_ids=ids, sampling_params=params, stream=True)
    tokens, first, meta = [], None, {}
    async for chunk in stream:
        if first is None:
            first = time.perf_counter()
        tokens += chunk["output_ids"]
        meta = chunk.get("meta_info", meta)
    seconds = time.perf_counter() - first
    return {"tokens": tokens, "decode_tok_s": (len(tokens) - 1) / seconds,
            "accept_length": meta.get("spec_accept_length")}


def concurrent(engine, ids: list[int], params: dict, count: int) -> dict:
    start = time.perf_counter()
    results = engine.generate(input_ids=[ids] * count, sampling_params=params)
    seconds = time.perf_counter() - start
    made = sum(len(r["output_ids"]) for r in results)
    lengths = [r["meta_info"].get("spec_accept_length") for r in results]
    lengths = [x for x in lengths if x is not None]
    return {"output_tok_s": made / seconds,
            "accept_length": statistics.mean(lengths) if lengths else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the embedded model")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    parser.add_argument("--eagle-topk", type=int, default=None,
                        help="EAGLE3: > 1 drafts trees (--speculative-eagle-topk)")
    parser.add_argument("--num-steps", type=int, default=None,
                        help="EAGLE3 / NEXTN: --speculative-num-steps (a tree's depth)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights (a config's shapes), random token prompts")
    parser.add_argument("--algorithm", default="NGRAM",
                        choices=["NGRAM", "STANDALONE", "EAGLE3", "NEXTN"])
    parser.add_argument("--draft-model-path", default=None,
                        help="STANDALONE's draft model, EAGLE3's head")
    parser.add_argument("--random-eagle3-head", action="store_true",
                        help="EAGLE3 with a random head for the model (its cost, no gain)")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    import xlaserve

    options = dict(model_path=args.model_path, dtype=args.dtype, log_level="warning",
                   load_format=args.load_format,
                   skip_tokenizer_init=args.load_format == "dummy")
    engines = {"plain": xlaserve.Engine(**options)}
    draft_path = args.draft_model_path
    if args.random_eagle3_head:
        from random_heads import write_random_eagle3_head

        c = engines["plain"].core.loaded.config
        draft_path = tempfile.mkdtemp(prefix="random-eagle3-")
        write_random_eagle3_head(draft_path, hidden=c.hidden_size, heads=c.num_heads,
                                 kv_heads=c.num_kv_heads, vocab=c.vocab_size,
                                 intermediate=c.intermediate_size)
    engines["spec"] = xlaserve.Engine(**options, speculative_algorithm=args.algorithm,
                                      speculative_draft_model_path=draft_path,
                                      speculative_num_draft_tokens=args.num_draft_tokens,
                                      speculative_eagle_topk=args.eagle_topk,
                                      speculative_num_steps=args.num_steps)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0,
              "ignore_eos": args.load_format == "dummy"}  # random weights: every run full length
    rows = []
    try:
        for name, text in WORKLOADS.items():
            ids = prompt_ids(engines["plain"], text)
            runs = {key: [] for key in engines}
            for _ in range(args.rounds):  # alternated: the machine's drift hits both alike
                for key, engine in engines.items():
                    runs[key].append(asyncio.run(single_stream(engine, ids, params)))
            texts = {key: runs[key][0]["tokens"] for key in engines}
            row = {"workload": name, "mode": "single stream", "prompt_tokens": len(ids),
                   "output_tokens": len(texts["plain"]),
                   "identical": texts["plain"] == texts["spec"]}
            for key in engines:
                row[f"{key}_tok_s"] = statistics.median(r["decode_tok_s"] for r in runs[key])
            row["accept_length"] = runs["spec"][0]["accept_length"]
            row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            for count in map(int, args.concurrency.split(",")):
                row = {"workload": name, "mode": f"{count} concurrent"}
                for key, engine in engines.items():
                    result = concurrent(engine, ids, params, count)
                    row[f"{key}_tok_s"] = result["output_tok_s"]
                    if key == "spec":
                        row["accept_length"] = result["accept_length"]
                row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    print(f"\n{args.algorithm}\n{'workload':<9} {'mode':<15} {'plain tok/s':>12} {'spec tok/s':>12} "
          f"{'speedup':>8} {'accept len':>10} identical")
    for row in rows:
        accept = f"{row['accept_length']:.2f}" if row.get("accept_length") else "-"
        print(f"{row['workload']:<9} {row['mode']:<15} {row['plain_tok_s']:>12.1f} "
              f"{row['spec_tok_s']:>12.1f} {row['speedup']:>7.2f}x {accept:>10} "
              f"{row.get('identical', '')}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
