"""The prefix cache of a hybrid model (issue 76): a cached prefix is usable only where a snapshot
of its linear layers' state exists, since those layers keep no per-token cache to resume from.

SGLang's answer for Mamba models (its MambaRadixCache) is followed: the radix tree stays the
KV pages' (prefix_cache.py), and a node may also hold a snapshot, a slot of the state pool
(runtime/executor/state_pool.py) with the state after the node's last token. A prefix match ends
at the deepest node on the path that has one; that node's pages and snapshot are the request's
start, the snapshot copied into the request's own slot before its first chunk runs. Snapshots
are kept apart from pages: a node may lose its snapshot (LRU among unlocked nodes, when a new one
needs the slot) and keep its pages, which then serve no match until a request passes there again.

Where snapshots are taken: at a prompt's last whole page (`(num_tokens - 1) // page_size` pages,
what a repeat of the prompt, or a longer one such as the next turn of a chat, can reuse), the
prefill chunk that crosses it cut there, and the request's state copied into a snapshot slot at
the end of that step; and while it decodes, at each page boundary its decode row reaches
(`decode_snapshot`), each new one replacing the request's last, so that when it ends its answer
is snapshotted at its last whole page. A snapshot is a request's linear layers' whole state
(79 MB in Qwen3-Next-80B, where its KV grows by 24 KB a token): a request holds two at most, its
prompt's and its answer's latest; the copy costs a state's bytes every `page_size` tokens of an
answer. A chat's next turn thus reuses the turns before it and the last answer up to its last
whole page (SGLang's MambaRadixCache keeps the state of a finished request's tokens, at any
length: its pages are of one token), and runs the answer's last page and the new message.

The device work: a step carries at most STATE_COPIES restores and as many snapshots (the
step's `StateCopies`); a request whose restore finds the step full waits for the next one, a
snapshot that does not fit is not taken.
"""
from __future__ import annotations

from collections.abc import Sequence

from xlaserve.runtime.scheduler.prefix_cache import RadixCache, TreeNode
from xlaserve.runtime.scheduler.prefix_reuse import PrefixReuse, _Request

# Restores, and snapshots, a step carries at most (runtime/executor/state_pool.py reads it).
STATE_COPIES = 8


class StateSnapshots:
    """The state pool's snapshot slots and the tree nodes that hold them."""

    def __init__(self, slots: range):
        self.free = list(reversed(slots))  # pop() hands out low ids first
        self.holders: set[TreeNode] = set()

    def take(self) -> int | None:
        """A free slot, or the least recently used unlocked holder's (its node keeps its pages),
        or else a locked one's: a running request needs its prefix's snapshot only for its
        restore, which a step scheduled no later than this copy's reads first (steps run in
        order; in a step, restores come before the forward and snapshots after). In a chat every
        earlier turn's snapshot is on the running turn's path, locked. None without holders."""
        if not self.free:
            if not self.holders:
                return None
            unlocked = [node for node in self.holders if node.lock_ref == 0]
            self.release(min(unlocked or self.holders, key=lambda node: node.last_access))
        return self.free.pop()

    def attach(self, node: TreeNode, slot: int) -> bool:
        """`slot` holds the state at `node`'s end; a node that has one keeps it (the same state:
        equal prefixes), and `slot` is free again. Whether `node` took it."""
        if node.snapshot is not None or node.parent is None:
            self.put_back(slot)
            return False
        node.snapshot = slot
        self.holders.add(node)
        return True

    def release(self, node: TreeNode) -> None:
        """`node` loses its snapshot (it is evicted, or its slot is wanted)."""
        self.put_back(node.snapshot)
        node.snapshot = None
        self.holders.discard(node)

    def put_back(self, slot: int) -> None:
        """`slot` is free again (a step still running may write it: whoever takes it next
        writes later, steps run in order)."""
        self.free.append(slot)


