"""Picks the ragged paged attention implementation.

Every backend has the signature of `reference.ragged_paged_attention` (the specification):
- "reference": the pure-jnp version, on any platform;
- "cpu": `kernel_cpu` (C++ through XLA's FFI, built on first use), the CPU's fast path;
- "pallas": `kernel_tpu` (Mosaic) on TPU, `kernel_gpu` (Triton) on NVIDIA GPU; on CPU only when
  interpret mode is asked for (`interpret=True`: the TPU kernel under `pltpu.InterpretParams()`,
  which simulates its DMAs and semaphores; for tests and debugging, it is very slow).
"auto" takes the platform's kernel: the Pallas one on TPU and GPU, the CPU kernel on CPU, and the
reference where there is none or it cannot be built.

A kernel is a custom call that XLA's partitioner cannot split, so on a mesh of several devices it
runs under `shard_map`, each device on its own kv heads (the cache is split by kv head too).

Multi-head latent attention (`get_latent_attention_fn`, the signature of
`reference.mla_ragged_paged_attention`) picks the same way among its own kernels; on a mesh each
device takes its own query heads and the whole latent cache (every head reads every row).
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from xlaserve.pallas_kernels.ragged_paged_attention import kernel_cpu, kernel_gpu, kernel_tpu
from xlaserve.pallas_kernels.ragged_paged_attention import new_tokens, reference, tpu_shape_checks
from xlaserve.pallas_kernels.ragged_paged_attention.tpu_page_writes import sublanes
from xlaserve.pallas_kernels.ragged_paged_attention.work_items import query_group

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "reference", "cpu", "pallas")


def get_attention_fn(backend: str = "auto", mesh: Mesh | None = None, *,
                     interpret: bool = False, platform: str | None = None) -> Callable:
    """The attention function for `backend` ("auto", "reference", "cpu" or "pallas");
    `interpret` runs the Pallas TPU kernel in interpret mode (on any platform). `platform`: where
    it will run (default: JAX's default backend; another one to compile for absent hardware)."""
    return _pick(backend, mesh, interpret, platform, "ragged_paged_attention", _split_by_kv_head)


def get_latent_attention_fn(backend: str = "auto", mesh: Mesh | None = None, *,
                            interpret: bool = False, platform: str | None = None) -> Callable:
    """`get_attention_fn` for multi-head latent attention (DeepSeek-V2/V3's MLA)."""
    return _pick(backend, mesh, interpret, platform, "mla_ragged_paged_attention",
                 _split_by_query_head)


def get_expanded_prefill_fns(backend: str = "auto", mesh: Mesh | None = None, *,
                             interpret: bool = False, platform: str | None = None):
    """(prefix attention, new-token attention): the two parts of multi-head latent attention's
    expanded form (model/mla.py), each split over `mesh` by query head. On TPU and GPU the
    Pallas latent kernel with `prefix_only` and JAX's Pallas flash attention (splash on TPU;
    new_tokens.py); on the CPU the native latent kernel with `prefix_only` (where it builds) and
    the blocked jnp new-token attention (XLA's dots); else the references."""
    platform = platform or jax.default_backend()
    backend = _resolve(backend, platform)
    if platform in ("tpu", "gpu") and backend == "pallas":
        kernel, new = {"tpu": (kernel_tpu, new_tokens.tpu_new_token_attention),
                       "gpu": (kernel_gpu, new_tokens.gpu_new_token_attention)}[platform]
        prefix = functools.partial(kernel.mla_ragged_paged_attention, prefix_only=True,
                                   interpret=interpret)
        new = functools.partial(new, interpret=interpret)
    elif backend == "cpu":
        prefix = functools.partial(kernel_cpu.mla_ragged_paged_attention, prefix_only=True)
        new = new_tokens.blocked_new_token_attention
    else:
        prefix = functools.partial(reference.mla_ragged_paged_attention, prefix_only=True)
        new = new_tokens.reference_new_token_attention
    heads = _head_spec(mesh)
    if heads is None:
        return prefix, new

    def sharded_new(q, k, v, cu_q_lens, num_seqs, **options):
        return jax.shard_map(functools.partial(new, **options), mesh=mesh,
                             in_specs=(heads,) * 3 + (P(),) * 2, out_specs=(heads, P(*heads[:2])),
                             check_vma=False)(q, k, v, cu_q_lens, num_seqs)

    return _split_by_query_head(prefix, mesh, with_lse=True), sharded_new


def _resolve(backend: str, platform: str) -> str:
    """What `backend` means on `platform`: "auto" is "pallas" on TPU and GPU, "cpu" on the CPU
    where the native kernels build, else "reference"; "cpu" is built here (KernelUnavailable
    with the compiler's message) and refused off the CPU."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        if platform in ("tpu", "gpu"):
            return "pallas"
        backend = "cpu" if platform == "cpu" and _cpu_kernel_builds() else "reference"
    if backend == "cpu":
        if platform != "cpu":
            raise ValueError(f"--attention-backend cpu runs on the CPU, not on {platform}")
        kernel_cpu.load()
    return backend


def _pick(backend, mesh, interpret, platform, name: str, split: Callable) -> Callable:
    """The function `name` of the module `backend` picks on `platform`, split over `mesh`."""
    platform = platform or jax.default_backend()
    backend = _resolve(backend, platform)
    if backend == "reference":
        return getattr(reference, name)
    if backend == "pallas":
        return split(_pallas_kernel(platform, interpret, name), mesh)
    return split(getattr(kernel_cpu, name), mesh)


def default_page_size(platform: str, max_seqs: int, context_length: int, dtype=None) -> int:
    """--page-size by default: 16 tokens, or on TPU more where the page table would not fit the
    kernel's scalar memory, and at least one sublane tile of the cache's `dtype` (32 rows of
    FP8; tpu_shape_checks.check_shapes)."""
    if platform == "tpu":
        smallest = max(16, sublanes(dtype)) if dtype is not None else 16
        return tpu_shape_checks.default_page_size(max_seqs, context_length, smallest)
    return 16


# Query rows of a work item in deterministic mode (q_block = this // group): an MXU's and a
# tensor core's row tile. Decode steps pay for it (an item holds one token); prefill's items are
# half the default's largest (256 rows, work_items.default_q_block).
DETERMINISTIC_ITEM_ROWS = 128


def fixed_work_items(attention: Callable, platform: str, q, k, v, kv_cache, *args, **options):
    """`attention`, the Pallas kernel of `platform`, in a form whose rows do not depend on the
    step's shape (--enable-deterministic-inference): work items of DETERMINISTIC_ITEM_ROWS query
    rows, KV blocks of `unbounded_kv_block_pages`, and on GPU one KV split and one path for
    every item. By default an item's tokens follow the bucket's mean new tokens per sequence,
    a KV block is capped by the page table's width (a bucket too) and the GPU's split count
    follows the bucket; the kernel's products then have other shapes, and interpreted the same
    prompt's rows differed between a 7-token and a 21-token step."""
    if platform == "gpu":
        options.update(num_kv_splits=1, decode_io_in_kernel=False)
    return attention(q, k, v, kv_cache, *args,
                     q_block=max(1, DETERMINISTIC_ITEM_ROWS // query_group(q, k)),
                     kv_block_pages=unbounded_kv_block_pages(platform, kv_cache), **options)


def unbounded_kv_block_pages(platform: str, kv_cache) -> int:
    """The Pallas kernel's default pages per KV block on `platform` for a page table of any
    width (the table's width, a bucket, only caps the default; the GPU kernel pads the table to
    whole blocks, the TPU one reads only a sequence's own pages): a block that does not change
    with the step's shape."""
    if platform == "gpu":
        return kernel_gpu.default_kv_block_pages(kv_cache.shape[1], 1 << 30)
    token_bytes = math.prod(kv_cache.shape[2:]) * jnp.dtype(kv_cache.dtype).itemsize
    return kernel_tpu.default_kv_block_pages(kv_cache.shape[1], token_bytes, 1 << 30)


def check_shapes(backend: str, platform: str, *, page_size: int, head_dim: int, dtype,
                 max_seqs: int, pages_per_seq: int, latent: tuple[int, int] | None = None) -> None:
    """Raises ValueError, at start-up, where the kernel `backend` picks on `platform` cannot take
    these shapes (it would fail inside XLA's compile otherwise). `latent`: (value_dim, row width)
    of a multi-head latent attention model, whose kernel is the latent one."""
    if backend not in ("auto", "pallas") or platform not in ("tpu", "gpu"):
        return
    if platform == "tpu":
        tpu_shape_checks.check_shapes(page_size, dtype, max_seqs, pages_per_seq)
    elif latent is not None:
        block_pages = kernel_gpu.default_kv_block_pages(page_size, pages_per_seq)
        kernel_gpu.check_mla_kernel_shapes(block_pages * page_size, *latent,
                                           jnp.dtype(dtype).itemsize)
    else:
        block_pages = kernel_gpu.default_kv_block_pages(page_size, pages_per_seq)
        kernel_gpu.check_shapes(block_pages * page_size, head_dim, jnp.dtype(dtype).itemsize)


def ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, soft_cap=None, sinks=None,
                           attention_chunk=None, **options):
    """`reference.ragged_paged_attention` on the platform's "auto" backend: the Pallas TPU or GPU
    kernel, the CPU kernel (or the reference) on CPU. `options`: the Pallas kernels' block sizes
    (`q_block`, `kv_block_pages`) and `interpret`; the CPU kernel takes none."""
    interpret = options.pop("interpret", False)
    attention = get_attention_fn("pallas" if interpret else "auto", interpret=bool(interpret))
    return attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                     sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                     sinks=sinks, attention_chunk=attention_chunk, **options)


