"""The whole serving step (forward with the Pallas attention inside, sampler, penalty state) of a
real-size model, compiled for TPU v6e (2x2, tensor parallel over 4 chips) and for one H100,
without the hardware (runtime/executor/aot.py): what a server on those machines would precompile at
start-up, at the largest bucket (the q-block heuristic's biggest blocks). Weights are not read:
Llama-3.1-8B's config.json (benchmarks/configs) gives the shapes.
"""
import json
import re
from pathlib import Path

import pytest

from benchmarks.predict_accelerators import hlo_counts
from tests.compile_targets import cache_copies, devices, first_layers, weight_bytes
from xlaserve.pallas_kernels import grouped_matmul_gpu, invariant_matmul, invariant_norm
from xlaserve.runtime.executor import aot
from xlaserve.runtime.sampling.step_needs import PLAIN
from xlaserve.server_args import ServerArgs

WEIGHT_BYTES = 16.06e9  # Llama-3.1-8B in bfloat16
# CI compiles the first 2 layers of each model (compile_targets.first_layers); --slow the whole.
LAYERS = [2, pytest.param(None, marks=pytest.mark.slow)]


def test_processes_started_after_a_tpu_compile_do_not_load_libtpu():
    """Importing libtpu sets TPU_LIBRARY_PATH, and JAX in every process started afterwards loaded
    libtpu from it: a CPU server a test started after a TPU compile in the same worker logged
    libtpu's init errors, and in CI one died of a SIGSEGV that libtpu's failure handler printed
    (issue 71).
    aot.use_compile_only_packages keeps the library to the process that compiles."""
    import os

    devices("v6e:2x2")  # libtpu loaded and its client made here; skips where it is absent
    assert "TPU_LIBRARY_PATH" not in os.environ


@pytest.mark.parametrize("layers", LAYERS, ids=["2-layers", "whole"])
@pytest.mark.parametrize("target,tp_size", [
    ("v6e:2x2", 4), ("h100", 1)])
