"""Speculative decoding inside the step (runtime/executor/verified_rows.py): which drafts each
sample row's penalties count, and which sample rows the step keeps (the host's acceptance rule,
runtime/scheduler/speculation.accepted), on hand-made batches; for tree rows, the path the host
walks (speculation.walk), each node's drafts and where the kept path's KV moves."""
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.runtime.executor.forward_batch import Buckets, make_forward_batch
from xlaserve.runtime.executor.verified_rows import (kept_path_moves, kept_rows,
                                                     move_kv_entries, prior_draft_ids,
                                                     tree_kept_rows, tree_prior_draft_ids)
from xlaserve.runtime.sampling.params import RowSamplingParams
from xlaserve.runtime.sampling.sampler import penalized_logits
from xlaserve.runtime.sampling.params import build_sampling_metadata
from xlaserve.runtime.scheduler.request import SeqChunk
from xlaserve.runtime.scheduler.speculation import accepted, walk

BUCKETS = Buckets(tokens=(16,), seqs=(16,), pages=(4,), verify_tokens=4)


def batch():
    """A plain decode row (token 9), a verified row [5, 6, 7, 8] and a prompt's last chunk."""
    chunks = [SeqChunk([9], 3, [1]), SeqChunk([5, 6, 7, 8], 2, [2, 3], num_drafts=3),
              SeqChunk([1, 2, 3], 0, [4])]
    return make_forward_batch(chunks, BUCKETS, page_size=4)


def test_each_sample_row_of_a_verified_row_counts_the_drafts_before_it():
    fb = batch()
    assert fb.num_sample_rows == 16 and list(fb.sample_seqs[:7]) == [0, 1, 1, 1, 1, 2, -1]
    prior = np.asarray(prior_draft_ids(jnp.asarray(fb.input_ids), jnp.asarray(fb.logits_indices),
                                       jnp.asarray(fb.sample_seqs), 3))
    assert prior[:6].tolist() == [[-1, -1, -1], [-1, -1, -1], [6, -1, -1], [6, 7, -1],
                                  [6, 7, 8], [-1, -1, -1]]
    assert (prior[6:] == -1).all()  # padding


def test_the_step_keeps_the_prefix_the_host_accepts():
    fb = batch()
    args = [jnp.asarray(a) for a in (fb.input_ids, fb.logits_indices, fb.sample_seqs)]
    drafts = [6, 7, 8]
    for sampled in ([6, 7, 8, 11], [6, 7, 4, 11], [6, 3, 8, 11], [2, 7, 8, 11]):
        tokens = np.full(16, 0, np.int32)
        tokens[0], tokens[1:5], tokens[5] = 10, sampled, 12
        kept, last = (np.asarray(a) for a in kept_rows(jnp.asarray(tokens), *args))
        keep = accepted(drafts, sampled)
        assert kept[1:5].tolist() == [i < keep for i in range(4)], sampled
        assert last[1:5].tolist() == [i == keep - 1 for i in range(4)], sampled
        assert kept[0] and last[0] and kept[5] and last[5]  # one-row sequences


def test_penalties_with_prior_drafts_equal_the_counts_with_those_drafts_in_them():
    vocab = 32
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, vocab)), jnp.float32)
    params = RowSamplingParams(temperature=0.0, seed=0, frequency_penalty=0.7,
                               presence_penalty=0.3, repetition_penalty=1.5)
    metadata = build_sampling_metadata([params] * 3, 3)
    counts = np.zeros((3, vocab), np.int32)
    counts[:, 4] = 1
    prompt = np.zeros((3, vocab), np.bool_)
    prompt[:, 2] = True
    prior = np.array([[-1, -1], [6, -1], [6, 7]], np.int32)
    got = penalized_logits(logits, metadata, jnp.asarray(counts), jnp.asarray(prompt),
                           prior_ids=jnp.asarray(prior))
    with_drafts = counts.copy()
    with_drafts[1, 6] += 1
    with_drafts[2, [6, 7]] += 1
    want = penalized_logits(logits, metadata, jnp.asarray(with_drafts), jnp.asarray(prompt))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want))
    assert not np.allclose(np.asarray(got)[2], np.asarray(penalized_logits(
        logits, metadata, jnp.asarray(counts), jnp.asarray(prompt)))[2])


# --- tree rows ------------------------------------------------------------------------------

TREE_BUCKETS = Buckets(tokens=(16,), seqs=(16,), pages=(4,), verify_tokens=6, tree=True)
# Root 5 at position 2; nodes 6 and 7 under it, 8 under 6, 9 under 7, 4 under 8.
TREE = SeqChunk([5, 6, 7, 8, 9, 4], 2, [2, 3], num_drafts=5, tree_parents=[-1, 0, 0, 1, 2, 3])


def tree_batch():
    """A plain decode row (token 9) and the tree row above."""
    return make_forward_batch([SeqChunk([9], 3, [1]), TREE], TREE_BUCKETS, page_size=4)


