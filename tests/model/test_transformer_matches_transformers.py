"""Our Flax decoder over the paged KV cache gives transformers' logits, for every family, with the
weights in their own layout (XLA's dots) and packed for the CPU's native GEMM."""
import numpy as np
import pytest
import torch
from flax import nnx

from xlaserve.weights.loader import load_model
from xlaserve.model.weight_types.packed import PackedExperts, PackedMatrix, pack_model
from xlaserve.runtime.executor.kv_pool import init_kv_pool

from tests.greedy_driver import PagedBatch, make_forward
from tests.tiny_models import FAMILIES

PROMPTS = [
    [5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64],
    [1, 2],
    [400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413, 414, 415, 416, 417, 418],
    [99],
    [7, 7, 7, 7, 7, 7, 7],
]
NEW_TOKENS = 5
TOLERANCE = 1e-4
WEIGHT_LAYOUTS = ["xla", "packed"]


def pack_or_skip(loaded):
    """Packs `loaded`'s weights for the native CPU GEMM, or skips the test where it does not
    build."""
    from xlaserve.native import KernelUnavailable, gemm_cpu
    try:
        gemm_cpu.load()
    except KernelUnavailable as error:
        pytest.skip(f"the native CPU GEMM does not build here: {error}")
    pack_model(loaded.model, loaded.config.tie_word_embeddings)


def _lay_out(loaded, layout):
    if layout == "packed":
        pack_or_skip(loaded)
        assert isinstance(loaded.model.layers[0].attn.qkv.get_value(), PackedMatrix)
        # Every mixture-of-experts layer's experts packed: only the native grouped GEMM takes them
        experts = [weight.get_value() for layer in loaded.model.layers
                   for weight in (getattr(layer.mlp, "experts_gate_up", None),
                                  getattr(layer.mlp, "experts_down", None)) if weight is not None]
        assert len(experts) == 2 * sum(loaded.config.moe_layers)
        assert all(isinstance(weight, PackedExperts) for weight in experts)


def _hf_reference(hf_model, prompt):
    """transformers' greedy continuation of `prompt` and its logits at every position."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        generated = hf_model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                      pad_token_id=0, eos_token_id=None)
        logits = hf_model(generated).logits[0].numpy()
    return generated[0].tolist(), logits


def _run_ours(loaded, sequences, prefill_chunk, page_size, **forward_options):
    """Feed each sequence's prompt in chunks of `prefill_chunk` tokens (all sequences together
    in one ragged batch per step), then the continuation one token per step. Returns our logits
    for every position of every sequence. `forward_options`: make_forward's."""
    model = loaded.model
    longest = max(len(s) for s, _ in sequences)
    batch = PagedBatch(len(sequences), -(-longest // page_size), page_size)
    kv_caches = init_kv_pool(loaded.config, batch.num_pages, page_size, loaded.dtype, loaded.mesh,
                             state_slots=batch.num_slots)
    forward = make_forward(model, **forward_options)
    _, state = nnx.split(model)
    ours = [np.full((len(s), loaded.config.vocab_size), np.nan, np.float32) for s, _ in sequences]
    fed = [0] * len(sequences)
    while any(fed[i] < len(s) for i, (s, _) in enumerate(sequences)):
        chunks = []
        for i, (full, prompt_len) in enumerate(sequences):
            size = prefill_chunk if fed[i] < prompt_len else 1
            end = min(fed[i] + size, prompt_len) if fed[i] < prompt_len else fed[i] + 1
            chunks.append(full[fed[i]:min(end, len(full))])
            fed[i] += len(chunks[-1])
        input_ids, positions, metadata, logits_indices, rows = batch.step_inputs(chunks, logits="all")
        logits, kv_caches = forward(state, input_ids, positions, kv_caches, metadata, logits_indices)
        logits = np.asarray(logits)
        for row, (seq, pos) in enumerate(rows):
            ours[seq][pos] = logits[row]
    return ours


def _batch_shapes_by_pairs() -> list:
    """Every family with each batch shape and with each weight layout, and each shape with each
    layout: the pairs, not the product (18 cases of 36, 2026-11-28)."""
    shapes = [((64, 16), "one_ragged_batch"), ((3, 4), "chunked_prefill_by_3")]
    cases = []
    for i, family in enumerate(FAMILIES):
        for j, layout in enumerate(WEIGHT_LAYOUTS):
            (prefill_chunk, page_size), name = shapes[(i + j) % len(shapes)]
            cases.append(pytest.param(prefill_chunk, page_size, family, layout,
                                      id=f"{name}-{family}-{layout}"))
    return cases


@pytest.mark.parametrize("prefill_chunk,page_size,family,layout", _batch_shapes_by_pairs())
def test_logits_match_transformers_for_ragged_batch_then_decode(
        tiny_checkpoints, family, prefill_chunk, page_size, layout):
    directory, hf_model = tiny_checkpoints[family]
    loaded = load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False)
    _lay_out(loaded, layout)
    _check_float32_logits(loaded, hf_model, PROMPTS, prefill_chunk, page_size)


def _check_float32_logits(loaded, hf_model, prompts, prefill_chunk, page_size):
    """Our logits of `prompts` and transformers' greedy continuations equal its own, and its
    continuation is our argmax at every step."""
    references = [_hf_reference(hf_model, p) for p in prompts]
    sequences = [(full, len(p)) for p, (full, _) in zip(prompts, references, strict=True)]
    ours = _run_ours(loaded, sequences, prefill_chunk, page_size)
    for (full, expected), got in zip(references, ours, strict=True):
        np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)
        prompt_len = len(full) - NEW_TOKENS
        assert got[prompt_len - 1:-1].argmax(-1).tolist() == full[prompt_len:]


