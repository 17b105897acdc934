"""The prefix cache's host tier in host memory (`--enable-hierarchical-cache`), and the copies
between it and the device KV pool that the radix tree owes (runtime/scheduler/host_tier.py).

One array per layer, `[host_pages + 1, page_size, row]` in the pool's dtype (page 0 unused, as
in the device pool), split over the mesh as the device pool's layers are. Where XLA compiles
copies to and from host memory (GPUs and the CPU), it is a JAX array in pinned host memory
(memory kind "pinned_host": the transfers are DMAs, no staging copy): a save is one program that
gathers the evicted pages of every layer and scatters them into the host arrays, a load one that
gathers host pages and scatters them into the device pages (the caches donated, updated in
place). Both are dispatched without waiting and ordered by their operands, as the steps are: the
engine thread schedules the next step while the device runs the last one.

On TPU, libtpu does not compile a gather or scatter on host memory (XLA's host compute; tried
2026-11-28 for v6e: "Fusion must have backend config"), so the host arrays are NumPy's there:
a save gathers on the device and starts the rows' copy to the host (`copy_to_host_async`),
landed into the arrays at the next `apply` (the device ran the gather before the step it was
running) or before a load reads them; a load puts the rows on the device and scatters them.

Each copy runs in pieces of at most COPY_PAGES pages, padded to a power of two, so that its
programs are a few shapes, all compiled at start-up (`precompile`): no compile while serving.
Padding rows read page 0 and write nowhere (an index past the array, dropped).

On the CPU the device pool is host memory too: the tier is the same form (a lossless copy, in
the cache's dtype) in more of the same RAM, useful where `--max-total-tokens` keeps the device
pool small; the start-up line says so.
"""
from __future__ import annotations

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
PINNED = "pinned_host"


def _buckets(most: int) -> list[int]:
    sizes, size = [], 1
    while size < most:
        sizes.append(size)
        size *= 2
    return sizes + [most]


def _move(sources, targets, read, write, shardings) -> list[jax.Array]:
    """Every layer's rows `read` of `sources` written at `write` of `targets`, carried into
    `shardings`' memory (pinned host or device) on the way; `write` padding past the end drops."""
    return [target.at[write].set(jax.device_put(source[read], sharding), mode="drop")
            for source, target, sharding in zip(sources, targets, shardings)]


def pinned_on(platform: str) -> bool:
    """Whether the host arrays are JAX arrays in pinned host memory (else NumPy): see above."""
    return platform in ("gpu", "cpu")


