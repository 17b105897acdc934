"""What the compiled serving step does per step on one H100, counted from XLA's optimised program
(benchmarks/predict_accelerators.py, issue 33 item 1): the host decisions in it and the bytes it
moves. Llama-3.1-8B's config.json gives the shapes; no weights are read, no GPU is used. One
bucket (8 tokens, 8 sequences, the smallest decode bucket) in two of the accelerator's program
variants (runtime/sampling/step_needs.py): plain (greedy rows, nothing else) and everything (every
sampler part and the prompt logprobs' LM head), ~30 s of compile each. On TPU v6e, that no
weight is relaid out every step. And for mixtures of experts (issue 51): on an H100 only the
routed experts are multiplied, on v6e their weights are read in place.
"""
import dataclasses
import math
import re

import pytest

from benchmarks.predict_accelerators import predict, server_args, weight_copies
from tests.compile_targets import devices, first_layers
from xlaserve.runtime.executor import aot
from xlaserve.weights.loader import read_config
from xlaserve.runtime.sampling.step_needs import EVERYTHING, PLAIN

# The conditionals in a step: on a GPU each one copies its predicate to the host and waits
# between kernels (a host sync). None since issue 33 item 2: the host picks a program variant
# with or without each part (penalties, grammar mask, random draw, truncation, logprobs, prompt
# logprobs) instead of 7 lax.conds on device data.
CONDITIONALS = 0
# The while loops of the plain variant: none. The attention's two searchsorted scans (which
# sequence each token and work item belongs to; once per step, not per layer: XLA's CSE) were
# while loops until they became unrolled binary searches (reference.searchsorted_right).
WHILE_LOOPS = 0
# + in a variant with truncation: its exact search's two loops (top_k's and top_p's key), 8
# passes each, of a trip count XLA knows (no predicate read on the host).
TRUNCATION_WHILE_LOOPS = 2


@pytest.mark.parametrize("variant", ["plain", "everything"])
def test_llama_8b_h100_decode_step_makes_no_host_decision_and_reads_each_weight_once(variant):
    devices("h100")  # skips where the CUDA plugin is absent
    args = server_args("llama-3.1-8b", tp=1)
    program, shapes, description = aot.server_step("h100", args)
    tokens, seqs, pages = shapes[0]
    assert (tokens, seqs) == (8, 8), description
    config, _ = read_config(args.model_path, load_format="dummy")
    needs = PLAIN if variant == "plain" else EVERYTHING
    compiled = program.compile(tokens, seqs, pages, needs)
    row = predict(program, compiled, "h100", tokens, seqs, context=1024, config=config)

    loops = WHILE_LOOPS + (TRUNCATION_WHILE_LOOPS if needs.truncation else 0)
    assert (row["conditional"], row["while"]) == (CONDITIONALS, loops), row
    assert compiled.as_text().count('"known_trip_count"') >= TRUNCATION_WHILE_LOOPS * needs.truncation
    # One in-place update per layer's cache (by the attention kernel itself in a decode
    # bucket), none copied whole.
    assert row["cache_writes"] == config.num_layers, row

    # XLA's bytes, the caches' updates counted as the rows written, against each weight read
    # once plus the tables the analysis charges whole: the embedding (a gather of 8 rows is
    # charged the table) and, in the variant with prompt logprobs, the LM head again (over every
    # token row). Today the ratio is ~1.0; a weight read twice (16 GB more) or a cache copied
    # whole (0.27 GB per layer) puts it far over 1.1.
    table_bytes = config.vocab_size * config.hidden_size * 2  # bfloat16
    lm_head_again = 1 if needs.prompt_logprobs else 0
    expected = row["weights"] + (1 + lm_head_again) * table_bytes
    moved = row["xla_bytes"] + row["cache_write_correction"]
    assert 0.9 * expected < moved < 1.1 * expected, (moved / 1e9, expected / 1e9)
    # The flops: two per parameter per token (the embedding does none, the LM head again in the
    # variant with prompt logprobs), within the attention's, norms' and sampler's few more.
    flops = 2 * tokens * (row["weights"] + (lm_head_again - 1) * table_bytes) / 2  # 2 B a param
    assert 0.95 * flops < row["flops"] < 1.1 * flops, (row["flops"] / 1e9, flops / 1e9)


