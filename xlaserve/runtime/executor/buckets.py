"""Which padding buckets a server compiles: the token, sequence and page-table sizes a step may
take (`serving_buckets`, at start-up), the defaults per platform, and --page-size resolved
(`with_page_size`). A step's batch is padded to one of them (forward_batch.py, `Buckets`).

XLA compiles one program per input shape, so the token count, the sequence count and the pages per
sequence of a batch are each rounded up to a bucket (powers of two by default; on TPU and GPU
with midpoints among the decode sizes, `default_token_buckets`). All buckets are
compiled at start-up; a batch that fits none of them is a scheduling bug, not a reason to compile.

By default the sequence bucket follows the token bucket (min(tokens, most sequences)), so there is
one program per token bucket: a step of the default model compiles in ~8 s on a 2-core CPU, and a
grid of token x sequence buckets (50 programs) took 7 minutes to precompile. Padding sequences
cost little (a dead row of the LM head and of the sampler). Giving sequence buckets explicitly
(`--precompile-bs-paddings`) asks for the full grid instead.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from xlaserve.pallas_kernels.ragged_paged_attention.api import check_shapes, default_page_size
from xlaserve.runtime.executor.forward_batch import Buckets
from xlaserve.runtime.scheduler.page_allocator import pages_for_tokens
from xlaserve.runtime.scheduler.scheduler import prefill_budget


def max_step_tokens(max_running_requests: int, max_prefill_tokens: int) -> int:
    """The most tokens one step can hold (the scheduler's `prefill_budget` beside every running
    request decoding, or a whole prefill step): the largest token bucket. A step with
    speculative verified rows holds at most `max_running_requests` tokens (Speculator.drafts)."""
    return max(max_prefill_tokens,
               max_running_requests + prefill_budget(max_prefill_tokens, max_running_requests))


def pow2_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` below `largest`, then `largest` itself (so 576 tokens at most
    per step pads to 576, not 1024)."""
    if smallest < 1 or largest < smallest:
        raise ValueError(f"bad bucket range [{smallest}, {largest}]")
    buckets, size = [], 1 << (smallest - 1).bit_length()
    while size < largest:
        buckets.append(size)
        size *= 2
    return tuple(buckets) + (largest,)


# TPU and GPU: decode buckets from this many rows get a midpoint (1.5x) below each power of two.
# From the H200's decode steps (accelerator_check.md, 2026-11-27): past ~32 rows a step grows
# about linearly in its rows (Llama-3.1-8B 4.73 ms at 32, 10.49 at 256: ~0.026 ms a row), so a
# step of 129 rows run as 256 pays ~3.3 ms of padding; as 192, ~1.7 ms. Below 64 rows the step is
# its weights' read and a midpoint would save under ~8%. Each midpoint is 3 more programs.
FINE_DECODE_FROM = 64


