"""The radix prefix cache: the tree on its own, then through the scheduler with the fake model
(which reads every token back through the page table, so a wrong or stale shared page fails)."""
import heapq
import itertools
import logging
import random

import pytest

from tests.scheduler.fake_model import PAGE, FakeModel, make_scheduler, req
from xlaserve.runtime.scheduler.page_allocator import PageAllocator
from xlaserve.runtime.scheduler.prefix_cache import RadixCache
from xlaserve.runtime.sampling.params import RowSamplingParams
from xlaserve.runtime.scheduler.request import AdapterRef, Request

A = list(range(100, 112))  # three pages of 4 tokens


def make_cache(num_pages=32):
    return RadixCache(PageAllocator(num_pages), PAGE)


def cached(cache, token_ids, pages_of):
    """Inserts `token_ids` with freshly allocated pages, as a request that computed them would."""
    pages = cache.allocator.allocate(pages_of)
    return pages, cache.insert(token_ids, pages)


# --- the tree -------------------------------------------------------------------------------------


def test_insert_keeps_whole_pages_only_and_match_stops_at_the_last_equal_page():
    cache = make_cache()
    pages, (tree_pages, node) = cached(cache, A + [1, 2], 4)  # the 4th page is partial
    assert tree_pages == pages[:3] and node.prefix_pages == 3 and node.key == A
    assert cache.evictable_pages == 3 and cache.locked_pages == 0
    cache.allocator.free(pages[3:])  # the partial page stays its request's
    assert cache.match(A + [1, 2])[0] == pages[:3]
    assert cache.match(A[:11])[0] == pages[:2]  # a partial page is never matched
    assert cache.match(A[:5] + [0, 0, 0])[0] == pages[:1]  # differs inside the 2nd page
    assert cache.match([0] + A[1:]) == ([], cache.root)  # differs in the first page
    assert cache.match(A[:3]) == ([], cache.root)


def test_a_match_ending_inside_a_node_splits_it_at_the_page_boundary():
    cache = make_cache()
    pages, _ = cached(cache, A, 3)
    head_pages, head = cache.match(A[:8] + [7, 7, 7, 7])
    assert head_pages == pages[:2] and head.key == A[:8] and head.prefix_pages == 2
    (tail,) = head.children.values()
    assert tail.key == A[8:] and tail.pages == pages[2:] and tail.prefix_pages == 3
    assert cache.root.children == {tuple(A[:4]): head} and cache.evictable_pages == 3
    # Inserting the diverging sequence shares the head and adds a sibling of the tail.
    other, (tree_pages, leaf) = cached(cache, A[:8] + [7, 7, 7, 7], 3)
    assert tree_pages == pages[:2] + other[2:]  # the tree's pages win where it had them
    assert leaf.parent is head and len(head.children) == 2 and cache.evictable_pages == 4


def test_lock_counts_references_along_the_path_and_unlock_releases_them():
    cache = make_cache()
    cached(cache, A, 3)
    _, head = cache.match(A[:8])  # splits: head (2 pages) -> tail (1 page)
    _, tail = cache.match(A)
    cache.lock(tail)
    cache.lock(head)
    assert (cache.locked_pages, cache.evictable_pages) == (3, 0)
    assert (head.lock_ref, tail.lock_ref) == (2, 1)
    cache.unlock(tail)
    assert (cache.locked_pages, cache.evictable_pages) == (2, 1)
    cache.unlock(head)
    assert (cache.locked_pages, cache.evictable_pages) == (0, 3)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(head)


def test_eviction_takes_least_recently_used_leaves_first_then_their_parents():
    cache = make_cache()
    x, y, z = [[k] * 4 + A[:4] for k in (1, 2, 3)]  # two pages each, disjoint
    pages = {name: cached(cache, ids, 2)[0] for name, ids in zip("xyz", (x, y, z), strict=True)}
    cache.match(x)  # x is now the most recently used
    free_before = cache.allocator.num_free
    assert cache.evict(1) == 2  # whole leaves: y's node holds both its pages
    assert cache.match(y)[0] == [] and cache.match(z)[0] == pages["z"]  # the match touched z
    assert cache.allocator.num_free == free_before + 2
    assert cache.evict(1) == 2 and cache.match(z)[0] == pages["z"] and cache.match(x)[0] == []
    # A split leaves head + tail: the tail goes first, then the head, now a leaf.
    cache.match(z[:4])
    assert cache.evict(1) == 1 and cache.match(z)[0] == pages["z"][:1]
    assert cache.evict(1) == 1 and cache.num_pages == 0 and cache.allocator.num_used == 0


