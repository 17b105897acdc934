"""ForwardBatch: one step's model inputs, concatenated and padded to a bucket on the host, then
sent to the device in one transfer.

Each scheduled sequence contributes a chunk of new tokens (a whole prompt, a piece of a chunked
prefill, or one decode token). Chunks are concatenated into one ragged token array; `cu_q_lens`
and `kv_lens` say which tokens belong to whom (docs/internals.md, the kernel contract).
Padding tokens and padding sequences are dead: `num_seqs` and `cu_q_lens` exclude them.

The page table is not one of the arrays: each live sequence's page list (`page_ids`) stays on the
host, and the serving step gathers its rows from the device's table by slot, which ModelRunner
keeps written (runtime/executor/page_table.py). `host_metadata` builds the padded table on the host, for
drivers that call the model directly (tests/greedy_driver.py, other tests).

`decode_forward_batch`: the ForwardBatch of a continuation whose rows all decode
(runtime/scheduler/request.py, DecodeRows), built from its columns. make_forward_batch reads every
SeqChunk (its token ids, its page list) into fresh arrays; a decode continuation has its rows as
columns already, one array each here. Its page lists are the scheduler's, shared with the last
decode step for the rows that got no page, which the device page table's writes skip without
reading them (runtime/executor/page_table.py). The arrays equal make_forward_batch's for the same
chunks (tests/executor/test_decode_batch.py).

Padding buckets (`Buckets`): every jitted step runs at one of a few known shapes, chosen at
start-up (buckets.py); a batch is padded to the smallest that holds it (`Buckets.shape_for`).
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools

import jax
import numpy as np

from xlaserve.model.transformer import AttentionMetadata
from xlaserve.runtime.scheduler.page_allocator import NULL_PAGE
from xlaserve.runtime.scheduler.request import DecodeRows, ScheduledBatch, SeqChunk
from xlaserve.runtime.scheduler.speculation import row_depths

# --- padding buckets --------------------------------------------------------------------------

def sample_rows_for(tokens: int, seqs: int, verify_tokens: int = 1, max_seqs: int = 0) -> int:
    """Sample rows of a step of `tokens` x `seqs` (a bucket): one per sequence, and with
    speculative decoding one per token of a verified row (`verify_tokens` tokens at most: the
    last accepted token and its drafts). A step with verified rows decodes only and holds at
    most `max_seqs` tokens (the largest sequence bucket; Speculator.drafts keeps it so), so:
    `min(tokens, seqs * verify_tokens, max_seqs)`, and never fewer than `seqs`. By default
    (one sequence bucket per token bucket) that is `seqs` for every bucket: a plain server's
    shapes, and no prompt step runs the LM head on more rows. The LM head and the sampler run
    once per sample row."""
    if verify_tokens <= 1:
        return seqs
    return max(seqs, min(tokens, seqs * verify_tokens, max_seqs))


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} is over the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclasses.dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]  # packed new tokens per step
    seqs: tuple[int, ...]  # sequences per step
    pages: tuple[int, ...]  # pages per sequence in the page table
    grid: bool = False  # every (tokens, seqs) pair, or one sequence bucket per token bucket
    verify_tokens: int = 1  # tokens of a speculative verified row at most (1: no speculation)
    tree: bool = False  # verified rows may be trees (--speculative-eagle-topk > 1)

    def sample_rows(self, tokens: int, seqs: int) -> int:
        """A bucket's sample rows (`sample_rows_for`)."""
        return sample_rows_for(tokens, seqs, self.verify_tokens, self.seqs[-1])

    def step_shapes(self) -> list[tuple[int, int]]:
        """The (tokens, seqs) pairs a step can take, smallest first. A step has at least as many
        token slots as sequences (each sequence adds >= 1 token), so seqs <= tokens."""
        if self.grid:
            return [(t, s) for t in self.tokens for s in self.seqs if s <= t]
        return [(t, bucket_for(min(t, self.seqs[-1]), self.seqs)) for t in self.tokens]

    def shape_for(self, num_tokens: int, num_seqs: int, pages_per_seq: int) -> tuple[int, int, int]:
        pages = bucket_for(max(pages_per_seq, 1), self.pages)
        for tokens, seqs in self.step_shapes():
            if tokens >= num_tokens and seqs >= num_seqs:
                return tokens, seqs, pages
        raise ValueError(f"a step of {num_tokens} tokens and {num_seqs} sequences is over the "
                         f"largest bucket {self.step_shapes()[-1]}")

    def all_shapes(self) -> list[tuple[int, int, int]]:
        """Every (tokens, seqs, pages) a step can take: the set to precompile."""
        return [(t, s, p) for t, s in self.step_shapes() for p in self.pages]

    @property
    def tree_width(self) -> int:
        """A tree step's `ForwardBatch.tree_width` (0: the server verifies no tree)."""
        return self.verify_tokens if self.tree else 0

    def tree_shapes(self) -> list[tuple[int, int, int]]:
        """The shapes a step with tree rows can take, which run the tree program too: a step
        with drafts holds at most the largest sequence bucket's tokens (`sample_rows_for`), in
        the token bucket that fits them or a smaller one."""
        if not self.tree:
            return []
        most = bucket_for(min(self.seqs[-1], self.tokens[-1]), self.tokens)
        return [shape for shape in self.all_shapes() if shape[0] <= most]


