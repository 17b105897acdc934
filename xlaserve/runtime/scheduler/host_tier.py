"""The prefix cache's host-memory tier (SGLang's HiCache, `--enable-hierarchical-cache`): a second
pool of KV pages in host memory that the radix tree moves cached pages into when it evicts them
from the device pool, and back out of when a request's prefix matches them (prefix_cache.py).

This file is its bookkeeping on the engine thread, in plain Python as the rest of the scheduler:
the host pages' free list and the copies the executor owes before the next step, in the order
the tree asked for them (runtime/executor/host_kv_pool.py makes them). Order matters: a device
page saved to the host may be handed out again and loaded into in the same round, and a host
page loaded from may be freed and saved into again; done in order, each copy reads what the one
before it left."""
from __future__ import annotations

from xlaserve.runtime.scheduler.page_allocator import PageAllocator

SAVE, LOAD = "save", "load"  # device -> host, host -> device


class HostTier:
    """Host pages 1..num_pages (0 is never handed out, as in the device pool) and the owed
    copies: (SAVE, device pages, host pages) or (LOAD, host pages, device pages)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError("the host tier needs at least one page")
        self.allocator = PageAllocator(num_pages + 1)
        self.copies: list[tuple[str, list[int], list[int]]] = []
        self._last_targets: set[int] = set()  # the pages the last copy writes
        self.saved_pages = self.loaded_pages = 0  # since start: pages moved out and back in

    def save(self, device_pages: list[int], host_pages: list[int]) -> None:
        self.saved_pages += len(device_pages)
        self._add(SAVE, device_pages, host_pages)

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        self.loaded_pages += len(host_pages)
        self._add(LOAD, host_pages, device_pages)

    def _add(self, kind: str, source: list[int], target: list[int]) -> None:
        """Joins the last copy where it is of the same kind and writes none of the same pages
        (a page written twice in one copy would be a scatter of two values to one place)."""
        last = self.copies[-1] if self.copies else None
        if last is not None and last[0] == kind and self._last_targets.isdisjoint(target):
            last[1].extend(source)
            last[2].extend(target)
        else:
            self.copies.append((kind, list(source), list(target)))
            self._last_targets = set()
        self._last_targets.update(target)

    def take_copies(self) -> list[tuple[str, list[int], list[int]]]:
        """The owed copies, in order; the executor makes them before the next step."""
        copies, self.copies = self.copies, []
        return copies