def _pallas_kernel(platform: str, interpret: bool, name: str) -> Callable:
    if interpret:
        from jax.experimental.pallas import tpu as pltpu
        return functools.partial(getattr(kernel_tpu, name), interpret=pltpu.InterpretParams())
    if platform == "tpu":
        return getattr(kernel_tpu, name)
    if platform == "gpu":
        return getattr(kernel_gpu, name)
    raise ValueError(f"the Pallas attention kernels run on TPU and GPU, not on {platform} (they "
                     "only run there in interpret mode, for tests); use --attention-backend cpu "
                     "or reference")


@functools.cache
def _cpu_kernel_builds() -> bool:
    try:
        kernel_cpu.load()
        return True
    except kernel_cpu.KernelUnavailable as error:
        logger.warning("The CPU attention kernel is unavailable, using the slower jnp reference: %s",
                       error)
        return False


def _split_by_kv_head(kernel: Callable, mesh: Mesh | None) -> Callable:
    # Heads split over every axis but "data": the tensor-parallel devices (model/sharding.py).
    head_axes = tuple(name for name in (mesh.axis_names if mesh else ()) if name != "data")
    if mesh is None or math.prod(mesh.shape[name] for name in head_axes) == 1:
        return kernel
    heads = P(None, head_axes, None)  # q [T, Hq, D], k and v [T, Hkv, D]
    metadata = P()

    @functools.wraps(kernel)
    def sharded(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sinks=None,
                **options):
        # [pages, page_size, 2 * Hkv (, D)]: each device's K|V pairs of its own heads.
        cache = P(*(None, None, head_axes, None)[:kv_cache.ndim])
        args = (q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
        in_specs = (heads, heads, heads, cache) + (metadata,) * 4
        body = functools.partial(kernel, **options)
        if sinks is not None:  # sinks [Hq], split as q's heads: each device's own heads' sinks
            args, in_specs = args + (sinks,), in_specs + (P(heads[1]),)
            body = lambda *args_and_sinks: kernel(*args_and_sinks[:-1], sinks=args_and_sinks[-1],
                                                  **options)
        # prefix_only's lse [T, Hq] is split as the heads are.
        out_specs = ((heads, P(*heads[:2]), cache) if options.get("prefix_only")
                     else (heads, cache))
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)(*args)

    return sharded


