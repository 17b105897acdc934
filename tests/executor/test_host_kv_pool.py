"""The host tier's copies (runtime/executor/host_kv_pool.py) on the CPU, through both of its
stores: JAX arrays in pinned host memory (GPUs and the CPU) and NumPy arrays (TPU). Pages saved
from the device pool and loaded back into other pages hold the same bytes, in every layer, for
copies longer than one piece (padded to a power of two) and in the order they were owed; the
pinned store's copy programs compile for an H100."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.compile_targets import devices
from xlaserve.runtime.executor import host_kv_pool
from xlaserve.runtime.executor.host_kv_pool import HostKvPool
from xlaserve.runtime.scheduler.host_tier import LOAD, SAVE

# Three layers, the last one's rows twice as wide (a Gemma 4 full layer's: each layer's cache
# its own shape, ModelConfig.layer).
SHAPES, DTYPE = [(12, 2, 6), (12, 2, 6), (12, 2, 12)], jnp.float8_e4m3fn


def specs_on(device_list):
    mesh = Mesh(np.array(device_list[:1]), ("tensor",))
    return [jax.ShapeDtypeStruct(shape, DTYPE, sharding=NamedSharding(mesh, P()))
            for shape in SHAPES]


@pytest.fixture(params=[True, False], ids=["pinned", "numpy"])
def pool_and_caches(request, monkeypatch):
    monkeypatch.setattr(host_kv_pool, "COPY_PAGES", 4)  # pieces of 4 pages: 1, 2, 4
    specs = specs_on(jax.devices())
    rng = np.random.default_rng(0)
    caches = [jax.device_put(rng.standard_normal(one.shape).astype(DTYPE), one.sharding)
              for one in specs]
    pool = HostKvPool(specs, num_pages=10, pinned=request.param)
    pool.precompile()
    assert pool.sizes == [1, 2, 4] and pool.pinned == request.param
    return pool, caches


def bytes_of(array):
    return np.asarray(array).view(np.uint8)


def test_saved_pages_load_back_into_other_pages_unchanged(pool_and_caches):
    pool, caches = pool_and_caches
    before = [bytes_of(c).copy() for c in caches]
    saved, host = [1, 2, 3, 4, 5, 6], [10, 9, 8, 7, 6, 5]  # two pieces: 4 and 2
    caches = pool.apply(caches, [(SAVE, saved, host)])
    targets = [11, 7, 8, 9, 10, 0]  # page 0 too: the null page takes a load like any other
    caches = pool.apply(caches, [(LOAD, host, targets)])
    for layer, cache in enumerate(caches):
        after = bytes_of(cache)
        np.testing.assert_array_equal(after[targets], before[layer][saved])
        untouched = [p for p in range(12) if p not in targets]
        np.testing.assert_array_equal(after[untouched], before[layer][untouched])


def test_copies_are_made_in_the_order_they_were_owed(pool_and_caches):
    pool, caches = pool_and_caches
    before = [bytes_of(c).copy() for c in caches]
    # Page 3 saved to host 1, loaded into page 5, host 1 then reused for page 4's save, which a
    # second load reads into page 6: each load must see what the save before it left.
    caches = pool.apply(caches, [(SAVE, [3], [1]), (LOAD, [1], [5]), (SAVE, [4], [1]),
                                 (LOAD, [1], [6])])
    for layer, cache in enumerate(caches):
        np.testing.assert_array_equal(bytes_of(cache)[5], before[layer][3])
        np.testing.assert_array_equal(bytes_of(cache)[6], before[layer][4])


def test_the_pinned_copies_compile_for_an_h100(monkeypatch):
    _, target_devices = devices("h100")
    monkeypatch.setattr(host_kv_pool, "COPY_PAGES", 4)
    pool = HostKvPool(specs_on(target_devices), num_pages=10, allocate=False)
    assert pool.pinned
    pool.precompile()  # the save and load programs of every piece size
    assert len(pool._compiled) == 2 * len(pool.sizes)