def test_llama_8b_serving_step_compiles_for_the_target(target, tp_size, layers, tmp_path):
    """Llama-3.1-8B's serving step (its first 2 layers; the whole model under --slow) compiled for
    the target: ~30 s on a 2-core CPU for v6e tp 4, XLA's TPU compiler and its partitioner."""
    devices(target)  # skips where the compile-only package is absent
    # The CPU's step sizes, as before the accelerator defaults (test_platform_defaults.py).
    args = ServerArgs(model_path=first_layers("llama-3.1-8b", layers, tmp_path),
                      tp_size=tp_size, max_running_requests=64, max_prefill_tokens=512)
    program, shapes, description = aot.server_step(target, args)
    tokens, seqs, pages = shapes[-1]
    assert (tokens, seqs) == (512, 64), description  # --max-prefill-tokens, 64 requests
    compiled = program.compile(tokens, seqs, pages)

    weights = weight_bytes(program)
    if layers is None:
        assert abs(weights - WEIGHT_BYTES) < 0.01e9, weights
    memory = compiled.memory_analysis()
    kv_bytes = sum(cache.size * cache.dtype.itemsize for cache in program.args[1])
    per_device = (weights + kv_bytes) / tp_size
    assert 0.95 * per_device < memory.argument_size_in_bytes < 1.1 * per_device, description
    hlo = compiled.as_text()
    # The caches (one a layer) and the penalty state are donated and updated in place: no cache
    # is copied.
    cache = program.args[1][0]
    local = (cache.shape[0], cache.shape[1], cache.shape[2] // tp_size)  # one device's shard
    assert not cache_copies(hlo, local, cache.dtype), "a KV cache is copied"
    header = hlo.splitlines()[0]  # HloModule ..., input_output_alias={ {i}: (arg, {}, may-alias), ...
    num_layers = len(program.args[1])
    assert num_layers == (layers or 32)
    assert header.count("may-alias") >= num_layers + 2, description  # caches, counts, last tokens


CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"
CUT = "-2-layers"  # a config id ending so: its first 2 layers (compile_targets.first_layers)
WEIGHT_BYTES_OF = {"qwen3-30b-a3b": 61.06e9,  # 30.5B parameters in bfloat16
                   "mixtral-8x7b": 93.4e9,  # 46.7B
                   "gpt-oss-120b": 233.66e9}  # 116.8B, the MXFP4 experts decoded


@pytest.mark.parametrize("config,target,tp_size,ep_size,bucket", [
    # CI compiles one, its first 2 layers: expert parallel, the shard_map path; the ep 1 split
    # is XLA's partitioner over the same ragged dots.
    pytest.param("qwen3-30b-a3b", "v6e:2x2", 4, 1, "smallest", marks=pytest.mark.slow),
    ("qwen3-30b-a3b" + CUT, "v6e:2x2", 4, 4, "smallest"),
    pytest.param("qwen3-30b-a3b", "v6e:2x2", 4, 4, "smallest", marks=pytest.mark.slow),
    pytest.param("qwen3-30b-a3b", "v6e:2x2", 4, 1, "largest", marks=pytest.mark.slow),
    pytest.param("qwen3-30b-a3b", "v6e:2x2", 4, 4, "largest", marks=pytest.mark.slow),
    pytest.param("qwen3-30b-a3b", "h100", 1, 1, "smallest", marks=pytest.mark.slow),
    pytest.param("qwen3-30b-a3b", "h100", 1, 1, "largest", marks=pytest.mark.slow),
    # Qwen3-30B-A3B's 4 kv heads split over 4 devices at most: eight take Mixtral's 8.
    pytest.param("mixtral-8x7b", "v6e:2x4", 8, 8, "smallest", marks=pytest.mark.slow),
    pytest.param("mixtral-8x7b", "v6e:2x4", 8, 2, "largest", marks=pytest.mark.slow),
    pytest.param("mixtral-8x7b", "h100x8", 8, 8, "smallest", marks=pytest.mark.slow),
    ("mixtral-8x7b" + CUT, "h100x8", 8, 8, "largest"),  # the GPU grouped matmul per device
    pytest.param("mixtral-8x7b", "h100x8", 8, 8, "largest", marks=pytest.mark.slow),
    # Sinks in the Pallas kernels, sliding and full layers, expert biases.
    pytest.param("gpt-oss-120b", "v6e:2x4", 8, 8, "smallest", marks=pytest.mark.slow),
    pytest.param("gpt-oss-120b", "h100x8", 8, 8, "largest", marks=pytest.mark.slow),
])
def test_mixture_of_experts_serving_step_compiles_for_the_target(config, target, tp_size, ep_size,
                                                                 bucket, tmp_path):
    """The mixture of experts at its real size (Qwen3-30B-A3B: 48 layers of 128 experts, top 8),
    each layer's experts as two grouped matmuls (model/moe.py) inside the step: ragged dots, which
    XLA lowers to TPU's grouped kernels, and on GPU pallas_kernels/grouped_matmul_gpu.py; with --ep-size, under shard_map, each device on its own experts;
    weights and caches sharded as loaded (~40 s a compile on a 2-core CPU, so only one runs
    without --slow, at 2 layers: 9 s)."""
    devices(target)
    layers = 2 if config.endswith(CUT) else None
    config = config.removesuffix(CUT)
    path = first_layers(config, layers, tmp_path)
    args = ServerArgs(model_path=path, tp_size=tp_size, ep_size=ep_size,
                      max_running_requests=64, max_prefill_tokens=512)
    program, shapes, description = aot.server_step(target, args)
    tokens, seqs, pages = shapes[0] if bucket == "smallest" else shapes[-1]
    # The plain variant: the sampler's parts read only the logits and compile with every part in
    # test_llama_8b_serving_step_compiles_for_the_target (Qwen3-30B-A3B on v6e: 8.6 -> 3.7 s).
    compiled = program.compile(tokens, seqs, pages, PLAIN)
    kv_bytes = sum(cache.size * cache.dtype.itemsize for cache in program.args[1])
    weights = weight_bytes(program)
    if layers is None:  # the whole model: its parameter count, as published
        assert abs(weights - WEIGHT_BYTES_OF[config]) < 0.01 * WEIGHT_BYTES_OF[config], weights
    # Expert parallelism holds as many weights per device as tensor parallelism (sharding.py).
    per_device = (weights + kv_bytes) / tp_size
    argument_bytes = compiled.memory_analysis().argument_size_in_bytes
    assert 0.95 * per_device < argument_bytes < 1.1 * per_device, description
    hlo = compiled.as_text()
    if target.startswith("h100"):  # XLA's ragged_dot is a dense dot over every expert there
        moe_layers = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
        # A layer's gate_up with the SwiGLU fused, and its down projection
        assert hlo.count(f'name = "{grouped_matmul_gpu.SWIGLU_NAME}_m') == moe_layers, description
        assert hlo.count(f'name = "{grouped_matmul_gpu.NAME}_m') == moe_layers, description
    if ep_size > 1:  # one all-reduce combines the experts' outputs; no token is exchanged
        assert "all-to-all" not in hlo, description
    # No weight is gathered: the only all-gathers are the logits'.
    gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)
    assert len(gathers) <= 2 and all(g.startswith("f32[") for g in gathers), (gathers, description)