def test_eviction_never_takes_a_locked_page():
    cache = make_cache()
    kept, (_, node) = cached(cache, A, 3)
    cached(cache, [5] * 8, 2)
    cache.lock(node)
    assert cache.evict(100) == 2 and cache.flush() == 0
    assert cache.match(A)[0] == kept and cache.locked_pages == 3
    assert cache.available_pages == cache.allocator.num_free == 31 - 3
    cache.unlock(node)
    assert cache.flush() == 3 and cache.allocator.num_used == 0


def test_allocate_evicts_only_what_the_free_list_lacks():
    cache = make_cache(num_pages=7)  # 6 usable pages
    cached(cache, A, 3)
    cached(cache, [5] * 8, 2)
    assert cache.available_pages == 6 and cache.allocator.num_free == 1
    assert len(cache.allocate(3)) == 3  # 1 free + the least recently used leaf (A: 3 pages)
    assert cache.match(A)[0] == [] and cache.evictable_pages == 2 and cache.allocator.num_free == 1


class WalkingRadixCache(RadixCache):
    """The eviction as it was before the leaf heap: every evict walks the whole tree for its
    unlocked leaves. The oracle for the heap's order."""

    def evict(self, num_pages: int, to_host: bool = True) -> int:  # (it has no host tier)
        order = itertools.count()
        heap = [(leaf.last_access, next(order), leaf) for leaf in self._unlocked_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.pages)
            freed += len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[self._first_page(leaf.key)]
            leaf.parent = None
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return freed


@pytest.mark.parametrize("seed", range(6))
def test_eviction_from_the_leaf_heap_frees_what_a_walk_of_the_tree_would(seed):
    # Random inserts (shared prefixes, so splits), matches, locks and unlocks, allocations under
    # pressure, locked inserts and flushes, on the cache and on the walking oracle side by side:
    # every eviction frees the same pages in the same order.
    rng = random.Random(seed)
    caches = [RadixCache(PageAllocator(48), PAGE), WalkingRadixCache(PageAllocator(48), PAGE)]
    locked = [[], []]
    for _ in range(400):
        op, ends, wants = rng.random(), rng.random(), rng.randint(1, 4)
        ids = [rng.randrange(3) for _ in range(PAGE * rng.randint(1, 5))]  # few tokens: sharing
        results = []
        for cache, held in zip(caches, locked):
            if op < 0.35:  # a request that computed `ids` caches them
                n = len(ids) // PAGE
                if cache.available_pages < n:
                    results.append(None)
                    continue
                pages = cache.allocate(n)
                tree_pages, node = cache.insert(ids, pages)
                cache.allocator.free([p for p, t in zip(pages, tree_pages) if p != t])
                results.append(tree_pages)
            elif op < 0.55:  # a request reuses a cached prefix and holds it
                pages, node = cache.match(ids)
                cache.lock(node)
                held.append(node)
                results.append(pages)
            elif op < 0.7 and held:  # a request ends
                cache.unlock(held.pop(int(ends * len(held))))
                results.append("unlock")
            elif op < 0.75:
                results.append(cache.flush())
            else:  # a decoding request needs pages: evicts when the free list is short
                got = cache.allocate(wants) if wants <= cache.available_pages else []
                cache.allocator.free(got)
                results.append(got)
        assert results[0] == results[1]
        a, b = caches
        assert (a.allocator._free, a.evictable_pages, a.locked_pages) == (
            b.allocator._free, b.evictable_pages, b.locked_pages)


def test_the_leaf_heap_stays_bounded_when_the_same_leaves_are_used_over_and_over():
    cache = make_cache()
    nodes = [cached(cache, [k] * 8, 2)[1][1] for k in range(3)]
    for i in range(1000):  # each release pushes the leaf again; the old entries go stale
        cache.lock(nodes[i % 3])
        cache.unlock(nodes[i % 3])
    assert cache.num_nodes == 3 and len(cache._leaf_heap) <= 2 * 3 + 65
    assert cache.flush() == 6 and cache.allocator.num_used == 0


def test_insert_locked_frees_duplicates_and_moves_the_lock():
    cache = make_cache()
    first, (_, first_node) = cached(cache, A[:8], 2)
    cache.lock(first_node)
    second = cache.allocator.allocate(3)  # computed the same 8 tokens on its own, then 4 more
    _, start = cache.match([])
    cache.lock(start)
    pages, node = cache.insert_locked(A, second, start)
    assert pages == first + second[2:] and node.prefix_pages == 3
    assert cache.allocator.num_used == 3  # second[:2] were duplicates, freed
    assert (cache.locked_pages, cache.evictable_pages) == (3, 0)
    cache.unlock(first_node)
    cache.unlock(node)
    assert cache.flush() == 3


# --- through the scheduler ------------------------------------------------------------------------


