"""The prefix cache's host tier in host memory (`--enable-hierarchical-cache`), and the copies
between it and the device KV pool that the radix tree owes (runtime/scheduler/host_tier.py).

One NumPy array per layer, `[host_pages + 1, page_size, row]` in the pool's dtype (page 0 unused,
as in the device pool). A save gathers the evicted pages of every layer on the device (one
program) and starts their copy to the host (`copy_to_host_async`) without waiting: the engine
thread schedules the next step while the device still runs the last one, and waiting here would
stall it. The copies land in the host arrays at the next `apply` (by then the device has run the
gather, which came before the step it was waiting on) or before a load reads them. A load puts
the host pages' rows on the device and scatters them into their pages (the cache donated,
updated in place); JAX runs it before the step that reads them, which takes its output.

Each copy runs in pieces of at most COPY_PAGES pages, padded to a power of two, so that its
programs are a few shapes, all compiled at start-up (`precompile`): no compile while serving.
Padding rows gather page 0 and scatter nowhere (an index past the pool, dropped).

On the CPU the device pool is host memory too: the tier is the same form (a lossless copy, in
the cache's dtype) in more of the same RAM, useful where `--max-total-tokens` keeps the device
pool small; the start-up line says so.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.runtime.executor.kv_pool import host_free_bytes
from xlaserve.runtime.scheduler.host_tier import LOAD, SAVE

logger = logging.getLogger(__name__)

COPY_PAGES = 256  # pages a copy program moves at most: larger copies run in pieces


def _buckets(most: int) -> list[int]:
    sizes, size = [], 1
    while size < most:
        sizes.append(size)
        size *= 2
    return sizes + [most]


class HostKvPool:
    def __init__(self, kv_specs: list[jax.ShapeDtypeStruct], num_pages: int):
        """`kv_specs`: the device pool's layers (kv_pool.kv_pool_specs, without a draft head's
        state); `num_pages`: the host tier's pages."""
        spec = kv_specs[0]
        self.num_layers = len(kv_specs)
        self.device_pages = spec.shape[0]
        self.buffers = [np.zeros((num_pages + 1,) + spec.shape[1:], spec.dtype)
                        for _ in kv_specs]
        self.nbytes = sum(buffer.nbytes for buffer in self.buffers)
        self.sizes = _buckets(min(COPY_PAGES, max(num_pages, 1)))
        shardings = [one.sharding for one in kv_specs]
        self._row_shardings = shardings
        self._replicated = NamedSharding(spec.sharding.mesh, P())  # the page indices
        self._gather = jax.jit(lambda caches, index: [cache[index] for cache in caches],
                               out_shardings=shardings)
        self._scatter = jax.jit(
            lambda caches, index, rows: [cache.at[index].set(row, mode="drop")
                                         for cache, row in zip(caches, rows)],
            donate_argnums=0, out_shardings=shardings)
        self._specs = kv_specs
        self._compiled: dict[tuple[str, int], object] = {}
        self._pending: list[tuple[np.ndarray, int, list[jax.Array]]] = []

    def precompile(self) -> None:
        """Every copy program, for every piece size."""
        index = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32,
                                  sharding=self._replicated)
        for size in self.sizes:
            rows = [jax.ShapeDtypeStruct((size,) + one.shape[1:], one.dtype,
                                         sharding=one.sharding) for one in self._specs]
            self._compiled[SAVE, size] = self._gather.lower(self._specs, index((size,))).compile()
            self._compiled[LOAD, size] = self._scatter.lower(self._specs, index((size,)),
                                                             rows).compile()

    def _program(self, kind: str, size: int):
        program = self._compiled.get((kind, size))
        if program is None:  # precompile() not run (tests): compiled here, once
            logger.warning("COMPILED WHILE SERVING: the host tier's %s of %d pages", kind, size)
            program = self._gather if kind == SAVE else self._scatter
        return program

    def apply(self, caches: list[jax.Array], copies) -> list[jax.Array]:
        """Makes `copies` ((SAVE, device pages, host pages) or (LOAD, host pages, device
        pages), host_tier.HostTier.take_copies) in order; returns the caches after them."""
        self.land()
        for kind, source, target in copies:
            for start in range(0, len(source), COPY_PAGES):
                piece = slice(start, start + COPY_PAGES)
                if kind == SAVE:
                    self._save(caches, source[piece], target[piece])
                else:
                    caches = self._load(caches, source[piece], target[piece])
        return caches

    def _padded(self, pages: list[int], fill: int) -> np.ndarray:
        size = next(s for s in self.sizes if s >= len(pages))
        index = np.full(size, fill, np.int32)
        index[:len(pages)] = pages
        return index

    def _on_device(self, index: np.ndarray) -> jax.Array:
        return jax.device_put(index, self._replicated)

    def _save(self, caches, device_pages: list[int], host_pages: list[int]) -> None:
        index = self._padded(device_pages, 0)  # padding reads page 0, never kept
        rows = self._program(SAVE, len(index))(caches, self._on_device(index))
        for row in rows:
            row.copy_to_host_async()
        self._pending.append((np.asarray(host_pages), len(host_pages), rows))

    def land(self, reading: list[int] | None = None) -> None:
        """The saves started so far written into the host arrays, waiting for their copies; with
        `reading` (host pages a load is about to read), only as far as the last save into one of
        them: a save of this round was dispatched after the step the device is running, and
        waiting for it would stall the overlap of host and device."""
        count = len(self._pending)
        if reading is not None:
            wanted = set(reading)
            count = max((i + 1 for i, (pages, _, _) in enumerate(self._pending)
                         if wanted.intersection(pages.tolist())), default=0)
        for host_pages, used, rows in self._pending[:count]:
            for buffer, row in zip(self.buffers, rows):
                buffer[host_pages] = np.asarray(row)[:used]
        del self._pending[:count]

    def _load(self, caches, host_pages: list[int], device_pages: list[int]):
        self.land(reading=host_pages)  # a page saved earlier in this round is read back
        index = self._padded(device_pages, self.device_pages)  # padding: dropped
        take = self._padded(host_pages, 0)
        rows = [jax.device_put(buffer[take], sharding)
                for buffer, sharding in zip(self.buffers, self._row_shardings)]
        return self._program(LOAD, len(index))(caches, self._on_device(index), rows)


