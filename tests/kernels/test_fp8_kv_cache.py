"""Every attention kernel over an FP8 KV cache (model/fp8_kv_cache.py): the reference widens the
cache's rows to q's dtype for its dots, and the CPU kernel (C++: its own FP8 decoding), the Pallas
TPU and GPU kernels (interpret mode here) and the latent (MLA) kernels give what the reference
gives; the Pallas kernels compile for v5e, v6e and an H100 with an FP8 cache. The cases are the
NaN-poisoned ones of test_reference_attention, with q, k, v and the cache rounded to FP8 (k, v
and the cache) as the model stores them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from tests.compile_targets import cache_copies, compile_for, devices
from tests.kernels.test_compile_kernels import check_compiles_in_place, one_device_mesh
from tests.kernels.test_compile_mla_kernels import KERNELS as MLA_KERNELS
from tests.kernels.test_compile_mla_kernels import LATENT, mla_args
from tests.kernels.test_reference_attention import BATCHES, SM_SCALE
from xlaserve.model.fp8_kv_cache import is_fp8, quantize, resolve_kv_cache_dtype
from xlaserve.pallas_kernels.ragged_paged_attention import (cases, kernel_cpu, kernel_gpu,
                                                         kernel_tpu, reference)

FP8 = [pytest.param(jnp.float8_e4m3fn, id="e4m3"), pytest.param(jnp.float8_e5m2, id="e5m2")]
as_f32 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32))  # noqa: E731


def fp8_case(fp8, seqs, *, dtype=np.float32, seed=0, latent=False, **shapes):
    """A kernel case whose new rows and cache are FP8 (NaN stays NaN: the poison)."""
    rng = np.random.default_rng(seed)
    if latent:
        case = cases.make_mla_case(rng, seqs, num_q_heads=4, row_dim=48, dtype=dtype, **shapes)
    else:
        case = cases.make_case(rng, seqs, num_q_heads=8, num_kv_heads=2, head_dim=shapes.pop(
            "head_dim", 64), dtype=dtype, **shapes)
    args = {name: jnp.asarray(value) for name, value in case.items()}
    for name in ("k", "v", "latent", "kv_cache"):
        if name in args:
            args[name] = args[name].astype(jnp.float32).astype(fp8)
    return args


def run(fn, args, **static):
    return jax.jit(fn, static_argnames=tuple(static))(**args, **static)


def live_rows(args):
    return int(args["cu_q_lens"][int(args["num_seqs"][0])])


def test_quantize_clips_to_the_formats_finite_range_and_divides_by_the_scale():
    x = jnp.array([0.0, 1.0, -3.0, 1000.0, -1e6, 0.01], jnp.float32)
    e4m3 = quantize(x, 1.0, jnp.float8_e4m3fn)
    assert e4m3.dtype == jnp.float8_e4m3fn and np.isfinite(as_f32(e4m3)).all()
    np.testing.assert_array_equal(as_f32(e4m3)[:5], [0, 1, -3, 448, -448])  # not NaN past 448
    np.testing.assert_array_equal(as_f32(quantize(x, 1.0, jnp.float8_e5m2))[3:5], [1024, -57344])
    np.testing.assert_array_equal(as_f32(quantize(x, 4.0, jnp.float8_e4m3fn))[:4],
                                  [0, 0.25, -0.75, 256])  # x / 4; 250 rounds to 256 (step 16)
    assert resolve_kv_cache_dtype("fp8", jnp.bfloat16) == jnp.float8_e4m3fn  # vLLM's name for e4m3
    assert resolve_kv_cache_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert is_fp8(jnp.float8_e5m2) and not is_fp8(jnp.bfloat16)


@pytest.mark.parametrize("fp8", FP8)
def test_the_reference_on_an_fp8_cache_is_attention_over_its_values(fp8):
    # The same attention as over a float32 cache holding the FP8 values: widening is all it adds.
    shapes, seqs = BATCHES["mixed"]
    args = fp8_case(fp8, seqs, **shapes)
    out, cache = run(reference.ragged_paged_attention, args, sm_scale=SM_SCALE)
    assert cache.dtype == fp8 and out.dtype == jnp.float32
    widened = {name: value.astype(jnp.float32) if name in ("k", "v", "kv_cache") else value
               for name, value in args.items()}
    want_out, want_cache = run(reference.ragged_paged_attention, widened, sm_scale=SM_SCALE)
    np.testing.assert_allclose(as_f32(out), as_f32(want_out), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(as_f32(cache), as_f32(want_cache))  # NaN where NaN


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype,head_dim", [(np.float32, 64), (jnp.bfloat16, 64),
                                            (np.float32, 40), (jnp.bfloat16, 40)],
                         ids=["f32-one_row_items", "bf16-one_row_items", "f32-blocks",
                              "bf16-blocks"])
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_the_cpu_kernel_decodes_fp8_as_the_reference_does(fp8, dtype, head_dim, batch):
    # One-row items (head dims a multiple of 8) and blocks of rows (40): both read FP8 rows
    # through the same widening; a bfloat16 q never takes the bfloat16 pairs path over FP8.
    shapes, seqs = BATCHES[batch]
    args = fp8_case(fp8, seqs, dtype=dtype, head_dim=head_dim, **shapes)
    out, cache = run(kernel_cpu.ragged_paged_attention, args, sm_scale=SM_SCALE,
                     sliding_window=None if batch == "decode" else 7)
    want_out, want_cache = run(reference.ragged_paged_attention, args, sm_scale=SM_SCALE,
                               sliding_window=None if batch == "decode" else 7)
    assert out.dtype == dtype and cache.dtype == fp8
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(as_f32(out), as_f32(want_out), rtol=tol, atol=tol)
    np.testing.assert_array_equal(as_f32(cache), as_f32(want_cache))  # NaN where NaN


@pytest.mark.parametrize("fp8", FP8)
def test_every_fp8_value_decodes_in_the_cpu_kernel_as_in_jax(fp8):
    # 256 one-token sequences, each attending its own key alone: its output is its V row as the
    # kernel decodes it from the cache. Row t holds byte t (NaN and infinity bytes, never
    # stored, hold 0), subnormals and the largest values included.
    values = jnp.asarray(np.arange(256, dtype=np.uint8)).view(fp8)
    values = jnp.where(jnp.isfinite(values.astype(jnp.float32)), values, jnp.zeros_like(values))
    n, head_dim = 256, 8
    v = jnp.broadcast_to(values[:, None, None], (n, 1, head_dim))
    args = dict(q=jnp.zeros((n, 1, head_dim), jnp.float32), k=jnp.zeros((n, 1, head_dim), fp8),
                v=v, kv_cache=jnp.zeros((n, 16, 2 * head_dim), fp8),
                kv_lens=jnp.ones(n, jnp.int32), page_indices=jnp.arange(n, dtype=jnp.int32)[:, None],
                cu_q_lens=jnp.arange(n + 1, dtype=jnp.int32), num_seqs=jnp.array([n], jnp.int32))
    out, _ = run(kernel_cpu.ragged_paged_attention, args, sm_scale=1.0)
    np.testing.assert_array_equal(as_f32(out)[:, 0, 0], as_f32(values))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_the_cpu_latent_kernel_on_an_fp8_cache(fp8, dtype):
    shapes, seqs = BATCHES["mixed"]
    args = fp8_case(fp8, seqs, dtype=dtype, latent=True, **shapes)
    options = dict(sm_scale=48 ** -0.5, value_dim=32)
    out, cache = run(kernel_cpu.mla_ragged_paged_attention, args, **options)
    want_out, want_cache = run(reference.mla_ragged_paged_attention, args, **options)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(as_f32(out), as_f32(want_out), rtol=tol, atol=tol)
    np.testing.assert_array_equal(as_f32(cache), as_f32(want_cache))


def test_the_cpu_kernel_refuses_bfloat16_pairs_over_an_fp8_cache():
    shapes, seqs = BATCHES["decode"]
    args = fp8_case(jnp.float8_e4m3fn, seqs, dtype=jnp.bfloat16, **shapes)
    with pytest.raises(ValueError, match="bfloat16 cache"):
        run(kernel_cpu.ragged_paged_attention, args, sm_scale=SM_SCALE, bf16_pairs=True)


@pytest.mark.parametrize("name", ["tpu", "gpu"])
def test_the_pallas_kernels_on_an_fp8_cache_in_interpret_mode(name):
    # bfloat16 q over an e4m3 cache, decodes beside prefills; TPU pages of 32 rows (an FP8
    # sublane tile: tpu_shape_checks).
    shapes, seqs = BATCHES["mixed"]
    args = fp8_case(jnp.float8_e4m3fn, seqs, dtype=jnp.bfloat16, **{**shapes, "page_size": 32})
    kernel, interpret = {"tpu": (kernel_tpu.ragged_paged_attention, pltpu.InterpretParams()),
                         "gpu": (kernel_gpu.ragged_paged_attention, True)}[name]
    try:
        out, cache = run(kernel, args, sm_scale=SM_SCALE, interpret=interpret)
        jax.block_until_ready((out, cache))
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    want_out, want_cache = run(reference.ragged_paged_attention, args, sm_scale=SM_SCALE)
    assert cache.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(as_f32(cache), as_f32(want_cache))
    np.testing.assert_allclose(as_f32(out), as_f32(want_out), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("target,fp8,batch", [
    ("v6e:2x2", "float8_e4m3fn", "decode"),
    ("v6e:2x2", "float8_e4m3fn", "prefill"),
    ("v5e:2x2", "float8_e4m3fn", "mixed"),
    ("v6e:2x2", "float8_e5m2", "mixed"),
    ("h100", "float8_e4m3fn", "decode"),
    ("h100", "float8_e4m3fn", "prefill"),
    ("h100", "float8_e5m2", "mixed")])
def test_the_pallas_kernels_compile_over_an_fp8_cache(target, fp8, batch):
    # Llama-3.1-8B at tp 4, bfloat16 queries, pages of 32 tokens, the cache updated in place.
    check_compiles_in_place(target, ("llama-3.1-8b-tp4", batch, 32, "bfloat16"), kv_dtype=fp8)


def test_the_tpu_kernel_refuses_pages_smaller_than_an_fp8_sublane_tile():
    with pytest.raises(ValueError, match="multiple of 32 for float8_e4m3fn"):
        kernel_tpu.check_shapes(16, jnp.float8_e4m3fn, 8, 8)


@pytest.mark.parametrize("name", ["tpu", "gpu"])
def test_the_pallas_latent_kernels_on_an_fp8_cache_in_interpret_mode(name):
    shapes, seqs = BATCHES["mixed"]
    args = fp8_case(jnp.float8_e4m3fn, seqs, dtype=jnp.bfloat16, latent=True,
                    **{**shapes, "page_size": 32})
    if name == "tpu":  # the TPU cache's rows are whole lanes (transformer.kv_cache_shape)
        args["kv_cache"] = jnp.pad(args["kv_cache"], ((0, 0), (0, 0), (0, 128 - 48)))
    kernel, interpret = {"tpu": (kernel_tpu.mla_ragged_paged_attention, pltpu.InterpretParams()),
                         "gpu": (kernel_gpu.mla_ragged_paged_attention, True)}[name]
    options = dict(sm_scale=48 ** -0.5, value_dim=32)
    try:
        out, cache = run(kernel, args, interpret=interpret, **options)
        jax.block_until_ready((out, cache))
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    want_out, want_cache = run(reference.mla_ragged_paged_attention, args, **options)
    np.testing.assert_array_equal(as_f32(cache), as_f32(want_cache))
    np.testing.assert_allclose(as_f32(out), as_f32(want_out), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("target", ["v6e:2x2", "h100"])
def test_the_pallas_latent_kernels_compile_over_an_fp8_cache(target):
    # DeepSeek-V3's 576-wide latent rows at tp 8 (16 heads a device), a decode bucket.
    platform, target_devices = devices(target)
    mesh = one_device_mesh(target_devices)
    args = mla_args(mesh, 16, "decode", page_size=32)
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    args["latent"] = jax.ShapeDtypeStruct(args["latent"].shape, fp8,
                                          sharding=args["latent"].sharding)
    args["kv_cache"] = jax.ShapeDtypeStruct(args["kv_cache"].shape, fp8,
                                            sharding=args["kv_cache"].sharding)
    kernel = jax.jit(MLA_KERNELS[platform], static_argnames=("sm_scale", "value_dim"),
                     donate_argnames=("kv_cache",))
    hlo = compile_for(mesh, kernel, **args, sm_scale=0.1, value_dim=LATENT).as_text()
    assert not cache_copies(hlo, args["kv_cache"].shape, fp8), "the latent cache is copied"
    assert "input_output_alias" in hlo.splitlines()[0]
