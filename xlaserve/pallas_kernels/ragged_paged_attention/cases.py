"""Ragged paged attention inputs that catch stray reads: the cases the kernels are tested on
(tests/kernels) and checked with on real hardware (benchmarks/accelerator_check.py)."""
import numpy as np


def make_sinks(rng, num_q_heads):
    """Attention sinks f32[Hq] from -4 to 6 in shuffled head order: against scores of unit
    variance, the sink outweighs every key on some heads and hardly counts on others, and a
    kernel that gives a head another head's sink is off by far more than rounding."""
    return rng.permutation(np.linspace(-4.0, 6.0, num_q_heads)).astype(np.float32)


def make_case(rng, seqs, *, max_seqs, num_tokens, page_size, pages_per_seq, num_pages,
              num_kv_heads, num_q_heads, head_dim, dtype=np.float32):
    """seqs: (q_len, kv_len) of each live sequence. Returns the inputs as numpy arrays, with
    everything a kernel must not read poisoned: pages no live sequence uses, page-table slots past
    a sequence's needed pages (they point at such pages) and cache slots past kv_len are NaN, and
    so are padding tokens of q/k/v; padding rows of kv_lens / page_indices / cu_q_lens hold
    garbage. Pages are handed out in shuffled order."""
    dtype = np.dtype(dtype)
    q_lens = np.array([s[0] for s in seqs], np.int32)
    kv_lens_live = np.array([s[1] for s in seqs], np.int32)
    num_live, total = len(seqs), int(q_lens.sum())
    assert num_live <= max_seqs and total <= num_tokens and np.all(q_lens <= kv_lens_live)

    needed = [-(-int(kv) // page_size) for kv in kv_lens_live]
    assert max(needed, default=0) <= pages_per_seq and sum(needed) < num_pages
    perm = rng.permutation(num_pages)
    used, unused = list(perm[:sum(needed)]), perm[sum(needed):]
    page_indices = rng.integers(-num_pages, 3 * num_pages, (max_seqs, pages_per_seq), np.int32)
    for s, n in enumerate(needed):
        page_indices[s, :n] = [used.pop() for _ in range(n)]
        page_indices[s, n:] = rng.choice(unused, pages_per_seq - n)

    kv_lens = rng.integers(-1000, 10**6, max_seqs).astype(np.int32)
    kv_lens[:num_live] = kv_lens_live
    cu_q_lens = rng.integers(-5, 3 * num_tokens, max_seqs + 1).astype(np.int32)
    cu_q_lens[:num_live + 1] = np.concatenate([[0], np.cumsum(q_lens)])

    cache = np.full((num_pages, page_size, 2 * num_kv_heads, head_dim), np.nan, np.float32)
    for s, (q_len, kv_len) in enumerate(seqs):
        for pos in range(kv_len - q_len):
            cache[page_indices[s, pos // page_size], pos % page_size] = rng.standard_normal(
                (2 * num_kv_heads, head_dim))

    def tokens(heads):
        x = rng.standard_normal((num_tokens, heads, head_dim)).astype(np.float32)
        x[total:] = np.nan
        return x.astype(dtype)

    return dict(q=tokens(num_q_heads), k=tokens(num_kv_heads), v=tokens(num_kv_heads),
                kv_cache=cache.astype(dtype), kv_lens=kv_lens, page_indices=page_indices,
                cu_q_lens=cu_q_lens, num_seqs=np.array([num_live], np.int32))


# Split-KV decode (kernel_gpu's flash-decoding path): with 16-token KV blocks a 1000-token context
# is 63 blocks, so 4 or 7 splits each walk many; the 17-, 64- and 1-token contexts (2, 4 and 1
# blocks) leave later splits with no pages; 513 is one past a page boundary.
SPLIT_KV_SHAPES = {"max_seqs": 6, "num_tokens": 8, "page_size": 16, "pages_per_seq": 64,
                   "num_pages": 160}
SPLIT_KV_DECODE = [(1, 1000), (1, 17), (1, 513), (1, 1), (1, 64)]
# Beside a long decode, prefill items whose first rows have no key in the later splits (their
# causal limit falls before those splits' blocks), and a 2-token sequence split into nothing.
SPLIT_KV_MIXED_SHAPES = {**SPLIT_KV_SHAPES, "num_tokens": 16}
SPLIT_KV_MIXED = [(1, 1000), (7, 300), (1, 17), (2, 2)]


def make_mla_case(rng, seqs, *, num_q_heads, row_dim, dtype=np.float32, **shapes):
    """`make_case` for multi-head latent attention: (q [T, Hq, Dk], latent [T, Dk], kv_cache
    [pages, page_size, Dk], the metadata), poisoned the same way."""
    case = make_case(rng, seqs, num_kv_heads=1, num_q_heads=num_q_heads, head_dim=row_dim,
                     dtype=dtype, **shapes)
    case["latent"], case["kv_cache"] = case.pop("k")[:, 0], case["kv_cache"][:, :, 0]
    del case["v"]
    return case