def _head_spec(mesh: Mesh | None) -> P | None:
    """[T, heads, D] split by head over the mesh's model axes; None where they are one device."""
    head_axes = tuple(name for name in (mesh.axis_names if mesh else ()) if name != "data")
    if mesh is None or math.prod(mesh.shape[name] for name in head_axes) == 1:
        return None
    return P(None, head_axes, None)


def _split_by_query_head(kernel: Callable, mesh: Mesh | None, with_lse: bool = False) -> Callable:
    """A latent-attention kernel under shard_map: each device on its own query heads (split as
    the model splits them, model/sharding.py), the new latent rows and the cache whole on every
    device, each device writing the same rows into its own copy. `with_lse`: the kernel returns
    (out, lse [T, Hq], cache), prefix_only's."""
    heads, whole = _head_spec(mesh), P()
    if heads is None:
        return kernel
    out_specs = (heads, P(*heads[:2]), whole) if with_lse else (heads, whole)

    @functools.wraps(kernel)
    def sharded(q, latent, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        return jax.shard_map(functools.partial(kernel, **options), mesh=mesh,
                             in_specs=(heads,) + (whole,) * 6, out_specs=out_specs,
                             check_vma=False)(q, latent, kv_cache, kv_lens, page_indices,
                                              cu_q_lens, num_seqs)

    return sharded
