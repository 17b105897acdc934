"""A request's use of the prefix cache (prefix_cache.py): its cached prefix on admission, loaded
back from the host tier where it reaches there, and its computed pages into the tree.

Reuse (`radix_cache=False` keeps the tree empty). A request's whole pages enter the tree as soon
as a step completes them and stay there when it ends or is retracted. An admitted request starts
at its longest cached prefix: at most `num_tokens - 1` tokens (the last must run, to sample) in
whole pages, none with `no_prefix_reuse`. It locks that tree path, so
`page_ids[:cache_node.prefix_pages]` are tree pages, the rest its own. Unlocked cached pages count
as free: evicted (LRU leaves) before anything is retracted, left out of `token_usage`.
Shared prompts are prefilled once: a waiting request is passed over (without blocking the queue
behind it) while its next page to match is one that a running request has yet to prefill, and is
admitted with the hit once that page is in the tree; so `n` copies of a prompt compute it once.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from xlaserve.runtime.scheduler.prefix_cache import RadixCache, TreeNode


class _Request(Protocol):
    """What reuse reads and sets of a scheduler Request (request.py, which names TreeNode: not
    imported here, so that the two files do not import each other)."""

    no_prefix_reuse: bool
    adapter: Any  # request.AdapterRef: its `key` is the prefix cache's namespace (0: base model)
    num_computed: int
    page_ids: list[int]
    cache_node: TreeNode | None
    slot: int | None  # its state slot (a hybrid model's decode snapshots)

    def cache_ids(self) -> list[int]: ...

    def whole_span_end(self, start: int, end: int) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def is_decoding(self) -> bool: ...


NO_COPIES: dict = {}  # read, never written


class PrefixReuse:
    """A request's cached prefix on admission, and its computed pages into the tree."""

    def __init__(self, cache: RadixCache, page_size: int, enabled: bool):
        self.cache = cache
        self.page_size = page_size
        # Disabled, the tree stays empty: nothing is inserted, so nothing matches or is evictable.
        self.enabled = enabled

    def reusable_tokens(self, request: _Request) -> int:
        """How much of a waiting request may come from the cache (module docstring, Reuse)."""
        if not self.enabled or request.no_prefix_reuse:
            return 0
        return self.last_whole_page(request)

    def last_whole_page(self, request: _Request) -> int:
        """The request's tokens in the whole pages before its last token."""
        return (request.num_tokens - 1) // self.page_size * self.page_size

    def new_step(self) -> None:
        """A step is being scheduled (a hybrid model's reuse counts its state copies a step:
        state_reuse.py)."""

    def attach(self, request: _Request) -> bool:
        """Starts a waiting request on its longest cached prefix, locked: on the device, and
        the host tier's continuation of it loaded back as far as the device pool has room.
        A prefix that would end inside an image whose tokens attend to one another (Gemma 3's)
        ends at the page before it: the image runs again whole. True: attached (a hybrid
        model's may have to wait for a step with room for its state's restore)."""
        key = request.cache_ids()[:self.reusable_tokens(request)]
        pages, node, host_path = self.cache.match_tiers(key, request.adapter.key)
        matched = (len(pages) + sum(len(below.pages) for below in host_path)) * self.page_size
        end = self.usable_end(request, node, matched)
        if end is None:
            return False
        if end < matched:
            pages, node, host_path = self.cache.match_tiers(
                key[:end // self.page_size * self.page_size], request.adapter.key)
        self.cache.lock(node)
        if host_path and (loaded := self.cache.load(host_path)):
            self.cache.unlock(node)
            pages = pages + [page for below in loaded for page in below.pages]
            node = loaded[-1]
            self.cache.lock(node)
        request.cache_node, request.page_ids = node, pages
        request.num_computed = len(pages) * self.page_size
        self.attached(request)
        return True

    def usable_end(self, request: _Request, node: TreeNode, matched: int) -> int | None:
        """Where the request's cached prefix may end, of the `matched` tokens (on the device to
        `node`, the host tier's after it): not inside an image whose tokens attend to one
        another (Gemma 3's), which runs again whole. None: not in this step (a hybrid model's,
        state_reuse.py)."""
        return request.whole_span_end(0, matched)

    def attached(self, request: _Request) -> None:
        """The request starts at its `cache_node` (a hybrid model's restores its state there)."""

    def detach(self, request: _Request) -> None:  # not admitted after all
        self.cache.unlock(request.cache_node)
        request.cache_node, request.page_ids, request.num_computed = None, [], 0

    def chunk_end(self, request: _Request, start: int, end: int) -> int:
        """Where a prompt chunk from `start` to `end` ends (a hybrid model's at its snapshot)."""
        return end

    def state_copies(self, request: _Request, slot: int, end: int) -> dict:
        """A chunk's state copies (SeqChunk.restore, .snapshot): none but a hybrid model's."""
        return NO_COPIES

    def decode_snapshots(self, requests: Sequence[_Request], ends: Sequence[int]) -> dict:
        """{row: (its slot, a snapshot slot)}: the state copies after decode rows, each row's KV
        ending at `ends[row]` (0: a row that takes none), SeqChunk.snapshot: none but a hybrid
        model's."""
        return NO_COPIES

    def release(self, request: _Request) -> None:
        """The request leaves the running set (ended, aborted, retracted)."""

    def share_computed_pages(self, request: _Request) -> None:
        """Puts the request's newly completed whole pages in the tree, so that a later prompt can
        reuse them before this request ends."""
        num_full = request.num_computed // self.page_size
        if not self.enabled or num_full <= request.cache_node.prefix_pages:
            return
        request.page_ids[:num_full], request.cache_node = self.cache.insert_locked(
            request.cache_ids()[:num_full * self.page_size], request.page_ids[:num_full],
            request.cache_node)

    def waits_for_a_running_prefill(self, request: _Request, running: Sequence[_Request]) -> bool:
        """Whether a `running` request has yet to prefill the next page this waiting request
        would match (module docstring, Reuse): admitting it now would compute that page twice."""
        end = request.num_computed + self.page_size
        if end > self.reusable_tokens(request):
            return False
        head = request.cache_ids()[:end]
        return any(not other.is_decoding and other.num_computed < end <= other.num_tokens
                   and other.adapter.key == request.adapter.key and other.cache_ids()[:end] == head
                   for other in running)