class HostKvPool:
    def __init__(self, kv_specs: list[jax.ShapeDtypeStruct], num_pages: int,
                 pinned: bool | None = None, allocate: bool = True):
        """`kv_specs`: the device pool's layers (kv_pool.kv_pool_specs, without a draft head's
        state); `num_pages`: the host tier's pages; `pinned`: JAX arrays in pinned host memory
        (None: where the platform compiles their copies, `pinned_on`); `allocate` False: no
        arrays, the programs only (compile-only devices)."""
        spec = kv_specs[0]
        mesh = spec.sharding.mesh
        platform = mesh.devices.flat[0].platform
        self.pinned = pinned_on(platform) if pinned is None else pinned
        self.device_pages = spec.shape[0]
        self.sizes = _buckets(min(COPY_PAGES, max(num_pages, 1)))
        self._specs = kv_specs
        device = [one.sharding for one in kv_specs]
        self._index = NamedSharding(mesh, P())  # the page indices
        # Per layer: the layers' caches may differ in width (ModelConfig.layer).
        shapes = [(num_pages + 1,) + one.shape[1:] for one in kv_specs]
        self.host_rows = num_pages + 1
        if self.pinned:
            host = [NamedSharding(mesh, one.sharding.spec, memory_kind=PINNED) for one in kv_specs]
            self._host_index = NamedSharding(mesh, P(), memory_kind=PINNED)
            self._host_specs = [jax.ShapeDtypeStruct(shape, one.dtype, sharding=sharding)
                                for one, shape, sharding in zip(kv_specs, shapes, host)]
            self.buffers = [jax.jit(lambda dtype=one.dtype, shape=shape: jnp.zeros(shape, dtype),
                                    out_shardings=sharding)()
                            for one, shape, sharding in zip(kv_specs, shapes, host)
                            ] if allocate else []
            # Save: the device pages' rows into host pages; load: host pages' into device pages.
            self._save_fn = jax.jit(
                lambda caches, buffers, device_pages, host_pages: _move(
                    caches, buffers, device_pages, host_pages, host),
                donate_argnums=1, out_shardings=host)
            self._load_fn = jax.jit(
                lambda caches, buffers, host_pages, device_pages: _move(
                    buffers, caches, host_pages, device_pages, device),
                donate_argnums=0, out_shardings=device)
        else:
            self.buffers = ([np.zeros(shape, one.dtype) for one, shape in zip(kv_specs, shapes)]
                            if allocate else [])
            self._save_fn = jax.jit(lambda caches, index: [cache[index] for cache in caches],
                                    out_shardings=device)
            self._load_fn = jax.jit(
                lambda caches, index, rows: [cache.at[index].set(row, mode="drop")
                                             for cache, row in zip(caches, rows)],
                donate_argnums=0, out_shardings=device)
        self._device = device
        self._compiled: dict[tuple[str, int], object] = {}
        self._pending: list[tuple[np.ndarray, int, list[jax.Array]]] = []  # NumPy's saves

    def precompile(self) -> None:
        """Every copy program, for every piece size."""
        for size in self.sizes:
            at = lambda sharding: jax.ShapeDtypeStruct((size,), jnp.int32, sharding=sharding)  # noqa: E731
            if self.pinned:
                save = self._save_fn.lower(self._specs, self._host_specs, at(self._index),
                                           at(self._host_index))
                load = self._load_fn.lower(self._specs, self._host_specs, at(self._host_index),
                                           at(self._index))
            else:
                rows = [jax.ShapeDtypeStruct((size,) + one.shape[1:], one.dtype,
                                             sharding=one.sharding) for one in self._specs]
                save = self._save_fn.lower(self._specs, at(self._index))
                load = self._load_fn.lower(self._specs, at(self._index), rows)
            self._compiled[SAVE, size], self._compiled[LOAD, size] = save.compile(), load.compile()

    def _program(self, kind: str, size: int):
        program = self._compiled.get((kind, size))
        if program is None:  # precompile() not run (tests): compiled here, once
            logger.warning("COMPILED WHILE SERVING: the host tier's %s of %d pages", kind, size)
            program = self._compiled[kind, size] = self._save_fn if kind == SAVE else self._load_fn
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
        """`pages` padded with `fill` to the piece size that holds them."""
        size = next(s for s in self.sizes if s >= len(pages))
        index = np.full(size, fill, np.int32)
        index[:len(pages)] = pages
        return index

    def _save(self, caches, device_pages: list[int], host_pages: list[int]) -> None:
        source = jax.device_put(self._padded(device_pages, 0), self._index)  # padding: page 0
        size = source.shape[0]
        if self.pinned:  # padding writes past the host arrays: dropped
            target = jax.device_put(self._padded(host_pages, self.host_rows), self._host_index)
            self.buffers = self._program(SAVE, size)(caches, self.buffers, source, target)
            return
        rows = self._program(SAVE, size)(caches, source)
        for row in rows:
            row.copy_to_host_async()
        self._pending.append((np.asarray(host_pages), len(host_pages), rows))

    def land(self, reading: list[int] | None = None) -> None:
        """NumPy's host arrays: the saves started so far written into them, waiting for their
        copies; with `reading` (host pages a load is about to read), only as far as the last
        save into one of them: a save of this round was dispatched after the step the device is
        running, and waiting for it would stall the overlap of host and device."""
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
        target = jax.device_put(self._padded(device_pages, self.device_pages),  # padding: dropped
                                self._index)
        size, source = target.shape[0], self._padded(host_pages, 0)
        if self.pinned:
            return self._program(LOAD, size)(caches, self.buffers,
                                             jax.device_put(source, self._host_index), target)
        self.land(reading=host_pages)  # a page saved earlier in this round is read back
        rows = [jax.device_put(buffer[source], sharding)
                for buffer, sharding in zip(self.buffers, self._device)]
        return self._program(LOAD, size)(caches, target, rows)


class HostTierCopies:
    """The step hook (runtime/engine/steps.py) of --enable-hierarchical-cache: before each step,
    the copies the prefix cache's tiers owe (host_tier.HostTier.take_copies), made first."""

    def __init__(self, pool: HostKvPool, runner, take_copies):
        self.pool, self.runner, self.take_copies = pool, runner, take_copies

    def before_stage(self, batch) -> None:
        self.runner.kv_caches = self.pool.apply(self.runner.kv_caches, self.take_copies())


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
             "pool small" if platform == "cpu" else "pinned host memory" if pinned_on(platform)
             else "host RAM (NumPy arrays: libtpu compiles no copies into pinned host memory)")
    logger.info("Hierarchical cache: a host tier of %d pages (%.2f GB, %s) beside the device "
                "pool's %d, in %s", pages, pages * page_bytes / 1e9, how, device_pages - 1, where)
    return pages