@pytest.mark.parametrize("layers", [2, pytest.param(None, marks=pytest.mark.slow)],
                         ids=["2-layers", "whole"])
def test_llama_8b_v6e_decode_step_relays_out_no_weight(layers, tmp_path):
    """With the default layouts the v6e step (tp 4) relaid each layer's qkv and gate_up weights
    out for the MXU every step (64 copies, fused into the matmuls' operands); with the layouts
    XLA chose at the first compile, which a server stores its weights in (weight_args.py), none.
    One bucket, the smallest decode one, ~25-40 s of compile for the whole model; CI compiles
    its first 2 layers (compile_targets.first_layers: every layer is laid out alike)."""
    devices("v6e:2x2")  # skips where libtpu is absent
    args = dataclasses.replace(server_args("llama-3.1-8b", tp=4),
                               model_path=first_layers("llama-3.1-8b", layers, tmp_path))
    program, shapes, description = aot.server_step("v6e:2x2", args)
    weights = program.args[0]
    compiled = program.compile(*shapes[0], PLAIN)
    assert not weight_copies(compiled.as_text(), weights), description
    # The program takes the weights in the layouts it chose; later compiles keep them.
    chosen = [arg.format for arg in program.args[0]]
    assert chosen == compiled.input_formats[0][0], description
    assert any(f.layout is not None for f in chosen) and program.choosing_step is None