class StatePrefixReuse(PrefixReuse):
    """PrefixReuse (prefix_reuse.py) for a hybrid model: matches end at a snapshot, prompts are
    snapshotted at their last whole page (module docstring)."""

    def __init__(self, cache: RadixCache, page_size: int, enabled: bool, snapshot_slots: range):
        super().__init__(cache, page_size, enabled)
        self.snapshots = StateSnapshots(snapshot_slots)
        cache.snapshots = self.snapshots  # an evicted node's snapshot is freed with its pages
        self._restores: dict[int, int] = {}  # id(request) -> the snapshot its first chunk restores
        # id(request) -> (tokens, snapshot slot, whether a decode row's)
        self._pending: dict[int, tuple[int, int, bool]] = {}
        self._answers: dict[int, tuple[TreeNode, int]] = {}  # id(request) -> its decode snapshot
        self._restores_this_step = self._snapshots_this_step = 0

    def new_step(self) -> None:
        self._restores_this_step = self._snapshots_this_step = 0

    def usable_end(self, request: _Request, node: TreeNode, matched: int) -> int | None:
        """PrefixReuse's end, cut to the deepest snapshot at or above it; None where the step has
        no room left for that snapshot's restore."""
        end = super().usable_end(request, node, matched)
        while node.parent is not None and (node.snapshot is None
                                           or node.prefix_pages * self.page_size > end):
            node = node.parent
        if node.parent is not None and self._restores_this_step >= STATE_COPIES:
            return None
        return node.prefix_pages * self.page_size

    def attached(self, request: _Request) -> None:
        """Its first chunk restores the snapshot it starts at."""
        if (snapshot := request.cache_node.snapshot) is not None:
            self._restores[id(request)] = snapshot
            self._restores_this_step += 1

    def detach(self, request: _Request) -> None:
        if self._restores.pop(id(request), None) is not None:
            self._restores_this_step -= 1
        super().detach(request)

    def chunk_end(self, request: _Request, start: int, end: int) -> int:
        """A chunk from `start` that would cross the request's last whole page (its snapshot) ends there."""
        boundary = self.last_whole_page(request)
        return boundary if start < boundary < end and self.enabled else end

    def state_copies(self, request: _Request, slot: int, end: int) -> dict:
        """The chunk's copies (SeqChunk.restore, .snapshot): the cached prefix's state into the
        request's `slot` before its first chunk; its state into a snapshot slot after the chunk
        that ends at its boundary, where the step has room and a slot can be had."""
        copies = {}
        if (source := self._restores.pop(id(request), None)) is not None:
            copies["restore"] = (source, slot)
        if end == self.last_whole_page(request) > 0 and (copy := self._snapshot(request, slot,
                                                                                end, False)):
            copies["snapshot"] = copy
        return copies

    def decode_snapshots(self, requests: Sequence[_Request], ends: Sequence[int]) -> dict:
        """The decode rows that end at a page boundary: their states into snapshot slots after
        the step (the module docstring), where the step has room and a slot can be had."""
        if not self.enabled:
            return {}
        page_size, copies = self.page_size, {}
        for row, (request, end) in enumerate(zip(requests, ends, strict=True)):
            if end and end % page_size == 0 and (
                    copy := self._snapshot(request, request.slot, end, True)):
                copies[row] = copy
        return copies

    def _snapshot(self, request: _Request, slot: int, end: int,
                  decoding: bool) -> tuple[int, int] | None:
        if (not self.enabled or self._snapshots_this_step >= STATE_COPIES
                or id(request) in self._pending or (target := self.snapshots.take()) is None):
            return None
        self._pending[id(request)] = (end, target, decoding)
        self._snapshots_this_step += 1
        return slot, target

    def share_computed_pages(self, request: _Request) -> None:
        """PrefixReuse's, then the pending snapshot on the node that now ends at its tokens."""
        super().share_computed_pages(request)
        pending = self._pending.get(id(request))
        if pending is None or request.num_computed < pending[0]:
            return
        del self._pending[id(request)]
        end, slot, decoding = pending
        node = request.cache_node
        if node.prefix_pages * self.page_size != end:  # its pages were not cached: nowhere to go
            self.snapshots.put_back(slot)
            return
        held = self.snapshots.attach(node, slot)
        if decoding:  # an answer's latest replaces the one before (still there: its own)
            previous = self._answers.pop(id(request), None)
            if previous is not None and previous[0].snapshot == previous[1]:
                self.snapshots.release(previous[0])
            if held:
                self._answers[id(request)] = (node, slot)

    def release(self, request: _Request) -> None:
        """A request that ends before its snapshot step is processed frees the slot (a step
        still running may write it: whoever takes it next writes later, steps run in order)."""
        self._restores.pop(id(request), None)
        self._answers.pop(id(request), None)  # its answer's snapshot stays in the tree
        if (pending := self._pending.pop(id(request), None)) is not None:
            self.snapshots.put_back(pending[1])
