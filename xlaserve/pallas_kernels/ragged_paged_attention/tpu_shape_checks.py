"""What the Pallas TPU kernel (kernel_tpu.py) can take, checked before anything compiles: pages of
whole sublane tiles, and a page table that fits scalar memory (`check_shapes`, which the kernel
and a server's start-up both run), and the default page size that fits (`default_page_size`)."""
from __future__ import annotations

import jax.numpy as jnp

from xlaserve.pallas_kernels.ragged_paged_attention.tpu_page_writes import sublanes

# The page table's share of SMEM (scalar memory, 1 MiB on v5e/v6e): half, for 4-byte entries; the
# other scalar-prefetched operands are a few entries per sequence or work item.
MAX_PAGE_TABLE_ENTRIES = (512 << 10) // 4


def check_shapes(page_size: int, dtype, max_seqs: int, pages_per_seq: int) -> None:
    """Raises ValueError for what Mosaic cannot compile, so that a server says so at start-up
    rather than failing inside XLA:
    - each page lands in the VMEM block at a multiple of `page_size` rows, which must be whole
      sublane tiles (8 rows of 32 bits, 16 of bfloat16);
    - the page table is scalar-prefetched into SMEM (1 MiB on v5e and v6e; compiling Llama-3.1-8B's
      128K context at 64 sequences and 16-token pages asked for 2 MiB)."""
    if page_size % sublanes(dtype):
        raise ValueError(f"the Pallas TPU attention kernel needs --page-size a multiple of "
                         f"{sublanes(dtype)} for {jnp.dtype(dtype).name}; got {page_size}")
    if max_seqs * pages_per_seq > MAX_PAGE_TABLE_ENTRIES:
        raise ValueError(
            f"the TPU attention kernel keeps the page table in scalar memory, at most "
            f"{MAX_PAGE_TABLE_ENTRIES} entries; {max_seqs} sequences x {pages_per_seq} pages is "
            "over: raise --page-size, or lower --context-length or --max-running-requests")


def default_page_size(max_seqs: int, context_length: int, smallest: int = 16) -> int:
    """The smallest power of two from `smallest` whose page table fits `check_shapes`."""
    page_size = smallest
    while max_seqs * -(-context_length // page_size) > MAX_PAGE_TABLE_ENTRIES:
        page_size *= 2
    return page_size
