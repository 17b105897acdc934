"""Pooling a ragged batch's hidden states into embeddings (model/pooling.py, issue 54): each
sequence's CLS, mean or last row, normalised or not, against numpy per sequence (zero-length
padding sequences and rows past the last sequence give nothing), and against
sentence-transformers' `encode` on the hidden states of a tiny Qwen3 (transformers)."""
import jax.numpy as jnp
import numpy as np
import pytest

from tests.embedding_models import (make_tiny_transformer, save_decoder_embedding,
                                     sentence_transformer)
from xlaserve.model.pooling import pool_sequences

LENGTHS = [3, 1, 0, 5, 2, 0]  # 0: padding sequences of a bucket
PADDING_ROWS = 3  # the bucket's rows past the last sequence


def reference(hidden, lengths, mode, normalize):
    out, at = [], 0
    for n in lengths:
        rows = hidden[at:at + n]
        at += n
        if n == 0:
            out.append(np.zeros(hidden.shape[1]))
            continue
        v = {"cls": rows[0], "last": rows[-1], "mean": rows.mean(axis=0)}[mode]
        out.append(v / max(np.linalg.norm(v), 1e-12) if normalize else v)
    return np.stack(out)


@pytest.mark.parametrize("mode", ["cls", "mean", "last"])
@pytest.mark.parametrize("normalize", [True, False])
def test_each_sequence_pooled_from_its_own_rows(mode, normalize):
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((sum(LENGTHS) + PADDING_ROWS, 8)).astype(np.float32)
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(LENGTHS)]), jnp.int32)
    pooled = np.asarray(pool_sequences(jnp.asarray(hidden), cu_q_lens, mode, normalize))
    np.testing.assert_allclose(pooled, reference(hidden, LENGTHS, mode, normalize), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("mode,ours", [("lasttoken", "last"), ("cls", "cls"), ("mean", "mean")])
def test_pooled_hidden_states_equal_sentence_transformers_encode(tmp_path, mode, ours):
    pytest.importorskip("sentence_transformers")
    import torch
    import transformers

    directory = make_tiny_transformer(tmp_path)
    model = sentence_transformer(directory, mode, normalize=True)
    sentences = ["the cat sat on a mat", "dog", "a dog ran on the mat the end"]
    expected = model.encode(sentences, batch_size=8, convert_to_numpy=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    hf = transformers.AutoModel.from_pretrained(directory)
    rows, lengths = [], []
    with torch.no_grad():  # each sentence alone: the ragged rows of a step
        for sentence in sentences:
            ids = tokenizer(sentence, return_tensors="pt")["input_ids"]
            rows.append(hf(input_ids=ids).last_hidden_state[0].numpy())
            lengths.append(ids.shape[1])
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    pooled = pool_sequences(jnp.asarray(np.concatenate(rows)), cu_q_lens, ours, normalize=True)
    np.testing.assert_allclose(np.asarray(pooled), expected, atol=2e-5)
    # the modes differ on these inputs: a test that cannot fail would not see a wrong one
    assert not np.allclose(np.asarray(pool_sequences(jnp.asarray(np.concatenate(rows)), cu_q_lens,
                                                     "mean" if ours != "mean" else "last", True)),
                           expected, atol=1e-3)


@pytest.mark.parametrize("mode,ours", [("lasttoken", "last"), ("mean", "mean")])
def test_a_sentence_transformers_checkpoint_embeds_as_sentence_transformers(tmp_path, mode, ours):
    """A decoder embedding model as Qwen3-Embedding ships (sentence-transformers' save of the
    backbone alone, no `model.` prefix, under a Qwen3ForCausalLM config with tied embeddings):
    loaded by xlaserve, its hidden states through the final norm and pooled
    (CausalLM.embeddings) equal sentence-transformers' `encode`."""
    pytest.importorskip("sentence_transformers")
    import jax
    from flax import nnx

    from tests.greedy_driver import PagedBatch
    from xlaserve.runtime.executor.kernels import kernels_for
    from xlaserve.runtime.executor.kv_pool import init_kv_pool
    from xlaserve.weights.loader import load_model

    saved, model = save_decoder_embedding(tmp_path, mode)
    sentences = ["the cat sat on a mat", "dog", "a dog ran on the mat the mat"]
    expected = model.encode(sentences, convert_to_numpy=True)

    loaded = load_model(saved, dtype="float32", progress=False)
    ids = [loaded.tokenizer.encode(s, add_special_tokens=False) for s in sentences]
    batch = PagedBatch(len(ids), 2, 16)
    caches = init_kv_pool(loaded.config, batch.num_pages, 16, loaded.dtype, loaded.mesh)
    input_ids, positions, metadata, _, _ = batch.step_inputs(ids)
    graphdef, state = nnx.split(loaded.model)
    kernels = kernels_for()

    @jax.jit
    def embed(state, input_ids, positions, caches, metadata):
        lm = nnx.merge(graphdef, state)
        hidden, _ = lm.hidden_states(input_ids, positions, caches, metadata, kernels)
        return lm.embeddings(hidden, metadata.cu_q_lens, ours, True)

    pooled = np.asarray(embed(state, input_ids, positions, caches, metadata))[:len(ids)]
    np.testing.assert_allclose(pooled, expected, atol=1e-4)
