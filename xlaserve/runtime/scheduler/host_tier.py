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

import heapq
import itertools
from typing import Any, Protocol

from xlaserve.runtime.scheduler.page_allocator import PageAllocator

SAVE, LOAD = "save", "load"  # device -> host, host -> device


class _Tree(Protocol):
    """What the host tier uses of the radix tree whose evicted nodes it holds (prefix_cache.py,
    which calls it: not imported here)."""

    num_nodes: int

    def drop(self, node: Any) -> None: ...

    def push_if_evictable(self, node: Any) -> None: ...


class HostTier:
    """Host pages 1..num_pages (0 is never handed out, as in the device pool), the owed copies:
    (SAVE, device pages, host pages) or (LOAD, host pages, device pages), and the tree's nodes on
    the host that have no children, least recently used first (the ones it may drop)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError("the host tier needs at least one page")
        self.allocator = PageAllocator(num_pages + 1)
        self.copies: list[tuple[str, list[int], list[int]]] = []
        self._last_targets: set[int] = set()  # the pages the last copy writes
        self.saved_pages = self.loaded_pages = 0  # since start: pages moved out and back in
        # (last access, push order, node) of host leaves as they appear; stale entries (a node
        # loaded, dropped or given a child since) are skipped when popped.
        self._heap: list[tuple[int, int, Any]] = []
        self._push_order = itertools.count()

    def take(self, node, tree: _Tree) -> bool:
        """Moves a node the tree evicts from the device onto host pages (a save the executor
        makes before the next step), making room from its LRU leaves; False where it is larger
        than the tier or there is not room enough (the tree then drops it)."""
        if len(node.pages) > self.allocator.capacity:
            return False
        if not self.make_room(len(node.pages) - self.allocator.num_free, tree):
            return False
        host_pages = self.allocator.allocate(len(node.pages))
        self.save(node.pages, host_pages)
        node.pages, node.on_host = host_pages, True
        self.push_if_leaf(node, tree.num_nodes)
        return True

    def make_room(self, num_pages: int, tree: _Tree) -> bool:
        """Drops host leaves (no children), least recently used first, until `num_pages` host
        pages are freed; False if it cannot (the rest are pinned or inner nodes)."""
        freed, heap = 0, self._heap
        while freed < num_pages and heap:
            access, _, leaf = heapq.heappop(heap)
            if not leaf.on_host or leaf.parent is None or leaf.children or leaf.pinned:
                continue  # stale: loaded, dropped, given a child, or being loaded
            if access != leaf.last_access:  # touched since: back in at its new place
                self.push_if_leaf(leaf, tree.num_nodes)
                continue
            freed += len(leaf.pages)
            parent = leaf.parent
            self.allocator.free(leaf.pages)
            tree.drop(leaf)
            if parent.on_host:
                self.push_if_leaf(parent, tree.num_nodes)
            else:
                tree.push_if_evictable(parent)
        return freed >= num_pages

    def push_if_leaf(self, node, num_nodes: int) -> None:
        """Enters a host node with no children in the LRU heap (`num_nodes`: the tree's, to
        rebuild the heap when stale entries outnumber them)."""
        if node.on_host and not node.children and node.parent is not None:
            if len(self._heap) > 2 * num_nodes + 64:  # mostly stale: rebuild it
                self._heap = [entry for entry in self._heap
                              if entry[2].parent is not None and entry[2].on_host]
                heapq.heapify(self._heap)
            heapq.heappush(self._heap, (node.last_access, next(self._push_order), node))

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
