"""Ragged paged attention on the CPU: `kernel_cpu.cc` as XLA FFI custom calls.

Same signatures and semantics as `reference.ragged_paged_attention` and
`reference.mla_ragged_paged_attention` (the specification), near memory speed: the jnp reference
runs on XLA's CPU backend as gathers, transposes and tiny batched matmuls (3 ms per layer for 64
decoding sequences of 100 tokens, where reading their KV takes 0.5 ms). Built on first use by
`xlaserve.native`; `KernelUnavailable` without a compiler.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import numpy as np

# KernelUnavailable: re-exported (api.py catches kernel_cpu.KernelUnavailable)
from xlaserve.native.build import KernelUnavailable, register  # noqa: F401
from xlaserve.pallas_kernels.ragged_paged_attention import reference
from xlaserve.pallas_kernels.ragged_paged_attention.reference import (check_local,
                                                                       check_mla_shapes,
                                                                       check_sinks)

TARGET_NAME = "xlaserve_ragged_paged_attention_cpu"
MLA_TARGET_NAME = "xlaserve_mla_ragged_paged_attention_cpu"
_SOURCE = Path(__file__).with_name("kernel_cpu.cc")


def load():
    """Builds and registers both custom calls (once); raises KernelUnavailable."""
    register(_SOURCE, "XlaserveMlaRaggedPagedAttention", MLA_TARGET_NAME)
    return register(_SOURCE, "XlaserveRaggedPagedAttention", TARGET_NAME)


@functools.cache
def bf16_pairs_supported() -> bool:
    """Whether this CPU has AVX512_BF16, so that bfloat16 attention multiplies bfloat16 pairs
    (VDPBF16PS) instead of widening the cache to float32."""
    library = load()
    library.XlaserveAttentionBf16Pairs.restype = ctypes.c_int64
    return bool(library.XlaserveAttentionBf16Pairs())


def ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, soft_cap=None, sinks=None,
                           bf16_pairs=None, prefix_only=False, attention_chunk=None):
    """See `reference.ragged_paged_attention`; returns (out, kv_cache), the cache updated in place
    (the custom call's cache output aliases its input), or with `prefix_only` (out, lse,
    kv_cache) (the one-row items; other head dims take the reference). `bf16_pairs`: bfloat16
    dot products on VDPBF16PS (None: where the CPU has them; False: widen to float32, for
    tests)."""
    bf16_pairs = _checked_bf16_pairs(q, kv_cache, bf16_pairs)
    sliding_window, attention_chunk = check_local(sliding_window, attention_chunk)
    if prefix_only and q.shape[2] % 8:  # the kernel's block items do not take it: the reference
        return reference.ragged_paged_attention(
            q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, prefix_only=True,
            attention_chunk=attention_chunk)
    lse_shape = q.shape[:2] if prefix_only else (0,)  # the custom call always has the output
    call = jax.ffi.ffi_call(
        TARGET_NAME,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
         jax.ShapeDtypeStruct(lse_shape, np.float32)),
        input_output_aliases={3: 1},
    )
    as_i32 = functools.partial(jax.numpy.asarray, dtype=np.int32)
    # Sinks are an optional last operand: without them the call is what it was before sinks.
    optional = () if sinks is None else (check_sinks(sinks, q.shape[1]),)
    # The cache goes in as stored (flat or by head; the kernel takes both): a reshape around
    # this aliased call made XLA copy the whole cache, every layer and step.
    out, kv_cache, lse = call(
        q, k.astype(kv_cache.dtype), v.astype(kv_cache.dtype), kv_cache, as_i32(kv_lens), as_i32(page_indices),
        as_i32(cu_q_lens), as_i32(num_seqs), *optional, sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0),
        bf16_pairs=bool(bf16_pairs), prefix_only=bool(prefix_only),
        attention_chunk=np.int32(attention_chunk or 0))
    return (out, lse, kv_cache) if prefix_only else (out, kv_cache)


def mla_ragged_paged_attention(q, latent, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale, value_dim: int, bf16_pairs=None, prefix_only=False):
    """See `reference.mla_ragged_paged_attention` (multi-head latent attention, DeepSeek-V2/V3);
    returns (out [T, Hq, value_dim], kv_cache), the cache updated in place as
    `ragged_paged_attention`'s, or with `prefix_only` (out, lse [T, Hq] float32, kv_cache) over
    each sequence's keys from before this step alone (the expanded form's prefix part: model/
    mla.py). The kernel reads each latent row once for every query head, so its decode is bound
    by the arithmetic (Hq x (Dk + value_dim) multiply-adds a row), not by memory; `bf16_pairs` as
    there (the pairs path takes an even Dk and a value_dim that is a multiple of 32, DeepSeek's
    576 and 512; other shapes widen to float32)."""
    check_mla_shapes(q, latent, kv_cache, value_dim)
    bf16_pairs = _checked_bf16_pairs(q, kv_cache, bf16_pairs)
    out_shape = q.shape[:2] + (value_dim,)
    lse_shape = q.shape[:2] if prefix_only else (0,)  # the custom call always has the output
    call = jax.ffi.ffi_call(
        MLA_TARGET_NAME,
        (jax.ShapeDtypeStruct(out_shape, q.dtype),
         jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
         jax.ShapeDtypeStruct(lse_shape, np.float32)),
        input_output_aliases={2: 1},
    )
    as_i32 = functools.partial(jax.numpy.asarray, dtype=np.int32)
    out, kv_cache, lse = call(q, latent.astype(kv_cache.dtype), kv_cache, as_i32(kv_lens),
                              as_i32(page_indices), as_i32(cu_q_lens), as_i32(num_seqs),
                              sm_scale=np.float32(sm_scale), value_dim=np.int32(value_dim),
                              bf16_pairs=bool(bf16_pairs), prefix_only=bool(prefix_only))
    return (out, lse, kv_cache) if prefix_only else (out, kv_cache)


def _checked_bf16_pairs(q, kv_cache, bf16_pairs) -> bool:
    """Whether to multiply bfloat16 pairs (None: where the CPU can), once the kernels are built
    (else KernelUnavailable); ValueError unless q is float32 or bfloat16 and the cache in q's
    dtype or FP8 (model/fp8_kv_cache.py: widened to float32 as it is read, never pairs), and
    the CPU can do what bf16_pairs asks."""
    load()
    fp8 = kv_cache.dtype in (jax.numpy.float8_e4m3fn, jax.numpy.float8_e5m2)
    if bf16_pairs is None:
        bf16_pairs = bf16_pairs_supported() and not fp8
    elif bf16_pairs and (fp8 or not bf16_pairs_supported()):
        raise ValueError("bf16_pairs needs a CPU with AVX512_BF16 and a bfloat16 cache")
    if q.dtype not in (np.float32, jax.numpy.bfloat16) or not (fp8 or kv_cache.dtype == q.dtype):
        raise ValueError("the CPU attention kernel takes q in float32 or bfloat16 and a KV cache "
                         f"in q's dtype or FP8; got {q.dtype} and {kv_cache.dtype}")
    return bool(bf16_pairs)
