"""What the compiled serving step does per step on one H100, counted from XLA's optimised program
(benchmarks/predict_accelerators.py, issue 33 item 1): the host decisions in it and the bytes it
moves. Llama-3.1-8B's config.json gives the shapes; no weights are read, no GPU is used. One
bucket (8 tokens, 8 sequences, the smallest decode bucket) keeps the cost to one ~20 s compile.
"""
from pathlib import Path

from benchmarks.predict_accelerators import predict, server_args
from tests.compile_targets import devices
from xlaserve.executor import aot
from xlaserve.model.loader import read_config

# The conditionals in the step today. On a GPU each one copies its predicate to the host and
# waits between kernels (a host sync); issue 33 item 2 removes them, and this pin goes down then.
#   sample(): all rows greedy? (skips the random draw), any row wants logprobs?
#   sample()/_draw: any row truncates? (top_k/top_p/min_p); truncate: exact thresholds found?
#   penalized_logits(): any grammar mask?  any penalty?
#   step: any prompt-logprobs target? (runs the LM head over every row)
CONDITIONALS = 7
# The while loops: truncation's two 32-step bisections (kth key, top-p key), inside the
# truncation branch, and two searchsorted scans (the attention's work items: which sequence
# each token and row belongs to).
WHILE_LOOPS = 4


def test_llama_8b_h100_decode_step_keeps_its_host_decisions_and_reads_each_weight_once():
    devices("h100")  # skips where the CUDA plugin is absent
    args = server_args("llama-3.1-8b", tp=1)
    program, shapes, description = aot.server_step("h100", args)
    tokens, seqs, pages = shapes[0]
    assert (tokens, seqs) == (8, 8), description
    config, _ = read_config(args.model_path, load_format="dummy")
    row = predict(program, program.compile(tokens, seqs, pages), "h100", tokens, seqs,
                  context=1024, config=config)

    assert (row["conditional"], row["while"]) == (CONDITIONALS, WHILE_LOOPS), row
    # One in-place update per layer's cache, none copied whole.
    assert row["cache_writes"] == config.num_layers, row

    # XLA's bytes, the caches' updates counted as the rows written, against each weight read
    # once plus two tables the analysis charges whole: the embedding (a gather of 8 rows is
    # charged the table) and the LM head again (the prompt-logprobs branch, charged though a
    # plain decode step does not take it). Today the ratio is ~1.0; a weight read twice
    # (16 GB more) or a cache copied whole (0.27 GB per layer) puts it far over 1.1.
    table_bytes = config.vocab_size * config.hidden_size * 2  # bfloat16
    expected = row["weights"] + 2 * table_bytes
    moved = row["xla_bytes"] + row["cache_write_correction"]
    assert 0.9 * expected < moved < 1.1 * expected, (moved / 1e9, expected / 1e9)
    # The flops: two per parameter per token (the embedding does none, the LM head is charged
    # twice as above), within the attention's, norms' and sampler's few more.
    flops = 2 * tokens * row["weights"] / 2  # bfloat16: two bytes a parameter
    assert 0.95 * flops < row["flops"] < 1.1 * flops, (row["flops"] / 1e9, flops / 1e9)
