"""The Pallas attention kernels compiled for their real targets, without the hardware: Mosaic for
TPU v5e and v6e (libtpu's compile-only topologies), Triton for an H100 (the jax CUDA plugin's
deviceless target). Interpret mode on CPU (test_pallas_kernels.py) checks what the kernels
compute; only these compiles check what Mosaic and Triton accept: layouts, tile alignment, VMEM,
SMEM and shared memory. Bfloat16 failed Mosaic's alignment check here before the new K/V went
through XLA's scatter. Attention sinks (gpt-oss) add an operand to each kernel: SMEM scalars on
TPU, a [Hkv, rows] block on GPU.

The shapes are those of real models, per device (a tensor-parallel mesh splits the heads), in
the runtime's flat cache layout, at the bucket shapes a server steps with: decode (one token per
sequence), mixed (two per sequence: the q-block heuristic's next size) and prefill (eight). The
default set is one dtype and page size per head layout plus the page sizes and float32 on a
few; --slow runs the full grid.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from benchmarks.predict_accelerators import hlo_counts
from tests.compile_targets import HLO_TYPES, cache_copies, compile_for, devices
from xlaserve.pallas_kernels.ragged_paged_attention import kernel_gpu, kernel_tpu, tpu_shape_checks
from xlaserve.runtime.executor import aot

# Per-device (q heads, kv heads, head dim) of real models.
HEAD_LAYOUTS = {
    "qwen2.5-0.5b": (14, 2, 64),
    "smollm2-135m": (9, 3, 64),
    "qwen2.5-7b": (28, 4, 128),
    "llama-3.1-8b": (32, 8, 128),  # Qwen3-8B has the same
    "llama-3.1-8b-tp4": (8, 2, 128),
    "qwen2.5-7b-tp4": (7, 1, 128),
}
# gpt-oss-20b and -120b: attention sinks on every layer, a 128-token window on every other one.
SINK_LAYOUTS = {"gpt-oss": (64, 8, 64), "gpt-oss-tp4": (16, 2, 64)}
GPT_OSS_WINDOW = 128
# (tokens, sequences) of a step: runtime buckets at 64 running requests.
BATCHES = {"decode": (64, 64), "mixed": (128, 64), "prefill": (512, 64)}
CONTEXT = 4096  # tokens a page table covers
CACHE_BYTES = 256 << 20  # a cache this big stays in HBM, as a real one does
PAGE_SIZES = (16, 32, 64, 128)
KERNELS = {"tpu": kernel_tpu.ragged_paged_attention, "gpu": kernel_gpu.ragged_paged_attention}


def grid(slow: bool):
    """(layout, batch, page_size, dtype): every combination with --slow; by default (a compile
    takes 2-5 s here) every layout decoding in bfloat16 at 16-token pages, the other batches and
    page sizes on one layout, and float32 on two."""
    if slow:
        return [(layout, batch, ps, dtype) for layout in HEAD_LAYOUTS for batch in BATCHES
                for ps in PAGE_SIZES for dtype in ("bfloat16", "float32")]
    cases = [(layout, "decode", 16, "bfloat16") for layout in HEAD_LAYOUTS]
    cases += [("llama-3.1-8b-tp4", batch, 16, "bfloat16") for batch in ("mixed", "prefill")]
    cases += [("llama-3.1-8b-tp4", "prefill", ps, "bfloat16") for ps in (64, 128)]
    cases += [("qwen2.5-0.5b", "prefill", 16, "float32"), ("llama-3.1-8b", "decode", 32, "float32")]
    return cases


def sink_grid(slow: bool):
    """(layout, batch, page_size, dtype, sliding_window) of the kernels with sinks: by default one
    per target, the whole gpt-oss layer mix with --slow."""
    if slow:
        return [(layout, batch, 16, dtype, window) for layout in SINK_LAYOUTS for batch in BATCHES
                for dtype in ("bfloat16", "float32") for window in (None, GPT_OSS_WINDOW)]
    return [("gpt-oss", "mixed", 16, "bfloat16", GPT_OSS_WINDOW)]


def pytest_generate_tests(metafunc):
    slow = metafunc.config.getoption("--slow")
    for name, cases in (("attention_case", grid), ("sinks_case", sink_grid)):
        if name in metafunc.fixturenames:
            cases = cases(slow)
            metafunc.parametrize(name, cases, ids=["-".join(map(str, c)) for c in cases])


def one_device_mesh(devices) -> Mesh:
    """The kernels' shapes are per device: one device of the target runs them."""
    return Mesh(np.array(devices[:1]).reshape(1, 1), ("data", "tensor"))


