"""The radix tree of cached KV pages by the token ids they hold (`RadixCache`, SGLang's
RadixAttention by page), on the host; their free list is page_allocator.py, a request's use of
the tree prefix_reuse.py, the device pools runtime/executor/kv_pool.py. Used from the engine
thread alone.

Pages. A page holds `page_size` consecutive tokens of one sequence for every layer. Requests own
lists of page ids (their page table); when a request finishes, is aborted or is retracted, its
pages go back to the free list at once, or to the tree, which frees them on eviction.

The tree. Every edge holds whole pages: `key` is `page_size * len(pages)` token ids and `pages`
are the KV pages that cache them, so a path from the root spells a token prefix and lists its pages.
Only whole pages are shared: a partial page is still being written by its request, and a page's KV
depends on nothing but the tokens up to its end, so equal keys mean interchangeable pages.

A request reusing (or contributing) a path *locks* the path's last node: `lock_ref` counts the
locked paths that run through a node, and a locked node is never evicted. Unlocked leaves are
evicted least recently used first; evicting a leaf may turn its parent into an evictable leaf.
Since locking a node locks its ancestors, every node under an unlocked node is unlocked too.
Tree pages are allocated in the PageAllocator (off its free list); the tree frees them when it
evicts.

The evictable leaves are kept in a heap as they appear (an unlock to zero, a new leaf, a parent
whose last child went), not found by walking the tree at each eviction: in the steady state of
a server the pool is full of cached pages and every page a decoding row needs is an eviction,
and the walk cost O(tree) each time (35% of the engine thread's samples in bench_host_step.py
once its pool filled). Entries go stale (a node locked again, touched, given a child, evicted)
and are checked when popped; the heap is rebuilt by a walk when stale entries outnumber nodes.

Namespaces. A request of a LoRA adapter computes other KV for the same tokens than the base
model does, so each adapter (each load of one) has a tree of its own under its own root
(`root_of`, `Request.adapter`); unloading the adapter drops its tree (`drop_namespace`).

Host tier (`host`, host_tier.py; --enable-hierarchical-cache): evicted nodes move their pages
to host pages instead of being dropped (`on_host`); `match_tiers` finds them past the device
match and `load` moves them back; the host tier evicts its own LRU leaves (`HostTier.take`,
`HostTier.make_room`). Admission and reuse: prefix_reuse.py.
"""
from __future__ import annotations

import heapq
import itertools
from xlaserve.runtime.scheduler.host_tier import HostTier
from xlaserve.runtime.scheduler.page_allocator import PageAllocator