def test_a_tree_rows_masks_name_each_nodes_ancestors_and_positions_its_depth():
    fb = tree_batch()
    assert fb.tree_width == 6
    assert fb.tree_masks[:7].tolist() == [1, 1, 0b11, 0b101, 0b1011, 0b10101, 0b101011]
    assert fb.positions[:7].tolist() == [3, 2, 3, 3, 4, 4, 5]
    bad = [([-1, 0, 0], [5, 6, 6]), ([-1, 1, 0], [5, 6, 7]), ([0, 0, 0], [5, 6, 7])]
    for parents, tokens in bad:  # siblings of one token; a parent after its child; no root
        with pytest.raises(ValueError, match="tree"):
            make_forward_batch([SeqChunk(tokens, 2, [2, 3], num_drafts=2, tree_parents=parents)],
                               TREE_BUCKETS, page_size=4)
    with pytest.raises(ValueError, match="tree rows"):  # a server without trees
        make_forward_batch([TREE], BUCKETS, page_size=4)


def test_a_tree_node_counts_its_ancestors_drafts_and_the_step_keeps_the_path_the_host_walks():
    fb = tree_batch()
    args = [jnp.asarray(a) for a in (fb.input_ids, fb.tree_masks, fb.logits_indices,
                                     fb.sample_seqs, fb.cu_q_lens)]
    prior = np.asarray(tree_prior_draft_ids(*args, 5))
    assert prior[:7].tolist() == [[-1] * 5, [-1] * 5, [6, -1, -1, -1, -1], [-1, 7, -1, -1, -1],
                                  [6, -1, 8, -1, -1], [-1, 7, -1, 9, -1], [6, -1, 8, -1, 4]]
    # The target's token after each tree token (root, 6, 7, 8, 9, 4) -> the path it walks.
    for sampled, path in [([7, 1, 9, 1, 3, 1], [0, 2, 4]), ([6, 8, 1, 4, 1, 2], [0, 1, 3, 5]),
                          ([3, 1, 1, 1, 1, 1], [0]), ([6, 1, 1, 1, 1, 1], [0, 1])]:
        tokens = np.zeros(16, np.int32)
        tokens[0], tokens[1:7] = 10, sampled
        kept, last, depth = (np.asarray(a) for a in tree_kept_rows(jnp.asarray(tokens), *args,
                                                                   6))
        assert walk(TREE, sampled) == path
        assert kept[1:7].tolist() == [i in path for i in range(6)], sampled
        assert last[1:7].tolist() == [i == path[-1] for i in range(6)], sampled
        assert kept[0] and last[0] and not kept[7:].any()
        assert depth[1:7].tolist() == [0, 1, 1, 2, 2, 3]


def test_the_kept_paths_kv_moves_to_the_paths_positions_and_nothing_else_moves():
    fb = tree_batch()
    page_size, num_pages = 4, 6
    page_indices = np.zeros((16, 4), np.int32)
    page_indices[0, 0], page_indices[1, :2] = 1, [2, 3]
    kept = np.zeros(16, bool)
    kept[[0, 1, 3, 5]] = True  # the plain row; the root, node 7 (offset 2), node 9 (offset 4)
    depth = np.zeros(16, np.int32)
    depth[1:7] = [0, 1, 1, 2, 2, 3]
    moves = kept_path_moves(*(jnp.asarray(a) for a in (kept, depth, fb.logits_indices,
                                                       fb.sample_seqs, fb.cu_q_lens, fb.kv_lens,
                                                       page_indices)), page_size, num_pages)
    cache = np.arange(num_pages * page_size * 2, dtype=np.float32).reshape(num_pages, page_size, 2)
    moved, = move_kv_entries([jnp.asarray(cache)], *moves)
    want = cache.copy()
    # The row's first position is 2 (page 2, slot 2): offset 2 (position 4: page 3 slot 0) to
    # position 3 (page 2 slot 3), offset 4 (position 6: page 3 slot 2) to position 4 (page 3 slot 0).
    want[2, 3], want[3, 0] = cache[3, 0], cache[3, 2]
    np.testing.assert_array_equal(np.asarray(moved), want)


def test_the_likeliest_nodes_of_a_beam_make_a_tree_parents_first():
    from xlaserve.runtime.executor.drafts.draft_tree import select_tree

    # A beam of 2 paths, 3 levels: nodes 0, 1 (level 1), 2, 3 (level 2), 4, 5 (level 3); parents
    # as verified-row indices (0: the root, n + 1: node n).
    tokens = np.array([10, 11, 12, 13, 14, 15])
    parents = np.array([0, 0, 2, 1, 4, 4])
    scores = np.array([-0.5, -0.2, -1.0, -0.4, -1.5, -0.6])
    tree = select_tree(tokens, parents, scores, room=4)
    # The 4 likeliest: 11 (-0.2), 13 (-0.4, under 10), 10 (-0.5), 15 (-0.6, under 13).
    assert (tree.tokens, tree.parents) == ([11, 10, 13, 15], [0, 0, 2, 3])
    assert select_tree(tokens, parents, scores, room=1).tokens == [11]
