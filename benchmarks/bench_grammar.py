"""Host cost of structured outputs per decode step: for B constrained rows, each grammar consumes
its row's sampled token (the scheduler's work) and the step's bitmask is allocated and filled
(the engine's `empty_bitmask` + `fill_masks`), on the default model's tokenizer.

    .venv/bin/python benchmarks/bench_grammar.py                 # B = 1, 16, 64; ~20 s
    .venv/bin/python benchmarks/bench_grammar.py --batch 1,16,64,256 --steps 400 --json

Rows follow sequences their grammar accepts: at each step a row's token is drawn at random
(seeded) from the tokens its mask allows, as a sampler at high temperature would, with the end-of-
text ids left out while anything else is allowed (as a benchmark's `logit_bias` bans them); a row
whose grammar completes starts over on a fresh matcher (a new request). Only consume + bitmask are
timed, not the drawing. Grammars: benchmarks/schemas/long_records.json (nested records, arrays,
enums, numbers), a small flat JSON schema, a regex and a recursive GBNF grammar.

Also reported, once per grammar: its first compile (then cached by text) and a new request's
matcher (a copy of the cached one).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
# CSV-like lines, as a Python user writes a regex.
REGEX = r"(\w{1,12},\d{1,5},(true|false),[A-Z][a-z]{0,10}\n){1,100}"
# Arithmetic expressions: recursion, character classes, repetition (the GBNF of SGLang's docs).
EBNF = r'''root ::= expr
expr ::= term (ws ("+" | "-") ws term)*
term ::= factor (ws ("*" | "/") ws factor)*
factor ::= number | "(" ws expr ws ")"
number ::= "-"? [0-9]+ ("." [0-9]+)?
ws ::= " "?
'''


def grammars() -> dict[str, tuple[str, str]]:
    with open(os.path.join(HERE, "schemas", "long_records.json")) as f:
        long_records = json.dumps(json.load(f))
    return {"json long_records": ("json_schema", long_records),
            "json small": ("json_schema", json.dumps(SMALL_SCHEMA)),
            "regex csv": ("regex", REGEX),
            "ebnf arithmetic": ("ebnf", EBNF)}


def draw(bitmask_row: np.ndarray, vocab_size: int, stop_ids: set[int],
         rng: np.random.Generator) -> int:
    """A token uniformly at random among those the row allows, a stop id only where nothing else
    is allowed: rejection sampling (quick where the mask is dense, as inside a string), then
    the whole row unpacked (a sparse mask, e.g. only "{")."""
    for token in rng.integers(0, vocab_size, 64).tolist():
        if token not in stop_ids and (int(bitmask_row[token >> 5]) >> (token & 31)) & 1:
            return token
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    choices = np.flatnonzero(bits)
    others = [t for t in choices.tolist() if t not in stop_ids]
    return int(rng.choice(others or choices))


def run_case(backend, kind: str, text: str, rows: int, steps: int, warmup: int,
             stop_ids: set[int], rng: np.random.Generator) -> dict:
    """Per-step host microseconds for `rows` constrained rows over `steps` timed steps."""
    grammars = [backend.new_grammar(kind, text) for _ in range(rows)]
    bitmask = backend.empty_bitmask(rows)
    backend.fill_masks([(g, i) for i, g in enumerate(grammars)], bitmask)
    consume_us, fill_us, restarts, rejected = [], [], 0, 0
    for step in range(warmup + steps):
        tokens = [draw(bitmask[i], backend.vocab_size, stop_ids, rng)  # the sampler (not timed)
                  for i in range(rows)]
        t0 = time.perf_counter()
        for grammar, token in zip(grammars, tokens):  # the scheduler
            if not grammar.consume(token):
                rejected += 1
        t1 = time.perf_counter()
        for i, (grammar, token) in enumerate(zip(grammars, tokens)):  # finished: a new request
            if token in stop_ids or grammar.is_stopped():
                grammars[i] = backend.new_grammar(kind, text)
                restarts += 1
        t2 = time.perf_counter()
        bitmask = backend.empty_bitmask(rows)  # the engine's step
        backend.fill_masks([(g, i) for i, g in enumerate(grammars)], bitmask)
        t3 = time.perf_counter()
        if step >= warmup:
            consume_us.append((t1 - t0) * 1e6)
            fill_us.append((t3 - t2) * 1e6)
    total = np.add(consume_us, fill_us)
    return {"rows": rows, "steps": steps,
            "mean_us": round(float(total.mean()), 1), "p50_us": round(float(np.median(total)), 1),
            "p99_us": round(float(np.percentile(total, 99)), 1),
            "mean_consume_us": round(float(np.mean(consume_us)), 1),
            "mean_fill_us": round(float(np.mean(fill_us)), 1),
            "mean_us_per_row": round(float(total.mean()) / rows, 2),
            "restarts": restarts, "rejected": rejected}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,16,64", help="comma-separated numbers of constrained rows")
    parser.add_argument("--steps", type=int, default=150, help="timed decode steps per case")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--only", default=None, help="run the grammars whose name contains this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from xlaserve.weights.loader import default_model_file, load_tokenizer, read_config
    from xlaserve.runtime.sampling.grammar import GrammarBackend

    config, _ = read_config(None, "auto")
    tokenizer = load_tokenizer(default_model_file())
    stop_ids = set(config.eos_token_ids) | ({tokenizer.eos_token_id} - {None})
    backend = GrammarBackend(tokenizer, config.vocab_size, sorted(stop_ids))
    start = time.perf_counter()
    backend.token_table()
    setup = {"vocab_size": config.vocab_size, "tokenizer_tokens": len(tokenizer),
             "token_table_ms": round((time.perf_counter() - start) * 1e3, 1),
             "threads": os.cpu_count()}
    print(f"setup: {setup}", file=sys.stderr)
    batches = [int(b) for b in args.batch.split(",")]
    results = []
    for name, (kind, text) in grammars().items():
        if args.only and args.only not in name:
            continue
        start = time.perf_counter()
        backend.compile(kind, text)
        compile_ms = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        for _ in range(100):
            backend.new_grammar(kind, text)
        new_us = (time.perf_counter() - start) * 1e6 / 100
        for rows in batches:
            rng = np.random.default_rng([args.seed, rows])
            stats = run_case(backend, kind, text, rows, args.steps, args.warmup, stop_ids, rng)
            row = {"grammar": name, "kind": kind, "compile_ms": round(compile_ms, 2),
                   "new_request_us": round(new_us, 1), **stats}
            print(row, file=sys.stderr)
            results.append(row)
    if args.json:
        print(json.dumps({"setup": setup, "results": results}))
        return
    columns = [("rows", 5), ("mean_us", 10), ("p50_us", 10), ("p99_us", 10), ("mean_consume_us", 16),
               ("mean_fill_us", 13), ("mean_us_per_row", 16), ("compile_ms", 11), ("new_request_us", 15),
               ("restarts", 9)]
    print(f"\n{'grammar':<18}" + "".join(f"{c:>{w}}" for c, w in columns))
    for row in results:
        print(f"{row['grammar']:<18}" + "".join(f"{row[c]:>{w}}" for c, w in columns))
    print(f"\n(us per decode step: every row consumes its token, then the step's bitmask is "
          f"allocated and filled; token table built once in {setup['token_table_ms']} ms)")
    if any(row["rejected"] for row in results):
        print("WARNING: grammars rejected tokens their own mask allowed", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