# Llama 4's chunked attention (tests/tiny_models.py: chunk 32 on its RoPE layers): prompts past
# the chunk boundary, continuations decoded across it (positions 28..32, 61..65), ragged prefill
# chunks of 7 that cross it; transformers' eager attention masks by chunk (masking_utils'
# chunked_overlay: its logits past position 31 move by ~1.8 with the chunk made 10^6).
CHUNKED_PROMPTS = [list(range(5, 45)), [(7 * i) % 500 + 1 for i in range(28)],
                   list(range(300, 361))]


@pytest.mark.parametrize("prefill_chunk,page_size", [(7, 4), (64, 16)])
def test_llama4_logits_across_attention_chunks(tiny_checkpoints, prefill_chunk, page_size):
    directory, hf_model = tiny_checkpoints["llama4"]
    loaded = load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False)
    assert loaded.config.attention_chunks == (32, 32, None, None)
    _check_float32_logits(loaded, hf_model, CHUNKED_PROMPTS, prefill_chunk, page_size)


# bfloat16's error as a fraction of the logit scale, 2% unless given (measured: under 1%). The
# tiny Gemma 3's logits are small (its tied embeddings are, tests/tiny_models.py) and its norms
# after each sublayer amplify roundings: measured 4.5% at most, where transformers' own bfloat16
# model is 6.7% from its float32 one. The tiny Gemma 4 likewise: 3.3% measured, transformers' own
# bfloat16 4.9% from its float32; with its MoE block 5.0% at most (the projections rounded as
# on GPU), where transformers' own bfloat16 is 9.5% from its float32. The tiny Gemma 4 with
# per-layer embeddings and KV-shared layers is worse conditioned still (each layer adds a normed
# per-layer delta): 23.4% measured, transformers' own bfloat16 18.4% from its float32 (without
# the shared layers: ours 11.3%, transformers' 22.5%); its float32 logits agree to 1e-4.
BFLOAT16_BOUNDS = {"gemma3": 0.05, "gemma4": 0.05, "gemma4_moe": 0.07, "gemma4_ple": 0.25}