def run_counting_prefill(model):
    """Runs the scheduler dry; returns the finished requests and how many prompt (not decode)
    tokens the model computed."""
    scheduler, finished, prefill = model.scheduler, [], 0
    while scheduler.has_work():
        batch = scheduler.schedule()
        prefill += sum(len(c.token_ids) for r, c in zip(batch.requests, batch.chunks, strict=True)
                       if not r.is_decoding)
        finished += scheduler.process_results(batch, model.step(batch))
    return finished, prefill


def same_prompt(rid, prompt, **kw):
    return Request(rid=rid, prompt_ids=list(prompt), max_new_tokens=kw.pop("max_new", 4),
                   sampling=RowSamplingParams(), **kw)


@pytest.mark.parametrize("prompt_len, expected_cached", [(9, 8), (8, 4), (5, 4), (4, 0), (1, 0)])
def test_a_repeated_prompt_reuses_whole_pages_but_recomputes_at_least_its_last_token(
        prompt_len, expected_cached, caplog):
    s = make_scheduler()
    model = FakeModel(s)
    s.add(req("first", prompt_len=prompt_len))
    first = model.run_all()[0]
    again = req("first", prompt_len=prompt_len)  # same rid: same prompt ids
    with caplog.at_level(logging.INFO, logger="xlaserve.runtime.scheduler.scheduler"):
        s.add(again)
        batch = s.schedule()
    assert batch.chunks[0].num_cached == expected_cached == again.num_cached_prompt_tokens
    assert len(batch.chunks[0].token_ids) == prompt_len - expected_cached
    assert f"#new-token: {prompt_len - expected_cached}, #cached-token: {expected_cached}," in caplog.text
    s.process_results(batch, model.step(batch))
    assert model.run_all()[0].output_ids == first.output_ids and first.num_cached_prompt_tokens == 0


def test_no_prefix_reuse_computes_the_whole_prompt():
    s = make_scheduler()
    model = FakeModel(s)
    s.add(req("a", prompt_len=9))
    model.run_all()
    s.add(req("a", prompt_len=9, no_prefix_reuse=True))
    s.add(same_prompt("b", s.requests["a"].prompt_ids, no_prefix_reuse=True))  # not held back either
    batch = s.schedule()
    assert [(c.num_cached, len(c.token_ids)) for c in batch.chunks] == [(0, 9), (0, 9)]
    assert [r.num_cached_prompt_tokens for r in batch.requests] == [0, 0]


@pytest.mark.parametrize("radix_cache, expected_prefill", [(True, 18 + 3 * 2), (False, 4 * 18)])
def test_identical_prompts_submitted_together_prefill_the_prompt_once(radix_cache, expected_prefill):
    s = make_scheduler(chunk=8, budget=64, radix_cache=radix_cache)
    prompt = req("p", prompt_len=18).prompt_ids
    for i in range(4):
        s.add(same_prompt(f"n{i}", prompt, max_new=5))
    finished, prefill = run_counting_prefill(FakeModel(s))
    assert prefill == expected_prefill  # 16 of the 18 tokens are whole pages to share
    assert len({tuple(r.output_ids) for r in finished}) == 1
    assert [r.num_cached_prompt_tokens for r in finished] == [0] + [16 if radix_cache else 0] * 3


def test_prompts_sharing_a_prefix_compute_it_once_and_their_own_tails_apart():
    s = make_scheduler(chunk=8, budget=64)
    system = list(range(60, 72))  # 3 whole pages
    for i in range(3):
        s.add(same_prompt(f"q{i}", system + [80 + i] * 5))
    finished, prefill = run_counting_prefill(FakeModel(s))
    assert prefill == 17 + 2 * 5
    assert [r.num_cached_prompt_tokens for r in finished] == [0, 12, 12]


def test_pool_pressure_evicts_cached_pages_before_retracting(caplog):
    s = make_scheduler(num_pages=9, max_running=2, chunk=None)  # 8 usable pages
    model = FakeModel(s)
    old = req("old", prompt_len=12, max_new=5)
    s.add(old)
    model.run_all()  # 16 computed tokens stay cached: 4 pages
    assert s.cache.evictable_pages == 4 and s.allocator.num_free == 4 and s.token_usage() == 0
    s.add(req("b", prompt_len=8, max_new=8))  # each peaks at 15 tokens: 4 pages, 8 together
    s.add(req("c", prompt_len=8, max_new=8))
    with caplog.at_level(logging.INFO, logger="xlaserve.runtime.scheduler.scheduler"):
        finished = model.run_all()
    assert "Retract" not in caplog.text
    assert [r.retracted_count for r in finished] == [0, 0]
    assert s.cache.match(old.prompt_ids)[0] == []
    assert s.allocator.num_used == 6 and s.num_pages_in_use == 0  # b's and c's 15 tokens, cached
    assert s.flush_cache() == 6 and s.allocator.num_used == 0 and s.allocator.usage() == 0