class TreeNode:
    __slots__ = ("parent", "children", "key", "pages", "lock_ref", "last_access", "prefix_pages",
                 "on_host", "pinned", "snapshot")

    def __init__(self, parent: TreeNode | None, key: list[int], pages: list[int], prefix_pages: int,
                 last_access: int = 0):
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}  # by the tokens of their first page
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = last_access  # a tick of RadixCache._clock: LRU order without clock ties
        # Pages from the root to the end of this node. A split keeps the tail as the same object
        # with the same end, so a request holding a node keeps a valid count.
        self.prefix_pages = prefix_pages
        # In the host tier (host_tier.py): `pages` are host pages. A node's device pages are
        # moved there only once none of its children has any, so the nodes on the device are
        # the top of the tree and the host ones hang below them. `pinned`: being loaded back.
        self.on_host = False
        self.pinned = False
        # A hybrid model's state-pool slot holding its linear layers' state at this node's end
        # (state_reuse.py), or None. A split keeps it on the tail, which keeps the end.
        self.snapshot: int | None = None


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, host: HostTier | None = None):
        """`host`: the host-memory tier that evicted pages move to (None: they are dropped)."""
        self.allocator = allocator
        self.page_size = page_size
        self.host = host
        self.root = TreeNode(None, [], [], 0)
        self.root.lock_ref = 1  # the root holds no pages and is never evicted
        # A tree per namespace (a LoRA adapter's: the same tokens under two adapters are not
        # the same KV), each from a root of its own; namespace 0, the base model's, is `root`.
        self._roots = {0: self.root}
        self.evictable_pages = 0  # pages of unlocked nodes: free for the asking
        self.locked_pages = 0
        self._clock = itertools.count(1)
        # (last_access, push order, node) for every unlocked leaf, and stale entries (see above).
        self._leaf_heap: list[tuple[int, int, TreeNode]] = []
        self._push_order = itertools.count()
        self.num_nodes = 0  # below the roots (the host tier's heap is rebuilt by it too)
        # A hybrid model's snapshots (state_reuse.StateSnapshots): an evicted node's is freed.
        self.snapshots = None

    @property
    def num_pages(self) -> int:
        return self.evictable_pages + self.locked_pages

    # --- lookups ------------------------------------------------------------------------------

    def root_of(self, namespace: int) -> TreeNode:
        """The root of `namespace`'s tree (made on first use)."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode(None, [], [], 0)
            root.lock_ref = 1
        return root

    def drop_namespace(self, namespace: int) -> int:
        """Evicts every page of `namespace`'s tree (none may be locked: no request of it runs)
        and forgets the tree; returns the pages freed."""
        if namespace == 0 or namespace not in self._roots:
            return 0
        nodes, stack = [], list(self._roots[namespace].children.values())
        while stack:  # every node first: a locked one refuses the drop before anything changes
            node = stack.pop()
            if node.lock_ref:
                raise ValueError(f"namespace {namespace} still has a locked path")
            nodes.append(node)
            stack.extend(node.children.values())
        del self._roots[namespace]
        freed = 0
        for node in nodes:
            if node.on_host:
                self.host.allocator.free(node.pages)
            else:
                self.allocator.free(node.pages)
                freed += len(node.pages)
                self.evictable_pages -= len(node.pages)
            self.num_nodes -= 1
            node.parent = None  # any heap entry for it is stale now
        return freed

    def match(self, token_ids: list[int], namespace: int = 0) -> tuple[list[int], TreeNode]:
        """The device pages of the longest cached prefix of `token_ids` in whole pages, and the
        node that ends exactly there (split if the match ends inside one), for `lock`."""
        pages, node, _ = self.match_tiers(token_ids, namespace)
        return pages, node

    def match_tiers(self, token_ids: list[int], namespace: int = 0
                    ) -> tuple[list[int], TreeNode, list[TreeNode]]:
        """`match`, and the host tier's nodes that continue the prefix past it (the last split
        where the match ends inside it), for `load`."""
        token_ids = list(token_ids)
        num_pages = len(token_ids) // self.page_size
        node, pages, matched = self._walk(token_ids, num_pages, self.root_of(namespace))
        host_path, below, tick = [], node, next(self._clock)
        while matched < num_pages:
            child = below.children.get(self._first_page(token_ids, matched * self.page_size))
            if child is None:  # (a device child would have been walked)
                break
            equal = self._equal_pages(child, token_ids, matched * self.page_size,
                                      num_pages - matched)
            if equal < len(child.pages):
                child = self._split(child, equal)
            child.last_access = tick
            host_path.append(child)
            matched += equal
            below = child
        return pages, node, host_path

    def insert(self, token_ids: list[int], pages: list[int],
               namespace: int = 0) -> tuple[list[int], TreeNode]:
        """Caches the whole pages of `token_ids`, held by `pages` (a trailing partial page is left
        out). Where the tree already holds a page for the same tokens, the tree's page wins: the
        returned list is the tree's pages for the prefix, so the caller can free its duplicates.
        Also returns the node ending the prefix. New pages belong to the tree from now on."""
        token_ids = list(token_ids)
        num_pages = min(len(token_ids) // self.page_size, len(pages))
        node, tree_pages, matched = self._walk(token_ids, num_pages, self.root_of(namespace),
                                               promote=pages)
        if matched < num_pages:
            node = self._add_leaf(node, token_ids, pages, matched, num_pages)
            tree_pages += node.pages
        return tree_pages, node

    def insert_locked(self, token_ids: list[int], pages: list[int], locked: TreeNode,
                      ) -> tuple[list[int], TreeNode]:
        """`insert` for a request that locks `locked` and has computed `pages`: pages that another
        request cached first (same tokens, so same KV) replace the request's, which are freed, and
        the lock moves to the new end. Returns the request's new pages and locked node.

        The request's path to `locked` spells the first `locked.prefix_pages` pages of
        `token_ids` with `pages[:locked.prefix_pages]`, so the walk starts there and only the
        nodes below it change locks. A decoding request adds a node a page, and from the root
        each insert (and the lock's move) walked the whole chain: ~0.1 ms a step at 256 rows
        (benchmarks/bench_host_step.py), growing with the outputs' length."""
        start = locked.prefix_pages
        num_pages = min(len(token_ids) // self.page_size, len(pages))
        node, tail, matched = self._walk(token_ids, num_pages, locked, start, promote=pages)
        if matched < num_pages:
            node = self._add_leaf(node, token_ids, pages, matched, num_pages)
            tail += node.pages
        mine = pages[start:num_pages]
        self.allocator.free([p for p, tree in zip(mine, tail) if p != tree])
        below = node
        while below is not locked:  # `locked` and above keep this request's lock
            self._lock_one(below)
            below = below.parent
        return pages[:start] + tail, node

    def _add_leaf(self, node: TreeNode, token_ids: list[int], pages: list[int], matched: int,
                  num_pages: int) -> TreeNode:
        """A new leaf under `node` for pages [matched, num_pages) of `token_ids`."""
        size = self.page_size
        leaf = TreeNode(node, token_ids[matched * size:num_pages * size],
                        list(pages[matched:num_pages]), num_pages, next(self._clock))
        node.children[self._first_page(leaf.key)] = leaf
        self.evictable_pages += len(leaf.pages)
        self.num_nodes += 1
        self.push_if_evictable(leaf)
        return leaf

    def _walk(self, token_ids: list[int], num_pages: int, node: TreeNode | None = None,
              matched: int = 0, promote: list[int] | None = None
              ) -> tuple[TreeNode, list[int], int]:
        """Follows the first `num_pages` pages of `token_ids` down the tree from `node` (the root;
        or a node ending `matched` pages in, on their path): the last node reached (ending
        exactly at the match), the device pages on the way, and how many pages matched in all.
        The walk stops at the host tier, unless `promote` gives device pages holding those tokens
        (an insert's): they replace the host ones, which are freed."""
        node, pages = node or self.root, []
        tick = next(self._clock)
        while matched < num_pages:
            child = node.children.get(self._first_page(token_ids, matched * self.page_size))
            if child is None or (child.on_host and (promote is None or child.pinned)):
                break
            equal = self._equal_pages(child, token_ids, matched * self.page_size, num_pages - matched)
            if equal < len(child.pages):
                child = self._split(child, equal)
            if child.on_host:
                self._to_device(child, promote[matched:matched + equal])
            child.last_access = tick
            pages += child.pages
            matched += equal
            node = child
        return node, pages, matched

    def _equal_pages(self, node: TreeNode, token_ids: list[int], start: int, max_pages: int) -> int:
        """Leading whole pages of `node.key` equal to `token_ids[start:]`, at most `max_pages`.
        The first page is known equal (the children dict matched it)."""
        size = self.page_size
        n = min(len(node.pages), max_pages)
        if node.key[:n * size] == token_ids[start:start + n * size]:  # the common case, in C
            return n
        equal = 1
        while node.key[equal * size:(equal + 1) * size] == token_ids[start + equal * size:
                                                                     start + (equal + 1) * size]:
            equal += 1
        return equal

    def _split(self, node: TreeNode, num_pages: int) -> TreeNode:
        """Cuts `node` after `num_pages` pages; returns the new head, which takes its place."""
        size = self.page_size
        parent = node.parent
        head = TreeNode(parent, node.key[:num_pages * size], node.pages[:num_pages],
                        parent.prefix_pages + num_pages, node.last_access)
        head.lock_ref = node.lock_ref  # the same paths run through both halves
        head.on_host, head.pinned = node.on_host, node.pinned
        node.key, node.pages, node.parent = node.key[num_pages * size:], node.pages[num_pages:], head
        head.children[self._first_page(node.key)] = node
        parent.children[self._first_page(head.key)] = head
        self.num_nodes += 1
        return head

    def _first_page(self, token_ids: list[int], start: int = 0) -> tuple[int, ...]:
        return tuple(token_ids[start:start + self.page_size])

    # --- references -----------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """A request uses the path to `node`: none of its pages may be evicted until `unlock`."""
        while node.parent is not None:  # up to its tree's root
            self._lock_one(node)
            node = node.parent

    def _lock_one(self, node: TreeNode) -> None:
        if node.lock_ref == 0:
            self.evictable_pages -= len(node.pages)
            self.locked_pages += len(node.pages)
        node.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            self._unlock_one(node)
            node = node.parent

    def _unlock_one(self, node: TreeNode) -> None:
        if node.lock_ref <= 0:
            raise ValueError("unlock of a node that is not locked")
        node.lock_ref -= 1
        if node.lock_ref == 0:
            self.locked_pages -= len(node.pages)
            self.evictable_pages += len(node.pages)
            self.push_if_evictable(node)

    # --- eviction -------------------------------------------------------------------------------

    @property
    def available_pages(self) -> int:
        """Free pages plus cached pages that no request uses (evicted when asked for)."""
        return self.allocator.num_free + self.evictable_pages

    def allocate(self, num_pages: int) -> list[int]:
        """`num_pages` pages off the free list, evicting LRU cached pages first if it is short."""
        if num_pages > self.allocator.num_free:
            self.evict(num_pages - self.allocator.num_free)
        return self.allocator.allocate(num_pages)

    def evict(self, num_pages: int, to_host: bool = True) -> int:
        """Frees at least `num_pages` device pages (fewer only if fewer are evictable): unlocked
        nodes without device children, least recently used first, moved to the host tier where
        there is one and `to_host` (and room: its own LRU leaves make it), else dropped with the
        host nodes below them; returns how many."""
        heap, freed = self._leaf_heap, 0
        while freed < num_pages and heap:
            access, _, leaf = heapq.heappop(heap)
            if not self._is_evictable_leaf(leaf):
                continue  # stale: locked again, given a child, or evicted since it was pushed
            if access != leaf.last_access:  # touched since: back in at its new place
                self._push(leaf)
                continue
            device_pages, parent = leaf.pages, leaf.parent
            if leaf.snapshot is not None:
                self.snapshots.release(leaf)
            freed += len(device_pages)
            self.evictable_pages -= len(device_pages)
            if not (to_host and self.host is not None and self.host.take(leaf, self)):
                self.drop(leaf)
            self.allocator.free(device_pages)
            self.push_if_evictable(parent)
        return freed

    def flush(self) -> int:
        """Drops every page no request uses, from both tiers; returns the device pages freed."""
        freed = self.evict(self.evictable_pages, to_host=False)
        if self.host is not None:  # what hangs below locked paths
            self.host.make_room(self.host.allocator.num_used, self)
        return freed

    def drop(self, node: TreeNode) -> None:
        """Takes an evicted node out of the tree, and the host nodes below it (their prefix is
        gone); frees their host pages."""
        del node.parent.children[self._first_page(node.key)]
        node.parent = None  # out of the tree: any entry left for it is stale
        self.num_nodes -= 1
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            self.host.allocator.free(below.pages)
            self.num_nodes -= 1
            below.parent = None
            stack.extend(below.children.values())

    # --- the host tier (host_tier.py) -----------------------------------------------------------

    @property
    def host_pages(self) -> int:
        """Pages the host tier holds."""
        return 0 if self.host is None else self.host.allocator.num_used

    def _to_device(self, node: TreeNode, device_pages: list[int]) -> None:
        """A host node's pages replaced by `device_pages` holding the same tokens (loaded, or an
        insert's own); its host pages are freed."""
        self.host.allocator.free(node.pages)
        node.pages, node.on_host = list(device_pages), False
        self.evictable_pages += len(device_pages)
        self.push_if_evictable(node)

    def load(self, host_path: list[TreeNode]) -> list[TreeNode]:
        """Moves the host nodes of `host_path` (a path down from a locked device node, as
        `match_tiers` gives it) back to device pages, in order, as many as the device pool has
        room for without evicting the path itself: loads the executor makes before the next
        step. Returns the nodes loaded, unlocked (the caller locks the path's new end)."""
        for node in host_path:
            node.pinned = True  # neither dropped by the host tier nor promoted meanwhile
        loaded = []
        try:
            for node in host_path:
                if len(node.pages) > self.available_pages:
                    break
                device_pages = self.allocate(len(node.pages))  # may move LRU pages out
                self.host.load(node.pages, device_pages)
                self._to_device(node, device_pages)
                self._lock_one(node)  # not evicted by the next node's allocation
                loaded.append(node)
        finally:
            for node in host_path:
                node.pinned = False
                self.host.push_if_leaf(node, self.num_nodes)
        for node in loaded:
            self._unlock_one(node)
        return loaded

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        parent = node.parent
        return (parent is not None and node.lock_ref == 0 and not node.on_host
                and not self._has_device_children(node)
                and parent.children.get(self._first_page(node.key)) is node)

    @staticmethod
    def _has_device_children(node: TreeNode) -> bool:
        return any(not child.on_host for child in node.children.values())

    def push_if_evictable(self, node: TreeNode) -> None:
        if node.parent is not None and node.lock_ref == 0 and not node.on_host \
                and not self._has_device_children(node):
            self._push(node)

    def _push(self, node: TreeNode) -> None:
        if len(self._leaf_heap) > 2 * self.num_nodes + 64:  # mostly stale: rebuild it
            self._leaf_heap = [(leaf.last_access, next(self._push_order), leaf)
                               for leaf in self._unlocked_leaves()]
            heapq.heapify(self._leaf_heap)
        heapq.heappush(self._leaf_heap, (node.last_access, next(self._push_order), node))

    def _unlocked_leaves(self) -> list[TreeNode]:
        """The device-evictable nodes: unlocked, on the device, without device children."""
        leaves, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(child for child in node.children.values() if not child.on_host)
            if node.parent is not None and node.lock_ref == 0 and \
                    not self._has_device_children(node):
                leaves.append(node)
        return leaves
