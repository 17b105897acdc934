"""The paged KV cache on the device: one page pool array per layer (each layer's own shape where
the model's layers differ, ModelConfig.layer), sized from free memory or
`--max-total-tokens` (the pages' allocator is runtime/scheduler/page_allocator.py)."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.server_args.platform_defaults import device_memory
from xlaserve.model.sharding import kv_cache_spec
from xlaserve.model.transformer import kv_cache_shape
from xlaserve.runtime.executor.state_pool import state_bytes_per_slot, state_pool_specs
from xlaserve.runtime.scheduler.page_allocator import pages_for_tokens

logger = logging.getLogger(__name__)
# An encoder's pages hold nothing (its pool has no arrays): enough of them that admission never
# waits on them; the steps' token buckets bound the work instead.
NO_CACHE_TOKENS = 1 << 20

def bytes_per_token(config: ModelConfig, dtype, platform: str,
                    draft_head: ModelConfig | None = None) -> int:
    """K and V (or the latent row, mla.py) of one token across all layers on `platform`, and
    a speculative draft head's one layer (model/draft_heads.py, config `draft_head`)."""
    width = sum(kv_cache_shape(config.layer(i), 1, 1, platform)[-1]
                for i in config.cache_layers)
    head = 0 if draft_head is None else kv_cache_shape(draft_head, 1, 1, platform)[-1]
    return (width + head) * jnp.dtype(dtype).itemsize