def test_flush_keeps_the_pages_of_running_requests():
    s = make_scheduler()
    model = FakeModel(s)
    s.add(req("done", prompt_len=8, max_new=1))
    model.run_all()
    s.add(req("live", prompt_len=10, max_new=6))
    model.run_step()
    model.run_step()  # live: 11 tokens computed, 2 whole pages in the tree, locked
    assert s.flush_cache() == 2  # done's 2 pages
    assert s.cache.locked_pages == 2 and s.num_pages_in_use == 3
    model.run_all()
    assert s.num_pages_in_use == 0 and s.flush_cache() == 3 and s.allocator.num_used == 0


def test_abort_releases_references_and_pages_shared_with_a_running_request_stay_locked():
    s = make_scheduler()
    model = FakeModel(s)
    prompt = req("p", prompt_len=13).prompt_ids
    s.add(same_prompt("first", prompt, max_new=20))
    model.run_step()  # 13 computed: 3 whole pages, locked by first
    s.add(same_prompt("second", prompt, max_new=20))
    model.run_step()
    assert s.requests["second"].num_cached_prompt_tokens == 12 and s.cache.locked_pages == 3
    s.abort("second")
    assert s.cache.locked_pages == 3 and s.cache.evictable_pages == 0  # first still uses them
    s.abort("first")
    assert s.num_pages_in_use == 0 and s.cache.locked_pages == 0 and s.cache.evictable_pages == 3


def test_a_retracted_request_resumes_from_its_own_cached_pages():
    s = make_scheduler(num_pages=7, max_running=2, chunk=None)  # 6 usable pages = 24 tokens
    s.add(req("old", prompt_len=8, max_new=6))
    s.add(req("new", prompt_len=8, max_new=10))
    model = FakeModel(s)
    while s.requests["new"].retracted_count == 0:
        model.run_step()
    new = s.requests["new"]
    assert new.status == "waiting" and new.cache_node is None and new.page_ids == []
    finished = {r.rid: r for r in model.run_all()}
    admissions = [c for b in model.batches for r, c in zip(b.requests, b.chunks, strict=True)
                  if r.rid == "new" and any(r is a for a in b.admitted)]
    assert len(admissions) == 2
    resumed = admissions[1]
    # Retracted at 12 computed tokens (3 whole pages); old's last page took the LRU leaf (the
    # 3rd); the prompt's 2 pages were still there when old finished and new came back.
    assert resumed.num_cached == 8 and len(resumed.token_ids) == 13 - 8
    assert finished["new"].num_cached_prompt_tokens == 0  # counted at first admission only
    assert len(finished["new"].output_ids) == 10 and s.num_pages_in_use == 0


# --- namespaces: a LoRA adapter's tree apart from the base model's -----------------------------


def test_a_namespace_matches_only_its_own_pages_and_dropping_it_frees_them():
    cache = make_cache()
    base_pages, _ = cached(cache, A, 3)
    assert cache.match(A, namespace=1) == ([], cache.root_of(1))  # the base model's: not its
    adapter_pages = cache.allocator.allocate(3)
    tree_pages, node = cache.insert(A, adapter_pages, namespace=1)
    assert tree_pages == adapter_pages != base_pages and cache.match(A, 1)[0] == adapter_pages
    assert cache.match(A)[0] == base_pages and cache.evictable_pages == 6
    cache.lock(node)
    with pytest.raises(ValueError, match="locked"):
        cache.drop_namespace(1)
    cache.unlock(node)
    free = cache.allocator.num_free
    assert cache.drop_namespace(1) == 3 and cache.allocator.num_free == free + 3
    assert cache.evictable_pages == 3 and cache.match(A, 1)[0] == []
    assert cache.match(A)[0] == base_pages and cache.drop_namespace(0) == 0


def test_requests_of_two_adapters_never_share_pages_and_an_unload_drops_its_tree():
    s = make_scheduler()
    model = FakeModel(s)
    first = req("a", prompt_len=13)
    s.add(first)
    model.run_all()
    for i, (namespace, expected) in enumerate([(1, 0), (0, 12), (1, 12)]):
        again = same_prompt(f"n{i}", first.prompt_ids)
        again.adapter = AdapterRef(key=namespace)
        s.add(again)
        batch = s.schedule()
        assert batch.chunks[0].num_cached == expected, (namespace, expected)
        s.process_results(batch, model.step(batch))
        model.run_all()
    evictable = s.cache.evictable_pages
    assert s.cache.drop_namespace(1) > 0 and s.cache.evictable_pages < evictable
    assert s.cache.match(first.prompt_ids, 0)[0]  # the base model's tree stays
