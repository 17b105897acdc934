"""Padding buckets: every jitted step runs at one of a few known shapes.

XLA compiles one program per input shape, so the token count, the sequence count and the pages per
sequence of a batch are each rounded up to a bucket (powers of two by default). All buckets are
compiled at start-up; a batch that fits none of them is a scheduling bug, not a reason to compile.
"""
from __future__ import annotations

import bisect
import dataclasses


def pow2_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` up to the first one >= `largest`."""
    if smallest < 1 or largest < smallest:
        raise ValueError(f"bad bucket range [{smallest}, {largest}]")
    buckets, size = [], 1 << (smallest - 1).bit_length()
    while True:
        buckets.append(size)
        if size >= largest:
            return tuple(buckets)
        size *= 2


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

    @classmethod
    def for_limits(cls, max_tokens_per_step: int, max_seqs: int, max_pages_per_seq: int,
                   token_paddings=None, seq_paddings=None, page_paddings=None) -> "Buckets":
        """Default power-of-two lists, or the caller's (e.g. `--precompile-token-paddings`)."""
        return cls(
            tokens=_sorted(token_paddings) or pow2_buckets(8, max_tokens_per_step),
            seqs=_sorted(seq_paddings) or pow2_buckets(1, max_seqs),
            pages=_sorted(page_paddings) or pow2_buckets(1, max_pages_per_seq),
        )

    def shape_for(self, num_tokens: int, num_seqs: int, pages_per_seq: int) -> tuple[int, int, int]:
        # A step has at least as many token slots as sequences (every sequence adds >= 1 token).
        seqs = bucket_for(num_seqs, self.seqs)
        tokens = bucket_for(max(num_tokens, 1), self.tokens)
        return tokens, seqs, bucket_for(max(pages_per_seq, 1), self.pages)

    def all_shapes(self) -> list[tuple[int, int, int]]:
        """Every (tokens, seqs, pages) a step can take: the set to precompile. Sequence buckets
        larger than the token bucket cannot occur and are skipped."""
        return [(t, s, p) for t in self.tokens for s in self.seqs if s <= t for p in self.pages]


def _sorted(values) -> tuple[int, ...] | None:
    return tuple(sorted(set(int(v) for v in values))) if values else None