def host_free_bytes() -> int:
    """The host's available RAM."""
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def num_pages_for(config: ModelConfig, dtype, page_size: int, *, max_total_tokens: int | None,
                  mem_fraction_static: float, device=None, tensor_parallel: int = 1,
                  draft_head: ModelConfig | None = None, state_bytes: int = 0) -> int:
    """Pages from `--max-total-tokens`, else from the device's memory.

    TPU/GPU, SGLang's meaning: `mem_fraction_static` of the memory XLA may allocate holds the
    weights (already loaded: in use) and the KV pool; the rest is left to the steps' temporaries.
    CPU: that fraction of the host's free RAM, which other programs share. `state_bytes`: what
    a hybrid model's state pool takes of it first (state_pool.py), per device."""
    if max_total_tokens is not None:
        return pages_for_tokens(max_total_tokens, page_size) + 1  # + the null page
    device = device or jax.devices()[0]
    memory = device_memory(device)
    if memory is not None:
        limit, in_use = memory
        budget = limit * min(mem_fraction_static, 1.0) - in_use
        # A device's memory does not move between starts as a host's free RAM does: finer steps.
        significant_bits = 6
    else:
        budget = host_free_bytes() * mem_fraction_static
        significant_bits = 4
    budget -= state_bytes
    if config.mla is not None:  # the latent cache is whole on every device (kv_cache_spec)
        tensor_parallel = 1
    if config.bidirectional:  # no cache (model/encoders/encoder.py): pages are bookkeeping only,
        return pages_for_tokens(NO_CACHE_TOKENS, page_size) + 1  # the scheduler's admission
    per_page = (bytes_per_token(config, dtype, device.platform, draft_head) * page_size
                // tensor_parallel)
    return max(2, round_down_coarsely(max(int(budget // per_page), 0), significant_bits))


def round_down_coarsely(n: int, significant_bits: int = 4) -> int:
    """`n` with all but its top `significant_bits` bits cleared (4: less than 1/8 less; 6: 1/32). The pool's page count is part of
    every compiled program's shape: sized from free memory as is, it changed from one start to
    the next, and the persistent compilation cache missed every time (100 s of compiles)."""
    drop = max(n.bit_length() - significant_bits, 0)
    return (n >> drop) << drop


def kv_pool_specs(config: ModelConfig, num_pages: int, page_size: int, dtype, mesh: Mesh,
                  draft_head: "DraftHeadPool | None" = None, state_slots: int = 0):
    """The pool's arrays as jax.ShapeDtypeStruct, with their sharding: what a step is lowered for
    before the pool exists. A hybrid model's linear layers' states follow the layers' caches
    (state_pool.py, `state_slots` slots: the request slots and the null one). With a
    speculative draft head, two more after those (`DraftHeadPool`)."""
    if config.bidirectional:  # an encoder keeps no cache (model/encoders/encoder.py)
        return []
    platform = mesh.devices.flat[0].platform
    # each its own heads; Gemma 4's KV-shared layers have none (they read another's)
    layers = [config.layer(i) for i in config.cache_layers]
    specs = [jax.ShapeDtypeStruct(kv_cache_shape(c, num_pages, page_size, platform), dtype,
                                  sharding=NamedSharding(mesh, kv_cache_spec(c))) for c in layers]
    specs += state_pool_specs(config, state_slots, mesh)
    if draft_head is not None:
        c, replicated = draft_head.config, NamedSharding(mesh, P())
        specs += [jax.ShapeDtypeStruct(kv_cache_shape(c, num_pages, page_size, platform), dtype,
                                       sharding=NamedSharding(mesh, kv_cache_spec(c))),
                  jax.ShapeDtypeStruct((draft_head.num_slots, c.hidden_size), jnp.float32,
                                       sharding=replicated)]
    return specs


@dataclasses.dataclass(frozen=True)
class DraftHeadPool:
    """A speculative draft head's device state, carried at the end of the KV pool's list so that
    every step donates and returns it with the caches (runtime/executor/drafts/draft_head.py): its
    layer's cache (the target's pages), then per request slot the state its next draft reads
    (f32[slots, hidden]: the head's output at the request's last token, `carry`'s)."""

    config: ModelConfig  # the head's
    num_slots: int


def layer_pool_arrays(config: ModelConfig) -> int:
    """How many of the pool's arrays come before a draft head's (`DraftHeadPool`): the layers'
    caches and a hybrid model's linear layers' states."""
    return len(config.cache_layers) + len(config.state_layers)


def draft_head_pool_of(model, num_slots: int) -> DraftHeadPool | None:
    """The device state of the draft head start-up set on `model` (model/draft_heads.py), or
    None without one."""
    head = getattr(model, "draft_head", None)
    return None if head is None else DraftHeadPool(head.config, num_slots)


def draft_head_description(model) -> str:
    """What a step closes over of `model`'s draft head (its config and captured layers are
    static, not state): part of the step's executable cache key ("None" without one)."""
    head = getattr(model, "draft_head", None)
    return repr(head and (head.config, head.capture_layers))


def init_kv_pool(config: ModelConfig, num_pages: int, page_size: int, dtype, mesh: Mesh, *,
                 in_background: bool = False, draft_head: DraftHeadPool | None = None,
                 state_slots: int = 0):
    """One zeroed `transformer.kv_cache_shape` array per layer, split by kv head (and a hybrid
    model's linear layers' state pools, `kv_pool_specs`'s).

    `in_background`: a Future of that list, zeroed on a thread. On a CPU the pool's pages fault
    in as they are zeroed, at ~0.8 GB/s (the default model's 2.3 GB: 1.8-2.9 s on a 2-core Zen 4),
    a wait the runner overlaps with packing the weights and loading the programs."""
    specs, structure = jax.tree.flatten(kv_pool_specs(config, num_pages, page_size, dtype, mesh,
                                                      draft_head, state_slots))
    if not specs:  # an encoder's
        empty: concurrent.futures.Future = concurrent.futures.Future()
        empty.set_result([])
        return empty if in_background else []
    # Compiled here, not on the thread: no compile runs beside another (executable_cache.py
    # turns JAX's persistent cache off around its own).
    makes = {}
    for one in specs:
        key = (one.shape, one.dtype, one.sharding)
        if key not in makes:
            makes[key] = jax.jit(functools.partial(jnp.zeros, one.shape, one.dtype),
                                 out_shardings=one.sharding).lower().compile()

    def zeroed_pool():
        caches = [makes[(one.shape, one.dtype, one.sharding)]() for one in specs]
        jax.block_until_ready(caches)
        return jax.tree.unflatten(structure, caches)

    # SGLang's line, where SGLang has it in the log (before the programs); with `in_background`
    # the zeroing goes on, and what start-up still waits for it is in the "Start-up:" line.
    half_gb = sum(math.prod(one.shape) * one.dtype.itemsize
                  for one in specs[:len(config.cache_layers)]) / 2 / 1e9
    logger.info("KV Cache is allocated. #tokens: %d, K size: %.2f GB, V size: %.2f GB",
                (num_pages - 1) * page_size, half_gb, half_gb)
    if config.state_layers:
        per_slot = state_bytes_per_slot(config)
        logger.info("Linear-attention state is allocated. #slots: %d, %.2f GB (%.2f MB a slot "
                    "in %d layers: the running requests' and the prefix cache's)",
                    state_slots - 1, per_slot * state_slots / 1e9, per_slot / 1e6,
                    len(config.state_layers))
    if not in_background:
        return zeroed_pool()
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xlaserve-kv-pool")
    future = pool.submit(zeroed_pool)
    pool.shutdown(wait=False)  # the thread ends with its one task
    return future