def with_midpoints(buckets: tuple[int, ...], smallest: int, largest: int) -> tuple[int, ...]:
    """`buckets` with 1.5 x b added for each power of two b from `smallest` whose midpoint is
    under the next bucket and at most `largest`."""
    extra = [b + b // 2 for b, after in zip(buckets, buckets[1:])
             if b >= smallest and b & (b - 1) == 0 and b + b // 2 < after
             and b + b // 2 <= largest]
    return tuple(sorted(set(buckets) | set(extra)))


def default_token_buckets(max_tokens: int, dtype, platform: str, native_matmul: bool = False,
                          max_seqs: int = 0) -> tuple[int, ...]:
    """Token-count buckets by default: powers of two, shaped by what matmuls cost.

    On the CPU with the native GEMM (its cost grows smoothly with the rows), every power of two
    from 1.
    Without it, XLA's dots decide: a 1-row float32 step runs as matrix-vector products (the
    default model: 26 ms) but 2 rows cost more than 4 (50 vs 38 ms), so float32 skips 2; a 1-row
    bfloat16 step falls off the fast bfloat16 path (186 ms against 29 ms for 2 rows), so
    bfloat16 starts at 2. On TPU and GPU, steps under 8 tokens cost about what 8 cost, and fewer
    programs compile faster; decode-sized buckets (up to `max_seqs` tokens) from
    FINE_DECODE_FROM get midpoints (96, 192, 384), where a step's padded rows cost."""
    if platform != "cpu":
        return with_midpoints(pow2_buckets(min(8, max_tokens), max_tokens), FINE_DECODE_FROM,
                              max_seqs)
    if native_matmul:
        return pow2_buckets(1, max_tokens)
    if jnp.dtype(dtype) == jnp.bfloat16:
        return pow2_buckets(min(2, max_tokens), max_tokens)
    return tuple(b for b in pow2_buckets(1, max_tokens) if b != 2 or b == max_tokens)


def default_seq_buckets(max_seqs: int, platform: str) -> tuple[int, ...]:
    """Sequence-count buckets by default: powers of two, with default_token_buckets' midpoints on
    TPU and GPU (a decode step of 192 rows takes 192 sequences)."""
    buckets = pow2_buckets(1, max_seqs)
    if platform == "cpu":
        return buckets
    return with_midpoints(buckets, FINE_DECODE_FROM, max_seqs)


def buckets_for_limits(max_tokens_per_step: int, max_seqs: int, max_pages_per_seq: int,
               token_paddings=None, seq_paddings=None, page_paddings=None,
               verify_tokens: int = 1, tree: bool = False,
               default_seqs=None) -> Buckets:
    """Default power-of-two lists, or the caller's (e.g. `--precompile-token-paddings`; the
    full grid of token x sequence buckets). `default_seqs`: the sequence buckets that follow
    the token buckets where `seq_paddings` is not given (default: powers of two)."""
    return Buckets(
        tokens=_sorted(token_paddings) or pow2_buckets(8, max_tokens_per_step),
        seqs=(_sorted(seq_paddings) or _sorted(default_seqs)
              or pow2_buckets(1, max_seqs)),
        pages=_sorted(page_paddings) or pow2_buckets(1, max_pages_per_seq),
        grid=bool(seq_paddings),
        verify_tokens=verify_tokens,
        tree=tree,
    )


def _sorted(values) -> tuple[int, ...] | None:
    return tuple(sorted(set(int(v) for v in values))) if values else None


def with_page_size(args, platform: str, context_length: int, kv_dtype=None):
    """`args` (ServerArgs) with --page-size resolved: as given, or the platform's default
    (api.default_page_size) for a KV cache of `kv_dtype` (None: float32 or bfloat16)."""
    if args.page_size:
        return args
    page_size = default_page_size(platform, args.max_running_requests, context_length, kv_dtype)
    return dataclasses.replace(args, page_size=page_size)


def serving_buckets(args, context_length: int, head_dim: int, dtype, platform: str,
                    native_matmul: bool = False, latent: tuple[int, int] | None = None,
                    kv_dtype=None) -> Buckets:
    """The buckets a server with `args` (ServerArgs, --page-size resolved) precompiles on
    `platform` for a model of `dtype` and a KV cache of `kv_dtype` (None: `dtype`). Raises
    ValueError where the attention kernel cannot take them (api.check_shapes; `latent`: a
    latent-attention model's (value_dim, row width), `MLAConfig.kernel_widths`), so that a server
    says so at start-up instead of failing inside XLA's compile."""
    verify_tokens = args.speculative_num_draft_tokens if args.speculative_algorithm else 1
    step_tokens = max_step_tokens(args.max_running_requests, args.max_prefill_tokens)
    pages = pages_for_tokens(context_length, args.page_size)
    buckets = buckets_for_limits(
        step_tokens, args.max_running_requests, pages,
        token_paddings=_int_list(args.precompile_token_paddings) or default_token_buckets(
            step_tokens, dtype, platform, native_matmul=native_matmul,
            max_seqs=args.max_running_requests),
        seq_paddings=_int_list(args.precompile_bs_paddings),
        default_seqs=default_seq_buckets(args.max_running_requests, platform),
        # One page-table width: the attention loop stops at the longest live sequence, so a
        # wide table costs little, and each extra width would multiply the compiled programs.
        page_paddings=[pages],
        verify_tokens=verify_tokens,
        tree=bool(args.speculative_algorithm) and (args.speculative_eagle_topk or 1) > 1,
    )
    check_shapes(args.attention_backend, platform, page_size=args.page_size, head_dim=head_dim,
                 dtype=kv_dtype or dtype, max_seqs=max(buckets.seqs),
                 pages_per_seq=max(buckets.pages),
                 latent=latent)
    return buckets


def _int_list(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",")] if text else None