def attention_args(mesh, layout, batch, page_size, dtype, sinks=False, kv_dtype=None):
    """`kv_dtype`: the new rows' and the cache's (an FP8 cache's), else `dtype`."""
    num_q_heads, num_kv_heads, head_dim = (layout if isinstance(layout, tuple)  # or the heads
                                           else {**HEAD_LAYOUTS, **SINK_LAYOUTS}[layout])
    tokens, seqs = BATCHES[batch] if isinstance(batch, str) else batch  # or (tokens, seqs)
    kv_dtype = kv_dtype or dtype
    pages_per_seq = CONTEXT // page_size
    token_bytes = 2 * num_kv_heads * head_dim * jnp.dtype(kv_dtype).itemsize
    num_pages = max(seqs * pages_per_seq + 1, CACHE_BYTES // (page_size * token_bytes))
    at = lambda shape, dt=dtype: aot.abstract(shape, jnp.dtype(dt), mesh, P())
    return dict(q=at((tokens, num_q_heads, head_dim)),
                k=at((tokens, num_kv_heads, head_dim), kv_dtype),
                v=at((tokens, num_kv_heads, head_dim), kv_dtype),
                kv_cache=at((num_pages, page_size, 2 * num_kv_heads * head_dim), kv_dtype),
                kv_lens=at((seqs,), "int32"), page_indices=at((seqs, pages_per_seq), "int32"),
                cu_q_lens=at((seqs + 1,), "int32"), num_seqs=at((1,), "int32"),
                **({"sinks": at((num_q_heads,), "float32")} if sinks else {}))


def check_compiles_in_place(target, case, sinks=False, kv_dtype=None, **static):
    """Compiles the target's kernel for `case` (attention_args); the cache must be updated in
    place, uncopied."""
    platform, target_devices = devices(target)
    mesh = one_device_mesh(target_devices)
    args = attention_args(mesh, *case, sinks=sinks, kv_dtype=kv_dtype)
    kernel = jax.jit(KERNELS[platform], static_argnames=("sm_scale", *static),
                     donate_argnames=("kv_cache",))
    hlo = compile_for(mesh, kernel, **args, sm_scale=0.125, **static).as_text()
    cache = args["kv_cache"]
    assert not cache_copies(hlo, cache.shape, cache.dtype), "the KV cache is copied (relayout)"
    assert "input_output_alias" in hlo.splitlines()[0], "the cache is not updated in place"
    if platform == "tpu":  # the kernel writes the new K/V itself, no XLA scatter into the cache
        assert not cache_scatters(hlo, cache.shape, cache.dtype), "the new K/V are scattered"
    else:  # the new K/V's scatter is the only one (XLA may make it a dynamic-update-slice),
        # none for one-token items (the kernel writes them): the output is gathered
        # (gather_outputs) or written in place, not scattered over zeros
        scatters = [line.strip()[:160] for line in hlo.splitlines() if " scatter(" in line]
        assert len(scatters) <= (0 if case[1] == "decode" else 1), scatters


def cache_scatters(hlo: str, shape, dtype) -> list[str]:
    """Scatters of a compiled program (its HLO text) whose result has the cache's shape."""
    name = HLO_TYPES[jnp.dtype(dtype).name]
    pattern = "= " + re.escape(f"{name}[{','.join(map(str, shape))}]") + r"\{[^}]*\} scatter\("
    return [line.strip()[:200] for line in hlo.splitlines() if re.search(pattern, line)]


@pytest.mark.parametrize("target", ["v6e:2x2", "v5e:2x2"])
@pytest.mark.parametrize("layout,q_block,dtype", [("llama-3.1-8b-tp4", 64, "bfloat16"),
                                                  ("qwen2.5-0.5b", 36, "float32")])
def test_tpu_kernel_writing_long_prefill_items_into_pages_compiles(target, layout, q_block, dtype):
    # Items longer than a page plus a sublane tile (the q-block heuristic's blocks for long
    # prompts: 256 rows / G): the kernel's K/V write slides a tile-aligned window over the item's
    # rows, where decode items broadcast their one row and short items pad theirs.
    check_compiles_in_place(target, (layout, "prefill", 16, dtype), q_block=q_block)


@pytest.mark.parametrize("target", ["v6e:2x2", "v5e:2x2", "h100"])
def test_attention_kernel_compiles_for_the_target(target, attention_case):
    check_compiles_in_place(target, attention_case)


@pytest.mark.parametrize("target", ["v6e:2x2", "v5e:2x2", "h100"])
def test_attention_kernel_with_sinks_compiles_for_the_target(target, sinks_case):
    *case, window = sinks_case
    check_compiles_in_place(target, case, sinks=True, sliding_window=window)


@pytest.mark.parametrize("target", ["v6e:2x2", "h100"])
@pytest.mark.parametrize("batch", ["decode", "prefill"])
def test_attention_chunk_compiles_for_the_target(target, batch):
    """Llama 4's chunked attention (its RoPE layers): each row's chunk start from scalars and a
    float floor (no vector integer division on TPU), the blocks before it skipped; Scout's heads
    at tp 8 (5 query heads, 1 kv head), a chunk of 1000 (not a power of two: a real remainder)."""
    check_compiles_in_place(target, ((5, 1, 128), batch, 16, "bfloat16"), attention_chunk=1000)


@pytest.mark.parametrize("target", ["v6e:2x2", "h100"])
def test_gemma4_wide_heads_compile_in_a_long_prefill(target):
    """Gemma 4 31B's full layers (32 query heads over 4 KV heads of 512) in a 2048-token step of
    64 requests: on the GPU an item holds 32 query rows at that width (query_rows_for), where 128
    asked Triton for 256 KiB of shared memory, more than an H100 has."""
    check_compiles_in_place(target, ((32, 4, 512), (2048, 64), 16, "bfloat16"))


@pytest.mark.parametrize("target", ["v6e:2x2", "h100"])
@pytest.mark.parametrize("layout", ["llama-3.1-8b", "qwen2.5-0.5b"])
def test_prefix_only_attention_compiles_for_the_target(target, layout):
    """The kernels with `prefix_only` (out and log-sum-exp: speculative tree rows, tree_tokens.py)
    at a verify step's shape, 64 requests of 8 tree tokens (128 rows: 4 and 1 split on GPU)."""
    check_compiles_in_place(target, (layout, (512, 64), 16, "bfloat16"), prefix_only=True)
    check_compiles_in_place(target, (layout, (128, 64), 16, "bfloat16"), prefix_only=True)


@pytest.mark.parametrize("layout,sinks,window", [("llama-3.1-8b", False, None),
                                                  ("gpt-oss", True, GPT_OSS_WINDOW)])
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_split_kv_decode_compiles_for_h100(layout, sinks, window, rows):
    # Small decode buckets take the split-KV path by default: 8 rows x 8 kv heads is 64
    # programs, 4 splits each (kernel_gpu.default_num_kv_splits), as is a 1-row bucket.
    check_compiles_in_place("h100", (layout, (rows, rows), 16, "bfloat16"), sinks=sinks,
                            sliding_window=window)


@pytest.mark.parametrize("layout,rows", [("llama-3.1-8b", 256), ("qwen2.5-0.5b", 256),
                                         ("llama-3.1-8b", 64)])
def test_gpu_decode_kernel_reads_queries_and_writes_outputs_and_kv_in_place(layout, rows):
    # One-token items are the tokens: the kernel reads q [T, Hq, D] and, unsplit, writes the
    # output in place, so no pad of q to the block's 16 rows (7 us a layer at 256 rows on an H200)
    # and no gather of the output are left around it (Qwen2.5-0.5B: 7 query heads a kv head,
    # not a power of two); and it writes the new K/V itself, where XLA's scatter took 9 us a
    # layer. Split (64 rows), the merge of the splits is one fusion.
    _, target_devices = devices("h100")
    mesh = one_device_mesh(target_devices)
    args = attention_args(mesh, layout, (rows, rows), 16, "bfloat16")
    kernel = jax.jit(kernel_gpu.ragged_paged_attention, static_argnames=("sm_scale",),
                     donate_argnames=("kv_cache",))
    hlo = compile_for(mesh, kernel, **args, sm_scale=0.125).as_text()
    entry = hlo[hlo.index("ENTRY"):]
    ops = re.findall(r"%(\w+)[.\d]* = ", entry)  # the instructions' names say their kind
    assert not [op for op in ops if "pad" in op or "gather" in op], ops
    num_q_heads, _, head_dim = HEAD_LAYOUTS[layout]
    # The kernel writes the new K/V itself: no scatter, the cache its last output, in place.
    assert not [op for op in ops if "scatter" in op or "copy" in op], ops
    kernel_out = re.search(r"= \((.+)\) custom-call\(", entry).group(1)
    cache = args["kv_cache"].shape
    assert kernel_out.split(", ")[-1].startswith(f"bf16[{cache[0]},{cache[1]},"), kernel_out
    assert "input_output_alias" in hlo.splitlines()[0]
    if rows >= kernel_gpu.NO_SPLIT_ITEMS:
        assert kernel_out.startswith(f"bf16[{rows * num_q_heads},{head_dim}]"), kernel_out
    else:
        assert len(re.findall(r"\bfusion\(%pallas_call", entry)) <= 2, entry


def test_gpu_attention_metadata_is_computed_once_for_all_layers_without_while_loops():
    # Every layer calls the kernel with the same kv_lens / cu_q_lens / page table: XLA computes
    # the work items once (CSE), and the sequence lookups are unrolled binary searches, not while
    # loops (each iteration a host sync on a GPU): every layer's kernel reads the same metadata
    # buffers (its first six operands: item_seq, item_row0, kv_lens, cu_q_lens, num_seqs and the
    # page table, as computed from the step's arguments).
    _, target_devices = devices("h100")
    mesh = one_device_mesh(target_devices)
    args = attention_args(mesh, "llama-3.1-8b", "decode", 16, "bfloat16")

    def layers(num_layers):
        def step(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs):
            outs = []
            for layer in range(num_layers):  # each layer's own queries, as a model's are
                out, kv_cache = kernel_gpu.ragged_paged_attention(
                    q * (layer + 1), k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                    sm_scale=0.125)
                outs.append(out)
            return sum(outs), kv_cache
        return jax.jit(step, donate_argnames=("kv_cache",))

    hlo = compile_for(mesh, layers(3), **args).as_text()
    assert hlo_counts(hlo)["while"] == 0, hlo_counts(hlo)
    kernel_operands = re.findall(r" custom-call\(([^)]*)\), custom_call_target=\"[^\"]*triton", hlo)
    assert len(kernel_operands) == 3, kernel_operands
    metadata = {tuple(operands.split(", ")[:6]) for operands in kernel_operands}
    assert len(metadata) == 1, metadata


def test_a_cache_stored_by_head_would_be_copied_on_tpu():
    # Why the runtime stores the cache flat: TPU tiles an array by its last two dims, so the
    # kernel's flat view of a [pages, page_size, 2*Hkv, D] cache is a relayout of all of it.
    _, target_devices = devices("v6e:2x2")
    mesh = one_device_mesh(target_devices)
    args = attention_args(mesh, "qwen2.5-0.5b", "decode", 16, "bfloat16")
    flat = args["kv_cache"]
    args["kv_cache"] = aot.abstract(flat.shape[:2] + (4, 64), flat.dtype, mesh, P())
    kernel = jax.jit(kernel_tpu.ragged_paged_attention, static_argnames=("sm_scale",),
                     donate_argnames=("kv_cache",))
    hlo = compile_for(mesh, kernel, **args, sm_scale=0.125).as_text()
    assert cache_copies(hlo, flat.shape, flat.dtype)


@pytest.mark.parametrize("target", ["v6e:2x2", "h100"])
def test_unsupported_page_sizes_are_refused_before_compiling(target):
    platform, _ = devices(target)
    if platform == "tpu":  # a bfloat16 page must be whole (16-row) sublane tiles
        with pytest.raises(ValueError, match="multiple of 16"):
            tpu_shape_checks.check_shapes(8, jnp.bfloat16, 64, 512)
        with pytest.raises(ValueError, match="scalar memory"):  # 128K context, 64 seqs, 16-token pages
            tpu_shape_checks.check_shapes(16, jnp.bfloat16, 64, 131072 // 16)
        assert tpu_shape_checks.default_page_size(64, 131072) == 64
    else:
        with pytest.raises(ValueError, match="power-of-two head dims"):
            kernel_gpu.check_shapes(64, 80, 2)
        with pytest.raises(ValueError, match="shared memory"):  # float32 256-token pages, d 128
            kernel_gpu.check_shapes(256, 128, 4)