def test_weight_copies_finds_a_weight_relaid_inside_a_matmul_fusion():
    """The count sees a relayout XLA fuses into the matmul that reads the weight (a copy fusion
    nested in the convolution fusion), as in the v6e step with default layouts."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    _, found = devices("v6e:2x2")
    mesh = Mesh(np.array(found).reshape(4), ("tp",))
    qkv = jax.ShapeDtypeStruct((4096, 8, 6, 128), jnp.bfloat16,
                               sharding=NamedSharding(mesh, P(None, "tp")))
    rows = jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    project = jax.jit(lambda w, x: jnp.einsum("th,hkdn->tkdn", x, w))
    hlo = project.trace(qkv, rows).lower().compile().as_text()
    assert weight_copies(hlo, [qkv]) == ["4096,2,6,128"]


@pytest.mark.parametrize("layers", [2, pytest.param(None, marks=pytest.mark.slow)],
                         ids=["2-layers", "whole"])
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v2-lite"])
def test_moe_steps_on_an_h100_multiply_only_the_routed_experts(model, layers, tmp_path):
    """Issue 51: XLA lowered the experts' ragged_dot for GPU to a dense dot over every expert
    (E / top_k times their FLOPs: 128 / 8, 32 / 4, 64 / 6; the step's FLOPs over 2 x active
    parameters x tokens were 23.6, 8.4 and 9.8 at the 256-row decode of the first 2 layers); the
    GPU grouped matmul (pallas_kernels/grouped_matmul_gpu.py) multiplies routed rows only. At the
    256-row decode and 4096-token prefill buckets, the step's FLOPs (the kernel's expected of a
    uniform routing) over 2 x active parameters x tokens (the LM head's for the rows with logits),
    and the kernel's over the routed experts' own: <= 1.5. Two grouped matmuls per MoE layer,
    and no while loop (the visits' searchsorted compares all).
    CI compiles the first 2 layers (~5-8 s a bucket; the prefill bucket for Qwen3-30B-A3B only);
    the whole models both buckets, ~50 s each."""
    devices("h100")  # skips where the CUDA plugin is absent
    args = dataclasses.replace(server_args(model, tp=1),
                               model_path=first_layers(model, layers, tmp_path))
    program, shapes, description = aot.server_step("h100", args)
    config, _ = read_config(args.model_path, load_format="dummy")
    buckets = {tokens: (tokens, seqs, pages) for tokens, seqs, pages in shapes}
    # CI: every model's 256-row decode, Qwen3-30B-A3B's prefill too (a compile less each).
    both = layers is None or model == "qwen3-30b-a3b"
    for tokens in (256, 4096) if both else (256,):
        compiled = program.compile(*buckets[tokens], PLAIN)
        row = predict(program, compiled, "h100", tokens, buckets[tokens][1], context=1024,
                      config=config)
        assert row["grouped_matmuls"] == 2 * sum(config.moe_layers), (description, row)
        assert (row["conditional"], row["while"]) == (0, 0), row  # no host decision
        ratios = row["active_flops_ratio"], row["experts_flops_ratio"]
        assert max(ratios) <= 1.5, (description, tokens, ratios)


def materialized(hlo: str, at_least: int) -> list[str]:
    """Instructions that write an array of `at_least` bytes or more (not parameters, bitcasts,
    tuple elements or the donated caches' in-place updates: the caller filters the last)."""
    itemsize = {"bf16": 2, "f32": 4, "s32": 4, "f16": 2, "s8": 1, "u8": 1}
    found = []
    for name, dtype, shape, op in re.findall(r"%([\w.\-]+) = (\w+)\[([\d,]+)\]\S* ([\w\-]+)\(",
                                             hlo):
        size = itemsize.get(dtype, 0) * math.prod(int(d) for d in shape.split(","))
        if size >= at_least and op not in ("parameter", "bitcast", "get-tuple-element"):
            found.append(f"{name} {dtype}[{shape}] {op}")
    return found


@pytest.mark.parametrize("tp,ep", [(1, 1), (4, 4), (4, 1)])
def test_a_v6e_moe_step_reads_the_experts_in_place(tp, ep, tmp_path):
    """Issue 51: on v6e the experts' gate_up [E, K, 2, I] was viewed as [E, K, 2I] for the grouped
    matmul, which XLA's tiled layout made a relayout of the whole weight every step, and each
    layer's experts were sliced out of a stack of the layers' weights (weight_args.py), which
    a custom call's operand needs as a buffer of its own: 2.4 GB of temporaries and 12.0 GB moved
    in the 8-token step of Qwen3-30B-A3B's first 2 layers at tp 1, against 4.2 GB of weights.
    Now gate_up goes as 2E groups of [K, I] (Kernels.gate_up_as_groups) and the experts as one
    argument a layer: no array of a layer's experts is written, and temporaries are small."""
    devices("v6e:2x2")  # skips where libtpu is absent
    args = dataclasses.replace(server_args("qwen3-30b-a3b", tp=tp), ep_size=ep,
                               model_path=first_layers("qwen3-30b-a3b", 2, tmp_path))
    program, shapes, description = aot.server_step("v6e:2x2", args)
    compiled = program.compile(*shapes[0], PLAIN)
    config, _ = read_config(args.model_path, load_format="dummy")
    # One layer's experts_down on a device: [E, I, hidden] / tp, 201 MB at tp 1.
    experts_down = 2 * config.num_experts * config.moe_intermediate_size * config.hidden_size // tp
    cache = program.args[1][0]
    cache_shape = f"[{','.join(map(str, cache.sharding.shard_shape(cache.shape)))}]"
    held = str(config.num_experts // ep)  # experts a device holds: a dim of their arrays
    writes = [w for w in materialized(compiled.as_text(), experts_down)
              if held in re.search(r"\[(.*)\]", w).group(1).split(",") and cache_shape not in w]
    assert not writes, (description, writes)
    assert compiled.memory_analysis().temp_size_in_bytes < 0.1e9, description
