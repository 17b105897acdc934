"""The prefix cache's host-memory tier (runtime/scheduler/host_tier.py, prefix_cache.py): evicted
pages move to host pages instead of being dropped, a prefix that reaches them loads them back
into device pages, the host tier drops its own least recently used leaves, an insert of the same
tokens promotes a host node with the inserting request's pages, and every copy is owed to the
executor in the order that keeps each page's contents right (checked against a model of both
memories that makes the copies as the executor would)."""
import random

import pytest

from xlaserve.runtime.scheduler.host_tier import LOAD, SAVE, HostTier
from xlaserve.runtime.scheduler.page_allocator import PageAllocator
from xlaserve.runtime.scheduler.prefix_cache import RadixCache

PAGE = 2


def cache_with_host(device_pages: int, host_pages: int) -> RadixCache:
    return RadixCache(PageAllocator(device_pages + 1), PAGE, HostTier(host_pages))


def cached(cache: RadixCache, ids: list[int]) -> list[int]:
    """A request computed `ids` and ended: its whole pages are in the tree, unlocked."""
    pages = cache.allocate(len(ids) // PAGE)
    tree_pages, _ = cache.insert(ids, pages)
    cache.allocator.free([p for p, t in zip(pages, tree_pages) if p != t])
    return tree_pages


def test_evicted_pages_move_to_the_host_and_a_match_loads_them_back():
    cache = cache_with_host(device_pages=4, host_pages=8)
    a = [1, 2, 3, 4]
    device_a = cached(cache, a)
    cache.allocator.free(cache.allocate(4))  # pressure: A's 2 pages go to the host
    (kind, source, host_a), = cache.host.take_copies()
    assert (kind, source) == (SAVE, device_a) and cache.host_pages == 2
    pages, node, host_path = cache.match_tiers(a + [9])
    assert pages == [] and node is cache.root and [n.pages for n in host_path] == [host_a]
    assert cache.match(a + [9])[0] == []  # the device tier alone: nothing
    cache.lock(node)
    loaded = cache.load(host_path)
    assert loaded == host_path and not loaded[0].on_host and cache.host_pages == 0
    (kind, source, target), = cache.host.take_copies()
    assert (kind, source, target) == (LOAD, host_a, loaded[0].pages)
    assert cache.match(a + [9])[0] == loaded[0].pages


def test_the_host_tier_drops_its_least_recently_used_leaves_when_full():
    cache = cache_with_host(device_pages=2, host_pages=2)
    a, b = [1, 1, 1, 1], [2, 2, 2, 2]
    cached(cache, a)
    cached(cache, b)  # A (2 pages) moved out to make room on the device
    cache.allocator.free(cache.allocate(2))  # B moved out: A dropped to make room on the host
    assert cache.host_pages == 2
    assert cache.match_tiers(a)[2] == [] and len(cache.match_tiers(b)[2]) == 1


def test_an_insert_of_tokens_held_on_the_host_takes_the_requests_pages_without_a_copy():
    cache = cache_with_host(device_pages=4, host_pages=4)
    a = [5, 6, 7, 8]
    cached(cache, a)
    cache.allocator.free(cache.allocate(4))
    cache.host.take_copies()
    mine = cache.allocate(2)  # a request computed A again itself
    tree_pages, node = cache.insert(a, mine)
    assert tree_pages == mine and not node.on_host and cache.host_pages == 0
    assert cache.host.take_copies() == []  # nothing to load: the request's pages hold A


def test_a_load_stops_where_the_device_pool_is_full_of_locked_pages():
    cache = cache_with_host(device_pages=4, host_pages=8)
    a = [1, 2, 3, 4, 5, 6, 7, 8]  # 4 pages
    cached(cache, a)
    cache.allocator.free(cache.allocate(4))
    held = cache.allocate(3)  # a running request's
    pages, node, host_path = cache.match_tiers(a)
    assert sum(len(n.pages) for n in host_path) == 4
    assert cache.load(host_path) == []  # one device page free: the 4-page node waits
    cache.allocator.free(held)
    assert len(cache.load(cache.match_tiers(a)[2])) == 1


def test_flush_drops_both_tiers():
    cache = cache_with_host(device_pages=4, host_pages=4)
    cached(cache, [1, 2, 3, 4])
    cache.allocator.free(cache.allocate(4))
    cached(cache, [5, 6, 7, 8])
    cache.flush()
    assert cache.host_pages == 0 and cache.evictable_pages == 0
    assert cache.match_tiers([1, 2, 3, 4])[2] == [] and cache.match([5, 6, 7, 8])[0] == []


class Memories:
    """Both pools' contents (each page: the tokens whose KV it holds), copied as the executor
    copies them, in order."""

    def __init__(self):
        self.device, self.host = {}, {}

    def make(self, copies):
        for kind, source, target in copies:
            src, dst = (self.device, self.host) if kind == SAVE else (self.host, self.device)
            for s, t in zip(source, target, strict=True):
                dst[t] = src[s]


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_keeps_every_matched_page_holding_its_tokens(seed):
    # Requests with shared prefixes compute, cache, end, and come back (loading from the host);
    # device and host pools far smaller than the traffic. After each round's copies, every page
    # a match hands out holds the KV of the tokens it is matched for; counters stay consistent.
    rng = random.Random(seed)
    cache, memory = cache_with_host(device_pages=12, host_pages=10), Memories()
    prompts = [[rng.randrange(3) for _ in range(PAGE * rng.randint(1, 6))] for _ in range(12)]
    for _ in range(300):
        ids = rng.choice(prompts)[:PAGE * rng.randint(1, 6)]
        pages, node, host_path = cache.match_tiers(ids)
        cache.lock(node)
        loaded = cache.load(host_path)
        if loaded:
            cache.unlock(node)
            pages, node = pages + [p for n in loaded for p in n.pages], loaded[-1]
            cache.lock(node)
        need = len(ids) // PAGE - len(pages)
        if need > cache.available_pages:
            cache.unlock(node)
            memory.make(cache.host.take_copies())
            continue
        own = cache.allocate(need)
        memory.make(cache.host.take_copies())  # before the step that reads and writes them
        for i, page in enumerate(pages):  # the matched prefix holds its tokens
            assert memory.device[page] == tuple(ids[i * PAGE:(i + 1) * PAGE])
        for i, page in enumerate(own, start=len(pages)):  # the step computes the rest
            memory.device[page] = tuple(ids[i * PAGE:(i + 1) * PAGE])
        all_pages, new_node = cache.insert_locked(ids, pages + own, node)
        memory.make(cache.host.take_copies())
        cache.unlock(new_node)
        check_counters(cache)
    assert cache.host.saved_pages > 50 and cache.host.loaded_pages > 20  # both tiers worked


def check_counters(cache: RadixCache) -> None:
    device = host = 0
    stack = [cache.root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            assert not (node.on_host and not child.on_host), "a device node below a host one"
            stack.append(child)
        if node is not cache.root:
            host += len(node.pages) if node.on_host else 0
            device += 0 if node.on_host else len(node.pages)
    assert device == cache.evictable_pages + cache.locked_pages
    assert host == cache.host.allocator.num_used == cache.host_pages


def test_dropping_an_adapters_namespace_frees_its_host_pages_too():
    cache = cache_with_host(device_pages=4, host_pages=4)
    pages = cache.allocate(2)
    cache.insert([1, 2, 3, 4], pages, namespace=7)  # a LoRA adapter's prompt
    cache.allocator.free(cache.allocate(4))  # moved to the host
    assert cache.host_pages == 2
    cache.drop_namespace(7)
    assert cache.host_pages == 0 and cache.match_tiers([1, 2, 3, 4], 7)[2] == []