def host_tier_pages(args, device_pages: int, page_bytes: int, platform: str) -> int:
    """The host tier's pages for `args` (ServerArgs: --hicache-size GB, else --hicache-ratio of
    the device pool's pages), `page_bytes` a page across every layer (whole: the host holds all
    of a tensor-parallel page's shards). More than the host's free RAM stops start-up; the line
    that says what it holds is logged here."""
    if args.hicache_size:
        pages = int(args.hicache_size * 1e9 // page_bytes)
        how = f"--hicache-size {args.hicache_size}"
    else:
        pages = int(args.hicache_ratio * (device_pages - 1))
        how = f"--hicache-ratio {args.hicache_ratio:g}"
    free = host_free_bytes()
    if pages < 1 or pages * page_bytes > 0.9 * free:
        raise ValueError(f"--enable-hierarchical-cache: a host tier of {pages} pages "
                         f"({pages * page_bytes / 1e9:.2f} GB, {how}) does not fit 90% of the "
                         f"host's {free / 1e9:.2f} GB of free RAM")
    where = ("this host's RAM, as the device pool is: it keeps evicted prefixes in the cache's "
             "dtype (a lossless copy), which helps where --max-total-tokens keeps the device "
             "pool small" if platform == "cpu" else "host RAM (NumPy arrays)")
    logger.info("Hierarchical cache: a host tier of %d pages (%.2f GB, %s) beside the device "
                "pool's %d, in %s", pages, pages * page_bytes / 1e9, how, device_pages - 1, where)
    return pages
