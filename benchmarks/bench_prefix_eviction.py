"""Host time of the prefix cache's evictions in a server's steady state: the pool is full of
cached prompts and running requests, so every page a decoding row needs is an eviction.

    python benchmarks/bench_prefix_eviction.py [--cached-prompts 1000,8000] [--page-size 16]

A tree of N cached 4-page prompts (under 8 shared first pages, as system prompts are), every
free page then taken by running requests; timed: 16 one-page allocations, the page boundaries
a 256-row decode step crosses at 16-token pages, in ms a step (mean of 20 steps). Uses only
RadixCache's public methods, so it runs on older commits too, for a side-by-side comparison.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from xlaserve.runtime.scheduler.page_allocator import PageAllocator
from xlaserve.runtime.scheduler.prefix_cache import RadixCache  # noqa: E402


def full_cache(cached_prompts: int, page_size: int, seed: int = 0) -> RadixCache:
    cache = RadixCache(PageAllocator(cached_prompts * 4 + 1), page_size)
    rng = random.Random(seed)
    for i in range(cached_prompts):
        ids = [i % 8] * page_size + [rng.randrange(50000) for _ in range(3 * page_size)]
        pages = cache.allocate(4)
        tree_pages, _ = cache.insert(ids, pages)
        cache.allocator.free([p for p, t in zip(pages, tree_pages) if p != t])
    cache.allocator.allocate(cache.allocator.num_free)  # the running requests' pages
    return cache


def ms_per_step(cache: RadixCache, steps: int = 20, pages_per_step: int = 16) -> float:
    start = time.perf_counter()
    for _ in range(steps * pages_per_step):
        cache.allocate(1)
    return (time.perf_counter() - start) / steps * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cached-prompts", default="1000,8000")
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    for n in map(int, args.cached_prompts.split(",")):
        ms = ms_per_step(full_cache(n, args.page_size))
        print(f"{n:>6} cached prompts: {ms:8.3f} ms a step of 16 page allocations")


if __name__ == "__main__":
    main()