@pytest.mark.parametrize("layout,round_projections", [(layout, False) for layout in WEIGHT_LAYOUTS]
                         + [("xla", True)], ids=[*WEIGHT_LAYOUTS, "xla-rounded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_weights_and_cache_give_logits_within_bfloat16_precision(tiny_checkpoints, family,
                                                                         layout, round_projections):
    """Mixed precision: bfloat16 weights, KV cache and matmul inputs, float32 everything else;
    and, as on GPU (`round_projections`), the projections' outputs rounded to bfloat16 as
    PyTorch's bfloat16 linear layers give them, within the same bound."""
    directory, hf_model = tiny_checkpoints[family]
    loaded = load_model(directory, dtype="bfloat16", skip_tokenizer_init=True, progress=False)
    assert loaded.model.layers[0].attn.qkv.get_value().dtype == np.dtype("bfloat16")
    _lay_out(loaded, layout)
    if layout == "packed":  # k-pairs (VDPBF16PS, x rounded to bfloat16) where the CPU has them
        from xlaserve.native import gemm_cpu
        assert loaded.model.layers[0].attn.qkv.get_value().bf16_pairs == gemm_cpu.bf16_pairs_supported()
    references = [_hf_reference(hf_model, p) for p in PROMPTS]
    sequences = [(full, len(p)) for p, (full, _) in zip(PROMPTS, references, strict=True)]
    ours = _run_ours(loaded, sequences, prefill_chunk=3, page_size=4,
                     round_projections=round_projections)
    checked = 0
    for (full, expected), got in zip(references, ours, strict=True):
        rows = _decisive_routing_rows(hf_model, full)
        checked += rows.sum()
        bound = BFLOAT16_BOUNDS.get(family, 0.02) * np.abs(expected).max()
        np.testing.assert_allclose(got[rows], expected[rows], atol=bound, rtol=0)
        top2 = np.sort(expected, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * bound  # no near-tie: the argmax must agree
        assert (got.argmax(-1) == expected.argmax(-1))[clear & rows].all()
    assert checked >= sum(len(full) for full, _ in references) // 2


# The smallest gap between the router's k-th and (k+1)-th logit for which bfloat16 must pick the
# same experts as float32: the tiny models' router logits are ~N(0, 4^2) (tests/tiny_models.py),
# and rounding the router's inputs and weights to bfloat16 moves them by a few hundredths.
ROUTING_MARGIN = 0.1


def _decisive_routing_rows(hf_model, ids) -> np.ndarray:
    """bool per position: True for a dense model; for a mixture of experts, True up to the first
    position where some layer's router has a near-tie between its k-th and (k+1)-th expert. There
    bfloat16 may pick the other expert, as any bfloat16 implementation may, and through attention
    that changes every later position."""
    config = hf_model.config
    # Gemma 4 records its routers' probabilities: their logs differ as the logits do.
    k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k_experts", None)
    if not k:
        return np.ones(len(ids), bool)
    with torch.no_grad():
        router_logits = hf_model(torch.tensor([ids]), output_router_logits=True).router_logits
    margins = []
    for logits in router_logits:
        logits = logits.float().numpy()
        if getattr(config, "top_k_experts", None):
            logits = np.log(logits)
        ranked = np.sort(logits, axis=-1)[:, ::-1]
        margins.append(ranked[:, k - 1] - ranked[:, k])
    decisive = np.min(margins, axis=0) > ROUTING_MARGIN
    return np.cumprod(decisive).astype(bool)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rope_computed_on_the_host_equals_the_traced_rope(tiny_checkpoints, family):
    """The serving step takes RoPE's cos/sin from the host (`rope_cos_sin`, so that XLA does not
    recompute them in every layer); they must be what `hidden_states` computes when not given."""
    import jax
    import jax.numpy as jnp

    from xlaserve.model.rope import rope_cos_sin

    directory, _ = tiny_checkpoints[family]
    config = load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False).config
    positions = np.array([0, 1, 2, 17, 255, 4096, 32767, 131071], np.int32)
    inv_freq = config.rope_inv_freq()  # every table's (Gemma 3's two side by side)
    traced = jax.jit(lambda p: (jnp.cos(p.astype(jnp.float32)[:, None] * inv_freq[None, :]),
                                jnp.sin(p.astype(jnp.float32)[:, None] * inv_freq[None, :])))
    for host, device in zip(rope_cos_sin(inv_freq, positions), traced(positions), strict=True):
        assert host.dtype == np.float32 and host.shape == (len(positions), len(inv_freq))
        np.testing.assert_allclose(host, np.asarray(device), rtol=0, atol=2e-6)
