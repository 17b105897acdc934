"""The model over an FP8 KV cache (--kv-cache-dtype, model/fp8_kv_cache.py) against the same model
over a float32 cache, on tiny random checkpoints of every attention kind: GQA (Llama), q/k norms
(Qwen3), sinks and sliding windows (gpt-oss), the latent cache (DeepSeek-V2, absorbed and
expanded forms), Gemma 4's KV-shared layers (gemma4_ple) and Llama 4's chunked and NoPE layers
(llama4, within the common bounds). Ragged prefill chunks, then decodes, all through the platform's kernels.

What FP8 costs: e4m3 rounds each K and V entry to 3 mantissa bits (relative error up to 2^-4),
e5m2 to 2 bits (2^-3). On these models (logits of standard deviation 0.64-0.68) the measured
mean |logit difference| from the float32 cache was 0.004-0.013 (e4m3) and 0.006-0.026 (e5m2),
the largest 0.07-0.10 (e4m3) and 0.06-0.85 (e5m2: gpt-oss, whose sinks sharpen some heads'
softmax); the bounds are about twice those. A scale applied on write and not on read would move
every score by its factor or every output by its inverse (here k 0.3 and v 3): the mean
difference would be of the logits' own size, far outside the bounds."""
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file

from tests.greedy_driver import PagedBatch, make_forward
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.model.fp8_kv_cache import quantize, resolve_kv_cache_dtype
from xlaserve.runtime.executor.kv_pool import init_kv_pool
from xlaserve.weights.loader import load_model

PROMPTS = [[5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64], [1, 2],
           [400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413, 414, 415]]
