"""Padding buckets: every jitted step runs at one of a few known shapes.

XLA compiles one program per input shape, so the token count, the sequence count and the pages per
sequence of a batch are each rounded up to a bucket (powers of two by default). All buckets are
compiled at start-up; a batch that fits none of them is a scheduling bug, not a reason to compile.

By default the sequence bucket follows the token bucket (min(tokens, most sequences)), so there is
one program per token bucket: a step of the default model compiles in ~8 s on a 2-core CPU, and a
grid of token x sequence buckets (50 programs) took 7 minutes to precompile. Padding sequences
cost little (a dead row of the LM head and of the sampler). Giving sequence buckets explicitly
(`--precompile-bs-paddings`) asks for the full grid instead.
"""
from __future__ import annotations

import bisect
import dataclasses

import jax.numpy as jnp

from xlaserve.pallas_kernels.ragged_paged_attention.api import check_shapes, default_page_size
from xlaserve.runtime.scheduler.page_allocator import pages_for_tokens
from xlaserve.runtime.scheduler.step_budget import max_step_tokens


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


def default_token_buckets(max_tokens: int, dtype, platform: str,
                          native_matmul: bool = False) -> tuple[int, ...]:
    """Token-count buckets by default: powers of two, shaped by what matmuls cost.

    On the CPU with the native GEMM (its cost grows smoothly with the rows), every power of two
    from 1.
    Without it, XLA's dots decide: a 1-row float32 step runs as matrix-vector products (the
    default model: 26 ms) but 2 rows cost more than 4 (50 vs 38 ms), so float32 skips 2; a 1-row
    bfloat16 step falls off the fast bfloat16 path (186 ms against 29 ms for 2 rows), so
    bfloat16 starts at 2. On TPU and GPU, steps under 8 tokens cost about what 8 cost, and fewer
    programs compile faster."""
    if platform != "cpu":
        return pow2_buckets(min(8, max_tokens), max_tokens)
    if native_matmul:
        return pow2_buckets(1, max_tokens)
    if jnp.dtype(dtype) == jnp.bfloat16:
        return pow2_buckets(min(2, max_tokens), max_tokens)
    return tuple(b for b in pow2_buckets(1, max_tokens) if b != 2 or b == max_tokens)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} is over the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclasses.dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]  # packed new tokens per step
    seqs: tuple[int, ...]  # sequences per step
    pages: tuple[int, ...]  # pages per sequence in the page table
    grid: bool = False  # every (tokens, seqs) pair, or one sequence bucket per token bucket

    @classmethod
    def for_limits(cls, max_tokens_per_step: int, max_seqs: int, max_pages_per_seq: int,
                   token_paddings=None, seq_paddings=None, page_paddings=None) -> "Buckets":
        """Default power-of-two lists, or the caller's (e.g. `--precompile-token-paddings`)."""
        return cls(
            tokens=_sorted(token_paddings) or pow2_buckets(8, max_tokens_per_step),
            seqs=_sorted(seq_paddings) or pow2_buckets(1, max_seqs),
            pages=_sorted(page_paddings) or pow2_buckets(1, max_pages_per_seq),
            grid=bool(seq_paddings),
        )

    def step_shapes(self) -> list[tuple[int, int]]:
        """The (tokens, seqs) pairs a step can take, smallest first. A step has at least as many
        token slots as sequences (each sequence adds >= 1 token), so seqs <= tokens."""
        if self.grid:
            return [(t, s) for t in self.tokens for s in self.seqs if s <= t]
        return [(t, bucket_for(min(t, self.seqs[-1]), self.seqs)) for t in self.tokens]

    def shape_for(self, num_tokens: int, num_seqs: int, pages_per_seq: int) -> tuple[int, int, int]:
        pages = bucket_for(max(pages_per_seq, 1), self.pages)
        for tokens, seqs in self.step_shapes():
            if tokens >= num_tokens and seqs >= num_seqs:
                return tokens, seqs, pages
        raise ValueError(f"a step of {num_tokens} tokens and {num_seqs} sequences is over the "
                         f"largest bucket {self.step_shapes()[-1]}")

    def all_shapes(self) -> list[tuple[int, int, int]]:
        """Every (tokens, seqs, pages) a step can take: the set to precompile."""
        return [(t, s, p) for t, s in self.step_shapes() for p in self.pages]


def _sorted(values) -> tuple[int, ...] | None:
    return tuple(sorted(set(int(v) for v in values))) if values else None


def with_page_size(args, platform: str, context_length: int):
    """`args` (ServerArgs) with --page-size resolved: as given, or the platform's default
    (api.default_page_size)."""
    if args.page_size:
        return args
    page_size = default_page_size(platform, args.max_running_requests, context_length)
    return dataclasses.replace(args, page_size=page_size)


def serving_buckets(args, context_length: int, head_dim: int, dtype, platform: str,
                    native_matmul: bool = False, latent: tuple[int, int] | None = None) -> Buckets:
    """The buckets a server with `args` (ServerArgs, --page-size resolved) precompiles on
    `platform`. Raises ValueError where the attention kernel cannot take them (api.check_shapes;
    `latent`: a latent-attention model's (value_dim, row width), `MLAConfig.kernel_widths`), so
    that a server says so at start-up instead of failing inside XLA's compile."""
    step_tokens = max_step_tokens(args.max_running_requests, args.max_prefill_tokens)
    pages = pages_for_tokens(context_length, args.page_size)
    buckets = Buckets.for_limits(
        step_tokens, args.max_running_requests, pages,
        token_paddings=_int_list(args.precompile_token_paddings) or default_token_buckets(
            step_tokens, dtype, platform, native_matmul=native_matmul),
        seq_paddings=_int_list(args.precompile_bs_paddings),
        # One page-table width: the attention loop stops at the longest live sequence, so a
        # wide table costs little, and each extra width would multiply the compiled programs.
        page_paddings=[pages],
    )
    check_shapes(args.attention_backend, platform, page_size=args.page_size, head_dim=head_dim,
                 dtype=dtype, max_seqs=max(buckets.seqs), pages_per_seq=max(buckets.pages),
                 latent=latent)
    return buckets


def _int_list(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",")] if text else None