@pytest.mark.parametrize("expanded", [False, True],
                         ids=["absorbed", "expanded"])
@pytest.mark.parametrize("target,tp_size", [("v6e:2x2", 4), pytest.param("h100", 1, marks=pytest.mark.slow)])
def test_deepseek_latent_attention_step_compiles_with_its_cache_updated_in_place(
        target, tp_size, expanded, tmp_path):
    """DeepSeek-V2-Lite's step with the Pallas latent-attention kernel, its first 3 layers (one
    dense, two of 64 experts; the whole model's 27 took 60 s a compile here, these 3 the same
    shapes): every layer's latent cache is whole on every device, donated and written in place,
    never copied (unpadded 576-wide rows were, on TPU: transformer.kv_cache_shape pads them to
    640 lanes there). `expanded`: the 128-token bucket in the expanded form
    (--mla-expanded-prefill-tokens 128; its two kernels under shard_map by head at tp 4; the
    512-token bucket took 22.4 s, this one 18.7 s). The plain variant: the sampler
    reads only the logits (every part compiles in test_llama_8b_serving_step_compiles_for_the_target),
    so no vocabulary-wide loop is left either."""
    devices(target)
    config = json.loads((CONFIGS / "deepseek-v2-lite" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    args = ServerArgs(model_path=str(tmp_path), tp_size=tp_size,
                      max_running_requests=64, max_prefill_tokens=512, context_length=8192,
                      mla_expanded_prefill_tokens=128 if expanded else 0)
    program, shapes, description = aot.server_step(target, args)
    tokens, seqs, pages = next(s for s in shapes if s[0] == 128) if expanded else shapes[0]
    compiled = program.compile(tokens, seqs, pages, PLAIN)
    cache = program.args[1][0]
    assert cache.shape[2] == (640 if target.startswith("v") else 576), description
    hlo = compiled.as_text()
    assert not cache_copies(hlo, cache.shape, cache.dtype), "a latent cache is copied"
    assert hlo.splitlines()[0].count("may-alias") >= 3 + 2, description
    # No while loop a layer (the reference's KV-chunk loop is one where a context spans several
    # chunks, its trip count read on the host: a sync mid-step on a GPU); the kernels loop
    # inside.
    assert hlo_counts(hlo)["while"] == 0, hlo_counts(hlo)
    kv_bytes = sum(c.size * c.dtype.itemsize for c in program.args[1])
    assert compiled.memory_analysis().argument_size_in_bytes > kv_bytes  # whole on every device


@pytest.mark.slow
def test_deepseek_v3_fits_64_v6e_chips_with_a_16k_token_latent_cache():
    """The whole DeepSeek-V3 (671B, bfloat16) at tp 64 / ep 64 on v6e 8x8: its weights, a
    16,384-token latent cache (whole on every chip) and the step's temporaries within a chip's
    31.25 GiB (with the default 65,536 tokens the compiler refuses, by 1.2 GiB). ~2 min here."""
    devices("v6e:8x8")
    args = ServerArgs(model_path=str(CONFIGS / "deepseek-v3"), tp_size=64, ep_size=64,
                      max_running_requests=64, max_prefill_tokens=512, context_length=8192,
                      max_total_tokens=16384)
    program, shapes, description = aot.server_step("v6e:8x8", args)
    memory = program.compile(*shapes[0]).memory_analysis()
    total = memory.argument_size_in_bytes + memory.temp_size_in_bytes
    assert total < 31.25 * 2**30, (total / 2**30, description)


@pytest.mark.parametrize("target,tp_size", [("v6e:2x2", 4), ("h100", 1)])
def test_a_speculative_servers_verify_step_compiles_for_the_target(target, tp_size, tmp_path):
    """With --speculative-algorithm NGRAM (5 tokens a verified row) a bucket samples after every
    token of its verified rows. By default each bucket's sequence count covers its tokens, so
    its programs are a plain server's; with a grid of sequence buckets
    (--precompile-bs-paddings) a bucket of 64 tokens and 8 sequences samples 40 rows (the LM
    head, sampler and grammar masks on 40): compiled for the target at Llama-3.1-8B's sizes
    (its first 2 layers)."""
    devices(target)
    args = ServerArgs(model_path=first_layers("llama-3.1-8b", 2, tmp_path), tp_size=tp_size,
                      max_running_requests=64, max_prefill_tokens=512,
                      precompile_bs_paddings="8,64", speculative_algorithm="NGRAM")
    program, shapes, description = aot.server_step(target, args)
    pages = shapes[0][2]
    assert (64, 8, pages) in shapes and program.verify_tokens == 5, description
    args, _ = program.lowering_args(64, 8, pages)
    assert args[-1].shape == (40, -(-128256 // 32)), description  # grammar masks by sample row
    program.compile(64, 8, pages, PLAIN)


def eagle3_server_step(target: str, tp_size: int, tmp_path, **flags):
    """aot.server_step of Llama-3.1-8B's first 2 layers with a head of the published
    Llama-3.1-8B EAGLE-3 head's sizes (benchmarks/configs/eagle3-llama-3.1-8b)."""
    devices(target)
    head = tmp_path / "head"
    head.mkdir()
    config = json.loads((CONFIGS / "eagle3-llama-3.1-8b" / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 0, 0]}  # of 2 layers
    (head / "config.json").write_text(json.dumps(config))
    args = ServerArgs(model_path=first_layers("llama-3.1-8b", 2, tmp_path), tp_size=tp_size,
                      max_running_requests=64, max_prefill_tokens=512,
                      speculative_algorithm="EAGLE3", speculative_draft_model_path=str(head),
                      **flags)
    return aot.server_step(target, args)


@pytest.mark.parametrize("target,tp_size", [
    ("v6e:2x2", 4), ("h100", 1)])
def test_an_eagle3_servers_step_and_draft_steps_compile_for_the_target(target, tp_size,
                                                                     tmp_path):
    """--speculative-algorithm EAGLE3 with a head of the published Llama-3.1-8B head's sizes
    (benchmarks/configs/eagle3-llama-3.1-8b): the serving step runs the head over every row
    after sampling (its cache and per-slot state donated with the KV pool, updated in place),
    and the draft steps' program compiles beside it (the model's first 2 layers)."""
    program, shapes, description = eagle3_server_step(target, tp_size, tmp_path,
                                                      speculative_num_steps=3)
    assert "Eagle3Head draft head" in description and program.verify_tokens == 4, description
    assert len(program.args[1]) == 2 + 2  # the layers' caches, the head's, its slot state
    # The smallest bucket (2 verified rows of 4 tokens): the head's cache and state are donated
    # alike at every size (the largest bucket took 24.9 s, this one 11.7 s).
    compiled = program.compile(*shapes[0], PLAIN)
    header = compiled.as_text().splitlines()[0]
    assert header.count("may-alias") >= 4 + 2, description  # every pool array in place
    program.compile_chain(*shapes[0])


@pytest.mark.parametrize("target,tp_size", [
    ("v6e:2x2", 4), ("h100", 1)])
def test_an_eagle3_tree_servers_tree_step_and_tree_drafting_compile_for_the_target(
        target, tp_size, tmp_path):
    """--speculative-eagle-topk 4 --speculative-num-steps 3 (SGLang's tree shape; 8 of the 12
    drafted nodes verified, 9-token tree rows): the step's tree program (the kernels'
    prefix_only and the masked tree tokens, the kept path's KV moved in every layer's cache
    and the head's, in place) and the head's tree drafting (the model's first 2 layers)."""
    program, shapes, description = eagle3_server_step(
        target, tp_size, tmp_path, speculative_eagle_topk=4, speculative_num_steps=3,
        speculative_num_draft_tokens=9)
    assert program.tree_width == 9, description
    tokens, seqs, pages = max(s for s in shapes if s[0] <= 64)
    compiled = program.compile(tokens, seqs, pages, PLAIN, tree=True)
    assert compiled.as_text().splitlines()[0].count("may-alias") >= 4 + 2, description
    program.compile_chain(*shapes[0])


@pytest.mark.slow
def test_deepseek_v3_with_its_mtp_layer_as_a_nextn_head_fits_64_v6e_chips():
    """--speculative-algorithm NEXTN on the whole DeepSeek-V3: the MTP layer (latent attention,
    256 experts over ep 64) rides in the serving step, its latent cache beside the model's, and
    the whole still fits a v6e chip's 31.25 GiB with a 16,384-token cache; its draft steps
    compile too. 29.5 GiB a chip (23.3 arguments, 6.3 temporaries), ~70 s on 2 cores
    (2026-11-27)."""
    devices("v6e:8x8")
    args = ServerArgs(model_path=str(CONFIGS / "deepseek-v3"), tp_size=64, ep_size=64,
                      max_running_requests=64, max_prefill_tokens=512, context_length=8192,
                      max_total_tokens=16384, speculative_algorithm="NEXTN",
                      speculative_num_steps=3)
    program, shapes, description = aot.server_step("v6e:8x8", args)
    assert "NextNHead draft head" in description, description
    memory = program.compile(*shapes[0], PLAIN).memory_analysis()
    total = memory.argument_size_in_bytes + memory.temp_size_in_bytes
    assert total < 31.25 * 2**30, (total / 2**30, description)
    program.compile_chain(*shapes[0])


@pytest.mark.parametrize("target", ["v6e:2x2", "h100"])
def test_a_deterministic_servers_step_has_no_xla_dot(target, tmp_path):
    """--enable-deterministic-inference on one chip: Qwen3-8B's step (its first 2 layers: q and k
    norms, an untied LM head) multiplies and normalizes through the batch-invariant Pallas kernels
    (kernels.deterministic_kernels) and keeps no XLA dot, whose tiling follows the row count."""
    devices(target)
    args = ServerArgs(model_path=first_layers("qwen3-8b", 2, tmp_path), tp_size=1,
                      max_running_requests=64, max_prefill_tokens=512,
                      enable_deterministic_inference=True)
    program, shapes, description = aot.server_step(target, args)
    assert "deterministic inference" in description
    hlo = program.compile(*shapes[-1]).as_text()
    dots = [line.strip()[:160] for line in hlo.splitlines()
            if re.search(r"= \S+ (dot|convolution)\(", line)]
    assert not dots, dots
    calls = lambda name: sum(1 for line in hlo.splitlines()
                             if "custom-call(" in line and f"{name}/pallas_call" in line)
    # a layer's qkv, o, gate_up and down, then the LM head; a layer's two norms and its q and k
    # norms, then the final norm
    assert calls(invariant_matmul.NAME) >= 2 * 4 + 1, description
    assert calls(invariant_norm.NAME) >= 2 * 4 + 1, description