# --- the step's batch --------------------------------------------------------------------------

_ARRAYS = ("input_ids", "positions", "kv_lens", "cu_q_lens", "num_seqs", "logits_indices",
           "sample_rows", "sample_seqs", "target_ids", "input_slots", "next_ids", "tree_masks")


@functools.partial(jax.tree_util.register_dataclass, data_fields=_ARRAYS,
                   meta_fields=("pages", "tree_width"),
                   drop_fields=("page_ids", "rope_positions", "input_embeds", "state_copies"))
@dataclasses.dataclass
class ForwardBatch:
    input_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    kv_lens: np.ndarray  # i32[S]: each sequence's KV length, its new tokens included
    cu_q_lens: np.ndarray  # i32[S+1]: where each sequence's tokens start
    num_seqs: np.ndarray  # i32[1]: the live sequences
    # i32[R]: the token row each sample row takes its logits from: the last new token of each
    # sequence, and every token of a speculative verified row (R = sample_rows_for(T, S)).
    logits_indices: np.ndarray
    # bool[R]: sample rows whose token the request keeps (counted for penalties, the slot's last
    # token): a prompt chunk's that ends before the prompt does and padding's are not; of a
    # verified row's, the step keeps a prefix (executor/verified_rows.py).
    sample_rows: np.ndarray
    sample_seqs: np.ndarray  # i32[R]: the sequence of each sample row, -1 for padding
    # i32[T]: per token row, the id whose logprob and top alternatives the step returns, -1 for
    # none (padding too). Data, not a static argument: any mix runs in the bucket's one program.
    target_ids: np.ndarray
    # i32[T]: per token row, the slot whose last sampled token (device state) is the input, -1
    # where `input_ids` holds it.
    input_slots: np.ndarray
    # i32[S]: per sequence, the token after its new ones where the host knows it (a prompt chunk
    # that ends before the prompt does), else -1: a speculative draft head reads it
    # (executor/draft_head_step.py).
    next_ids: np.ndarray
    # i32[T]: in a step with speculative tree rows, the new tokens of its sequence each token
    # sees (bit j: the j-th; pallas_kernels/ragged_paged_attention/tree_tokens.py), else 0.
    tree_masks: np.ndarray
    pages: int  # pages per sequence: the width of the page table the attention reads
    # > 0: the step has tree rows and runs the tree program (static): its rows hold at most this
    # many tokens. 0: causal attention, every other step.
    tree_width: int = 0
    # Each live sequence's pages (host only, not a pytree leaf: ModelRunner writes them into the
    # device's page table). Lists the batch does not own: read, never changed.
    page_ids: list[list[int]] = dataclasses.field(default_factory=list)
    # A vision model's step (runtime/executor/image_rows.py; host only): each token row's
    # (temporal, height, width) RoPE position, i32[3, T], which replaces `positions` for RoPE;
    # and the rows that take an image's embedding (`input_ids` -1 there), [levels, T, hidden]
    # (levels: the embedding, then Qwen3-VL's DeepStack rows).
    rope_positions: np.ndarray | None = None
    input_embeds: np.ndarray | None = None
    # A hybrid model's state copies (host only; the step takes them as state_pool.StateCopies):
    # the chunks' restores, then their snapshots, each a list of (source, destination) slots.
    state_copies: tuple[list, list] = ((), ())

    @property
    def num_sample_rows(self) -> int:
        """R, the padded sample rows: the sampler's and the grammar masks' rows."""
        return self.logits_indices.shape[0]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(tokens, seqs, pages per seq): the bucket, i.e. which compiled program runs it."""
        return self.input_ids.shape[0], self.kv_lens.shape[0], self.pages

    def host_metadata(self) -> AttentionMetadata:
        """The attention's metadata with the page table built on the host: sequence i's pages,
        then NULL_PAGE, and NULL_PAGE rows for padding."""
        page_indices = np.full((self.shape[1], self.pages), NULL_PAGE, np.int32)
        write_rows(page_indices, self.page_ids)
        return AttentionMetadata(kv_lens=self.kv_lens, page_indices=page_indices,
                                 cu_q_lens=self.cu_q_lens, num_seqs=self.num_seqs,
                                 tree_masks=self.tree_masks if self.tree_width else None,
                                 tree_width=self.tree_width)


def write_rows(table: np.ndarray, page_ids: list[list[int]]) -> None:
    """Row i of `table` starts with page_ids[i] (cut to the table's width); one scatter."""
    lengths = np.fromiter((min(len(p), table.shape[1]) for p in page_ids), np.int64, len(page_ids))
    starts = np.cumsum(lengths) - lengths
    rows = np.repeat(np.arange(len(page_ids)), lengths)
    table[rows, np.arange(rows.size) - np.repeat(starts, lengths)] = np.fromiter(
        itertools.chain.from_iterable(p[:n] for p, n in zip(page_ids, lengths.tolist())),
        np.int32, rows.size)


def make_forward_batch(chunks: list[SeqChunk], buckets: Buckets, page_size: int) -> ForwardBatch:
    """`chunks` concatenated into host arrays padded to the smallest fitting bucket.

    Column-wise: each per-sequence field is read into one array and the token rows are filled
    by whole-array assignments. The row-by-row loop (a dozen small numpy
    assignments per sequence) cost 0.58 ms of the engine thread's time per 256-row decode step
    on a 2-core CPU (benchmarks/bench_host_step.py), this ~0.15 ms."""
    n = len(chunks)
    lengths = np.fromiter((len(c.token_ids) for c in chunks), np.int64, n)
    if n == 0 or not lengths.all():
        raise ValueError("a scheduled sequence must run at least one token")
    num_cached = np.fromiter((c.num_cached for c in chunks), np.int64, n)
    kv = num_cached + lengths
    pages_needed = -(-kv // page_size)
    has_pages = np.fromiter((len(c.page_ids) for c in chunks), np.int64, n)
    if (short := np.flatnonzero(has_pages < pages_needed)).size:
        i = int(short[0])
        raise ValueError(f"sequence {i} needs {pages_needed[i]} pages, has {has_pages[i]}")
    ends = np.cumsum(lengths)
    starts = ends - lengths
    num_tokens = int(ends[-1])
    padded_tokens, padded_seqs, padded_pages = buckets.shape_for(num_tokens, n,
                                                                 int(pages_needed.max()))

    input_ids = np.zeros(padded_tokens, np.int32)
    positions = np.zeros(padded_tokens, np.int32)
    kv_lens = np.zeros(padded_seqs, np.int32)
    cu_q_lens = np.full(padded_seqs + 1, num_tokens, np.int32)
    drafts = np.fromiter((c.num_drafts for c in chunks), np.int64, n)
    rows_per_seq = drafts + 1  # a sample row per sequence, and one per draft it verifies
    num_rows = int(rows_per_seq.sum())
    padded_rows = buckets.sample_rows(padded_tokens, padded_seqs)
    if num_rows > padded_rows:
        raise ValueError(f"{num_rows} sample rows are over the bucket's {padded_rows}")
    logits_indices = np.zeros(padded_rows, np.int32)
    sample_rows = np.zeros(padded_rows, np.bool_)
    sample_seqs = np.full(padded_rows, -1, np.int32)
    target_ids = np.full(padded_tokens, -1, np.int32)
    input_slots = np.full(padded_tokens, -1, np.int32)
    input_ids[:num_tokens] = np.fromiter(
        itertools.chain.from_iterable(c.token_ids for c in chunks), np.int32, num_tokens)
    # Token row t of sequence i is at position num_cached[i] + (t - starts[i]).
    positions[:num_tokens] = np.arange(num_tokens) + np.repeat(num_cached - starts, lengths)
    tree_masks = np.zeros(padded_tokens, np.int32)
    tree_width = 0
    if any(c.tree_parents is not None for c in chunks):
        tree_width = buckets.tree_width
        if not tree_width or num_tokens > buckets.seqs[-1] or lengths.max() > tree_width:
            raise ValueError(f"a step of tree rows holds rows of {tree_width} tokens at most "
                             f"and {buckets.seqs[-1]} in all; got {int(lengths.max())} and "
                             f"{num_tokens}")
        masks, depths = tree_rows(chunks)
        tree_masks[:num_tokens] = masks
        positions[:num_tokens] = np.repeat(num_cached, lengths) + depths
    kv_lens[:n] = kv
    cu_q_lens[:n] = starts
    samples = np.fromiter((c.sample for c in chunks), np.bool_, n)
    if not drafts.any():
        logits_indices[:n] = ends - 1
        sample_rows[:n] = samples
        sample_seqs[:n] = np.arange(n)
    else:  # a verified row samples after each of its tokens: its last rows' logits
        row_ends = np.cumsum(rows_per_seq)
        in_row = np.arange(num_rows) - np.repeat(row_ends - rows_per_seq, rows_per_seq)
        logits_indices[:num_rows] = np.repeat(ends - rows_per_seq, rows_per_seq) + in_row
        sample_rows[:num_rows] = np.repeat(samples, rows_per_seq)
        sample_seqs[:num_rows] = np.repeat(np.arange(n), rows_per_seq)
    if (wrong := np.flatnonzero((drafts > 0) & ((drafts >= lengths) | ~samples))).size:
        i = int(wrong[0])
        raise ValueError(f"sequence {i} verifies {drafts[i]} drafts in {lengths[i]} tokens")
    slots = np.fromiter((c.input_slot for c in chunks), np.int64, n)
    from_slot = slots >= 0
    if (wrong := np.flatnonzero(from_slot & (lengths != 1))).size:
        i = int(wrong[0])
        raise ValueError(f"sequence {i} takes its input from a slot but runs {lengths[i]} tokens")
    input_slots[starts[from_slot]] = slots[from_slot]
    for i, chunk in enumerate(chunks):  # prompt-logprob chunks only: rare
        if chunk.target_ids is not None:
            if len(chunk.target_ids) != lengths[i]:
                raise ValueError(f"sequence {i} has {lengths[i]} tokens but "
                                 f"{len(chunk.target_ids)} targets")
            target_ids[starts[i]:ends[i]] = chunk.target_ids
    next_ids = np.full(padded_seqs, -1, np.int32)
    next_ids[:n] = np.fromiter((c.next_token for c in chunks), np.int32, n)
    copies = ([c.restore for c in chunks if c.restore is not None],
              [c.snapshot for c in chunks if c.snapshot is not None])
    return ForwardBatch(input_ids, positions, kv_lens, cu_q_lens, np.array([n], np.int32),
                        logits_indices, sample_rows, sample_seqs, target_ids, input_slots,
                        next_ids, tree_masks, padded_pages, tree_width,
                        [c.page_ids for c in chunks], state_copies=copies)


def tree_rows(chunks: list[SeqChunk]) -> tuple[np.ndarray, np.ndarray]:
    """(each token's tree mask, its depth), i32 over the chunks' tokens in order: a chunk that is
    no tree is a chain (a plain decoding row, a chain of drafts). ValueError for parents that
    are not a tree in order (each after its own, the first the root) or siblings of one token."""
    masks, depths = [], []
    for i, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        parents = chunk.tree_parents if chunk.tree_parents is not None else list(range(-1, n - 1))
        if len(parents) != n or parents[0] != -1 or any(
                not 0 <= p < j for j, p in enumerate(parents) if j):
            raise ValueError(f"sequence {i}'s tree parents {parents} are not a tree of its "
                             f"{n} tokens in order")
        children = {(p, chunk.token_ids[j]) for j, p in enumerate(parents) if j}
        if len(children) != n - 1:
            raise ValueError(f"sequence {i}'s tree has siblings of one token")
        row_masks = []
        for j, p in enumerate(parents):
            row_masks.append((row_masks[p] if p >= 0 else 0) | (1 << j))
        masks += row_masks
        depths += row_depths(chunk)
    return np.array(masks, np.int64).astype(np.int32), np.array(depths, np.int32)


def decode_forward_batch(rows: DecodeRows, buckets: Buckets, page_size: int) -> ForwardBatch:
    n = len(rows.num_cached)
    num_cached = np.array(rows.num_cached, np.int32)
    kv = num_cached + 1
    pages_needed = -(-kv // page_size)
    num_pages = np.fromiter(map(len, rows.page_ids), np.int64, n)
    if (short := np.flatnonzero(num_pages < pages_needed)).size:
        i = int(short[0])
        raise ValueError(f"sequence {i} needs {pages_needed[i]} pages, has {num_pages[i]}")
    padded_tokens, padded_seqs, padded_pages = buckets.shape_for(n, n, int(pages_needed.max()))
    positions = np.zeros(padded_tokens, np.int32)
    positions[:n] = num_cached
    kv_lens = np.zeros(padded_seqs, np.int32)
    kv_lens[:n] = kv
    padded_rows = buckets.sample_rows(padded_tokens, padded_seqs)
    row_index = np.arange(padded_rows, dtype=np.int32)
    cu_q_lens = np.minimum(np.arange(padded_seqs + 1, dtype=np.int32), n)
    sample_rows = row_index < n
    input_slots = np.full(padded_tokens, -1, np.int32)
    input_slots[:n] = rows.slots
    return ForwardBatch(
        input_ids=np.zeros(padded_tokens, np.int32), positions=positions, kv_lens=kv_lens,
        cu_q_lens=cu_q_lens, num_seqs=np.array([n], np.int32),
        logits_indices=np.where(sample_rows, row_index, 0).astype(np.int32),
        sample_rows=sample_rows, sample_seqs=np.where(sample_rows, row_index, -1).astype(np.int32),
        target_ids=np.full(padded_tokens, -1, np.int32),
        input_slots=input_slots, next_ids=np.full(padded_seqs, -1, np.int32),
        tree_masks=np.zeros(padded_tokens, np.int32), pages=padded_pages, page_ids=rows.page_ids,
        state_copies=((), list(rows.snapshots.values())))


def forward_batch_for(batch: ScheduledBatch, buckets: Buckets, page_size: int) -> ForwardBatch:
    """The scheduled step's ForwardBatch: from a decode continuation's columns, else from its
    chunks (with the prompt-logprob targets the engine put in them)."""
    if batch.decode is not None:
        return decode_forward_batch(batch.decode, buckets, page_size)
    return make_forward_batch(batch.chunks, buckets, page_size)
