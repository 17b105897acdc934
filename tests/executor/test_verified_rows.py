"""Speculative decoding inside the step (runtime/executor/verified_rows.py): which drafts each
sample row's penalties count, and which sample rows the step keeps (the host's acceptance rule,
runtime/scheduler/speculation.accepted), on hand-made batches."""
import jax.numpy as jnp
import numpy as np

from xlaserve.runtime.executor.forward_batch import Buckets, make_forward_batch
from xlaserve.runtime.executor.verified_rows import kept_rows, prior_draft_ids
from xlaserve.runtime.sampling.params import RowSamplingParams
from xlaserve.runtime.sampling.sampler import build_sampling_metadata, penalized_logits
from xlaserve.runtime.scheduler.request import SeqChunk
from xlaserve.runtime.scheduler.speculation import accepted

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
