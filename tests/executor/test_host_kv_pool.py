"""The host tier's copies (runtime/executor/host_kv_pool.py) on the CPU: pages saved from the
device pool and loaded back into other pages hold the same bytes, in every layer, for copies
longer than one piece (padded to a power of two) and in the order they were owed, with a load
that reads a page saved in the same round."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.runtime.executor import host_kv_pool
from xlaserve.runtime.executor.host_kv_pool import HostKvPool
from xlaserve.runtime.scheduler.host_tier import LOAD, SAVE


@pytest.fixture
def pool_and_caches(monkeypatch):
    monkeypatch.setattr(host_kv_pool, "COPY_PAGES", 4)  # pieces of 4 pages: 1, 2, 4
    mesh = Mesh(np.array(jax.devices()[:1]), ("tensor",))
    sharding = NamedSharding(mesh, P())
    shape, dtype = (12, 2, 6), jnp.float8_e4m3fn
    specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)] * 3
    rng = np.random.default_rng(0)
    caches = [jax.device_put(rng.standard_normal(shape).astype(dtype), sharding)
              for _ in specs]
    pool = HostKvPool(specs, num_pages=10)
    pool.precompile()
    assert pool.sizes == [1, 2, 4]
    return pool, caches


def test_saved_pages_load_back_into_other_pages_unchanged(pool_and_caches):
    pool, caches = pool_and_caches
    before = [np.asarray(c).copy() for c in caches]
    saved, host = [1, 2, 3, 4, 5, 6], [10, 9, 8, 7, 6, 5]  # two pieces: 4 and 2
    caches = pool.apply(caches, [(SAVE, saved, host)])
    targets = [11, 7, 8, 9, 10, 0]  # page 0 too: the null page takes a load like any other
    caches = pool.apply(caches, [(LOAD, host, targets)])
    for layer, cache in enumerate(caches):
        after = np.asarray(cache)
        np.testing.assert_array_equal(after[targets].view(np.uint8),
                                      before[layer][saved].view(np.uint8))
        untouched = [p for p in range(12) if p not in targets]
        np.testing.assert_array_equal(after[untouched].view(np.uint8),
                                      before[layer][untouched].view(np.uint8))


def test_copies_are_made_in_the_order_they_were_owed(pool_and_caches):
    pool, caches = pool_and_caches
    before = [np.asarray(c).copy() for c in caches]
    # Page 3 saved to host 1, loaded into page 5, host 1 then reused for page 4's save, which a
    # second load reads into page 6: each load must see what the save before it left.
    caches = pool.apply(caches, [(SAVE, [3], [1]), (LOAD, [1], [5]), (SAVE, [4], [1]),
                                 (LOAD, [1], [6])])
    for layer, cache in enumerate(caches):
        after = np.asarray(cache).view(np.uint8)
        np.testing.assert_array_equal(after[5], before[layer][3].view(np.uint8))
        np.testing.assert_array_equal(after[6], before[layer][4].view(np.uint8))
