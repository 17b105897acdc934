"""--enable-deterministic-inference's kernels in a whole forward pass (issue 75): a sequence's
logits are the same bits alone and beside other sequences, its prompt in one step or cut into
chunks, with the TPU and GPU forms' Pallas kernels interpreted on this CPU (the batch-invariant
matmul and RMSNorm, pallas_kernels/invariant_*.py, and each platform's attention kernel with fixed
work items) and with this platform's own (the CPU's native kernels; compiled, on a GPU). Qwen3
takes its q and k norms through the kernels (`Kernels.module_norm`: XLA's fused norm of
[256, 16, 128] rows differed from a row's own), Gemma 3 its sandwich norms, tied LM head and
GeGLU."""
import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from tests.greedy_driver import PagedBatch, make_forward
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.model.layers import Kernels
from xlaserve.model.weight_types.packed import pack_model
from xlaserve.pallas_kernels.ragged_paged_attention import kernel_gpu
from xlaserve.pallas_kernels.ragged_paged_attention.api import get_attention_fn
from xlaserve.runtime.executor.kernels import deterministic_kernels, kernels_for
from xlaserve.runtime.executor.kv_pool import init_kv_pool
from xlaserve.weights.loader import load_model

PAGE = 16
PROMPT = [(11 * i) % 250 + 3 for i in range(21)]  # the sequence watched, then 2 decoded tokens
FOLLOW = [17, 230]
OTHERS = [[(7 * i) % 240 + 5 for i in range(30)], [9, 8, 7], [(5 * i) % 200 + 1 for i in range(12)]]


def _forms() -> dict:
    """Each platform's deterministic kernels as they run here."""
    return {
        "tpu, interpreted": lambda: deterministic_kernels(
            Kernels(attention=get_attention_fn("pallas", interpret=True)), "tpu", interpret=True),
        "gpu, interpreted": lambda: dataclasses.replace(deterministic_kernels(
            Kernels(attention=functools.partial(kernel_gpu.ragged_paged_attention,
                                                interpret=True)), "gpu", interpret=True),
            round_projections=True),
        # This machine's own (compiled on a GPU or TPU; the native kernels on a CPU)
        "this platform": lambda: kernels_for(deterministic=True),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family, packed) -> the loaded tiny model; packed: its weights in the native GEMM's
    panels, as a CPU server packs them (the CPU form's matmuls are the packed GEMM's)."""
    loaded = {}
    for family in ("qwen3", "gemma3"):
        directory = str(tmp_path_factory.mktemp(family))
        make_tiny_checkpoint(directory, family)
        for packed in (False, True):
            model = load_model(directory, dtype="float32", skip_tokenizer_init=True,
                               progress=False)
            if packed:
                pack_model(model.model, model.config.tie_word_embeddings)
            loaded[family, packed] = model
    return loaded


def _watched_logits(loaded, forward, arrangement: list[list[list[int]]]) -> np.ndarray:
    """Runs the steps of `arrangement` (each a list of chunks, sequence 0 the watched one) and
    returns sequence 0's logits rows, in position order."""
    batch = PagedBatch(len(arrangement[0]), 4, PAGE)
    kv_caches = init_kv_pool(loaded.config, batch.num_pages, PAGE, loaded.dtype, loaded.mesh)
    _, state = nnx.split(loaded.model)
    watched = []
    for chunks in arrangement:
        input_ids, positions, metadata, logits_indices, rows = batch.step_inputs(chunks, "all")
        logits, kv_caches = forward(state, input_ids, positions, kv_caches, metadata,
                                    logits_indices)
        logits = np.asarray(logits)
        watched += [logits[r] for r, (seq, _) in enumerate(rows) if seq == 0]
    return np.stack(watched)


def _arrangements():
    full = PROMPT + FOLLOW
    alone = [[PROMPT], [FOLLOW[:1]], [FOLLOW[1:]]]
    beside = [[PROMPT[:7], OTHERS[0], OTHERS[1], []],  # cut at 7, then 14
              [PROMPT[7:14], [], [4], OTHERS[2]],
              [PROMPT[14:], [6], [], []],
              [FOLLOW[:1], [3], [2], [1]],
              [FOLLOW[1:], [], [5], [8]]]
    assert sum(map(len, (c[0] for c in beside))) == len(full)
    return alone, beside


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@pytest.mark.parametrize("form", list(_forms()))
def test_a_sequences_logits_are_the_same_bits_whatever_shares_its_steps(models, family, form):
    loaded = models[family, form == "this platform" and jax.default_backend() == "cpu"]
    forward = make_forward(loaded.model, kernels=_forms()[form]())
    alone, beside = _arrangements()
    by_itself = _watched_logits(loaded, forward, alone)
    with_others = _watched_logits(loaded, forward, beside)
    assert by_itself.shape == (len(PROMPT) + len(FOLLOW), loaded.config.vocab_size)
    assert np.array_equal(by_itself, with_others)