DECODES = 6
# (mean, largest) |logit difference| from the float32 cache: see the docstring
BOUNDS = {"fp8_e4m3": (0.03, 0.2), "fp8_e5m2": (0.05, 1.5)}
# Gemma 4 (gemma4_ple: its value norms, KV-shared layers reading FP8 pages another layer wrote,
# per-layer embeddings): its softmax is unscaled over unit-RMS q and k, so a rounded key moves a
# score by up to head_dim times more than under 1/sqrt(head_dim). Measured (logit std 0.45):
# e4m3 mean 0.038, largest 0.34; e5m2 0.081 and 1.18; plain gemma4 (no sharing) e4m3 0.030 and
# 0.28, so the shared layers add nothing. Bounds about twice those; a scale misapplied would move
# the logits by their own size (0.45).
FAMILY_BOUNDS = {"gemma4_ple": {"fp8_e4m3": (0.08, 0.7), "fp8_e5m2": (0.16, 2.4)}}
FAMILIES = ["llama", "qwen3", "gpt_oss", "deepseek_v2", "gemma4_ple", "llama4"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for family in FAMILIES:
        paths[family] = str(tmp_path_factory.mktemp(family))
        make_tiny_checkpoint(paths[family], family)
    return paths


def run(loaded, kv_cache_dtype: str, page_size: int = 4, prefill_chunk: int = 5, **options):
    """Logits at every position of PROMPTS and DECODES greedy tokens after each (chunks of
    `prefill_chunk` for the prompts, beside the other sequences' decodes), and the KV caches."""
    rng = np.random.default_rng(0)
    sequences = [list(p) + rng.integers(0, 512, DECODES).tolist() for p in PROMPTS]
    longest = max(map(len, sequences))
    batch = PagedBatch(len(sequences), -(-longest // page_size), page_size)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, loaded.dtype)
    kv_caches = init_kv_pool(loaded.config, batch.num_pages, page_size, kv_dtype, loaded.mesh)
    forward = make_forward(loaded.model, **options)
    _, state = nnx.split(loaded.model)
    logits_of = [np.full((len(s), loaded.config.vocab_size), np.nan, np.float32)
                 for s in sequences]
    fed = [0] * len(sequences)
    while any(f < len(s) for f, s in zip(fed, sequences)):
        chunks = []
        for i, (sequence, prompt) in enumerate(zip(sequences, PROMPTS)):
            size = prefill_chunk if fed[i] < len(prompt) else 1
            chunks.append(sequence[fed[i]:fed[i] + size])
            fed[i] += len(chunks[-1])
        input_ids, positions, metadata, logits_indices, rows = batch.step_inputs(chunks, "all")
        logits, kv_caches = forward(state, input_ids, positions, kv_caches, metadata,
                                    logits_indices)
        for row, (seq, pos) in enumerate(rows):
            logits_of[seq][pos] = np.asarray(logits[row])
    return np.concatenate(logits_of), kv_caches


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_over_an_fp8_cache_stay_within_its_rounding(checkpoints, family, kv_cache_dtype):
    loaded = load_model(checkpoints[family], dtype="float32", skip_tokenizer_init=True,
                        progress=False)
    want, _ = run(loaded, "auto")
    got, caches = run(loaded, kv_cache_dtype)
    assert caches[0].dtype == resolve_kv_cache_dtype(kv_cache_dtype, "float32")
    check_within_bounds(got, want, kv_cache_dtype, FAMILY_BOUNDS.get(family, BOUNDS))
    assert np.abs(got - want).max() > 0  # the cache is FP8 indeed
    if family == "deepseek_v2":  # the expanded form: prefix from the cache, new rows fresh
        got, _ = run(loaded, kv_cache_dtype, mla_expanded_prefill_tokens=8)
        check_within_bounds(got, want, kv_cache_dtype)


def check_within_bounds(got, want, kv_cache_dtype, bounds=BOUNDS):
    diff = np.abs(got - want)
    mean, largest = bounds[kv_cache_dtype]
    assert diff.mean() < mean and diff.max() < largest, (diff.mean(), diff.max())


def with_kv_scales(directory: str, num_layers: int, k_scale: float, v_scale: float,
                   names=("self_attn.k_scale", "self_attn.v_scale")) -> str:
    """The checkpoint at `directory` with per-tensor KV scales in a second safetensors file."""
    save_file({f"model.layers.{i}.{name}": torch.tensor(scale)
               for i in range(num_layers) for name, scale in zip(names, (k_scale, v_scale))},
              f"{directory}/kv_scales.safetensors")
    return directory


@pytest.mark.parametrize("family,names", [
    ("llama", ("self_attn.k_scale", "self_attn.v_scale")),
    ("deepseek_v2", ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"))])
def test_the_checkpoints_kv_scales_divide_what_is_stored_and_multiply_what_is_read(
        tmp_path, family, names):
    directory = str(tmp_path)
    make_tiny_checkpoint(directory, family)
    plain = load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False)
    want, float_caches = run(plain, "auto")
    with_kv_scales(directory, plain.config.num_layers, 0.3, 3.0, names)
    loaded = load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False,
                        kv_cache_dtype="fp8_e4m3")
    k_scale, v_scale = loaded.config.kv_scales[0]
    assert loaded.config.kv_scales == ((k_scale, v_scale),) * plain.config.num_layers
    assert (k_scale, v_scale) == pytest.approx((0.3, 3.0))  # as stored: float32
    got, caches = run(loaded, "fp8_e4m3")
    check_within_bounds(got, want, "fp8_e4m3")
    # Layer 0's cache (its input is the embeddings, the same in both runs): K / k_scale and
    # V / v_scale rounded to e4m3 (the latent row / k_scale for DeepSeek's latent cache);
    # unwritten slots are 0 in both.
    stored, exact = np.asarray(caches[0]), np.asarray(float_caches[0])
    if family == "llama":
        heads = plain.config.num_kv_heads
        exact = exact.reshape(exact.shape[:2] + (heads, 2, -1))
        expected = np.stack([quantize(exact[..., 0, :], k_scale, stored.dtype),
                             quantize(exact[..., 1, :], v_scale, stored.dtype)], axis=-2)
        expected = np.asarray(expected).reshape(stored.shape)
    else:
        expected = np.asarray(quantize(exact, k_scale, stored.dtype))
    np.testing.assert_array_equal(stored.astype(np.float32), expected.astype(np.float32))


def test_a_cache_in_the_models_dtype_ignores_the_checkpoints_kv_scales(tmp_path):
    directory = str(tmp_path)
    make_tiny_checkpoint(directory, "llama")
    with_kv_scales(directory, 2, 0.5, 2.0)
    loaded = load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False)
    assert loaded.config.kv_scales is None
