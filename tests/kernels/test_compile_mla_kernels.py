"""The Pallas latent-attention kernels (DeepSeek-V3's MLA, `mla_ragged_paged_attention`) compiled
for their real targets without the hardware: Mosaic for TPU v5e and v6e, Triton for an H100 (see
test_compile_kernels.py for how). Shapes: V3's 576-wide latent rows (512 latent + 64 RoPE'd),
its 128 query heads split by tensor parallelism, a decode, a mixed and a prefill bucket at 64
sequences, in the runtime's cache layout (transformer.kv_cache_shape: [pages, page_size, 576],
on TPU [pages, page_size, 640]) updated in place."""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from tests.compile_targets import cache_copies, compile_for, devices
from tests.kernels.test_compile_kernels import (BATCHES, CACHE_BYTES, CONTEXT, cache_scatters,
                                                one_device_mesh)
from xlaserve.runtime.executor import aot
from xlaserve.pallas_kernels.ragged_paged_attention import kernel_gpu, kernel_tpu, new_tokens

LATENT, ROPE = 512, 64  # DeepSeek-V3's kv_lora_rank and qk_rope_head_dim
V3_HEADS = {"tp8": 16, "tp4": 32, "tp1": 128}
KERNELS = {"tpu": kernel_tpu.mla_ragged_paged_attention,
           "gpu": kernel_gpu.mla_ragged_paged_attention}
TARGETS = ("v6e:2x2", "v5e:2x2", "h100")
CASES = [("tp8", "decode", "bfloat16"), ("tp8", "mixed", "bfloat16"),
         ("tp8", "prefill", "bfloat16"), ("tp1", "decode", "bfloat16"),
         ("tp4", "prefill", "bfloat16"), ("tp8", "mixed", "float32")]
# Without --slow (a compile takes 1-26 s here): a decode on every target, the tp 1 decode
# (128 heads; on the H100, 4 KV splits of 8 programs an item) and a tp 4 prefill on v6e and H100.
DEFAULT = {(t, "tp8", "decode", "bfloat16") for t in TARGETS} | {
    (t, layout, batch, "bfloat16") for t in ("v6e:2x2", "h100")
    for layout, batch in (("tp1", "decode"), ("tp4", "prefill"))}


def pytest_generate_tests(metafunc):
    if "mla_case" in metafunc.fixturenames:
        slow = metafunc.config.getoption("--slow")
        chosen = [(t, *c) for t in TARGETS for c in CASES if slow or (t, *c) in DEFAULT]
        metafunc.parametrize("mla_case", chosen, ids=["-".join(c) for c in chosen])


def mla_args(mesh, heads, batch, page_size=16, dtype="bfloat16", cache_row=None):
    tokens, seqs = BATCHES[batch]
    row = LATENT + ROPE
    platform = mesh.devices.flat[0].platform
    cache_row = cache_row or (640 if platform == "tpu" else row)
    pages_per_seq = CONTEXT // page_size
    num_pages = max(seqs * pages_per_seq + 1,
                    CACHE_BYTES // (page_size * cache_row * jnp.dtype(dtype).itemsize))
    at = lambda shape, dt=dtype: aot.abstract(shape, jnp.dtype(dt), mesh, P())
    return dict(q=at((tokens, heads, row)), latent=at((tokens, row)),
                kv_cache=at((num_pages, page_size, cache_row)), kv_lens=at((seqs,), "int32"),
                page_indices=at((seqs, pages_per_seq), "int32"),
                cu_q_lens=at((seqs + 1,), "int32"), num_seqs=at((1,), "int32"))


def test_latent_attention_kernel_compiles_at_deepseek_v3_shapes(mla_case):
    target, layout, batch, dtype = mla_case
    platform, target_devices = devices(target)
    mesh = one_device_mesh(target_devices)
    args = mla_args(mesh, V3_HEADS[layout], batch, dtype=dtype)
    kernel = jax.jit(KERNELS[platform], static_argnames=("sm_scale", "value_dim"),
                     donate_argnames=("kv_cache",))
    compiled = compile_for(mesh, kernel, **args, sm_scale=0.1, value_dim=LATENT)
    hlo = compiled.as_text()
    cache = args["kv_cache"]
    assert not cache_copies(hlo, cache.shape, cache.dtype), "the latent cache is copied"
    assert "input_output_alias" in hlo.splitlines()[0], "the cache is not updated in place"
    if platform == "tpu" or batch == "decode":  # the kernel writes the new rows itself (GPU:
        # one-token items)
        assert not cache_scatters(hlo, cache.shape, cache.dtype), "the new rows are scattered"
    # No temporary of the cache's size (the GPU's split-KV partials of 128 heads are 67 MB).
    assert compiled.memory_analysis().temp_size_in_bytes < CACHE_BYTES // 2


def test_an_unpadded_latent_cache_would_be_copied_on_tpu():
    # Why a TPU cache pads V3's 576-wide rows to 640 lanes: TPU's default layout for a
    # [pages, 16, 576] array tiles the pages dim instead (no lane padding), and the kernel's
    # row-major view of it is a copy of the whole cache, every layer and step.
    _, target_devices = devices("v6e:2x2")
    mesh = one_device_mesh(target_devices)
    args = mla_args(mesh, 16, "decode", cache_row=LATENT + ROPE)
    kernel = jax.jit(kernel_tpu.mla_ragged_paged_attention,
                     static_argnames=("sm_scale", "value_dim"), donate_argnames=("kv_cache",))
    hlo = compile_for(mesh, kernel, **args, sm_scale=0.1, value_dim=LATENT).as_text()
    cache = args["kv_cache"]
    assert cache_copies(hlo, cache.shape, cache.dtype)


EXPANDED_PARTS = {  # (the latent kernel, the new tokens' attention)
    "gpu": (kernel_gpu.mla_ragged_paged_attention, new_tokens.gpu_new_token_attention),
    "tpu": (kernel_tpu.mla_ragged_paged_attention, new_tokens.tpu_new_token_attention)}


@pytest.mark.parametrize("target,batch", [("h100", "mixed"), ("h100", "prefill"),
                                          ("v6e:2x2", "prefill"), ("v5e:2x2", "prefill")])
def test_the_expanded_forms_parts_compile_at_deepseek_v3_shapes(target, batch):
    """The expanded form's two kernels (api.get_expanded_prefill_fns) compiled at V3's tp 8
    shapes: the latent kernel with prefix_only (out and log-sum-exp, the cache updated in place)
    and the flash attention of the new tokens (Pallas Triton on the H100, splash on TPU), keys
    nope + rope = 192 wide, values 128."""
    platform, target_devices = devices(target)
    mesh = one_device_mesh(target_devices)
    prefix_kernel, new_kernel = EXPANDED_PARTS[platform]
    args = mla_args(mesh, V3_HEADS["tp8"], batch)
    prefix = jax.jit(functools.partial(prefix_kernel, prefix_only=True),
                     static_argnames=("sm_scale", "value_dim"), donate_argnames=("kv_cache",))
    compiled = compile_for(mesh, prefix, **args, sm_scale=0.1, value_dim=LATENT)
    hlo = compiled.as_text()
    assert "input_output_alias" in hlo.splitlines()[0], "the cache is not updated in place"
    assert not cache_copies(hlo, args["kv_cache"].shape, args["kv_cache"].dtype)
    out, lse, _ = compiled.out_info
    tokens, heads = args["q"].shape[:2]
    assert out.shape == (tokens, heads, LATENT) and lse.shape == (tokens, heads)
    assert lse.dtype == jnp.float32

    at = lambda shape, dt="bfloat16": aot.abstract(shape, jnp.dtype(dt), mesh, P())
    new = jax.jit(new_kernel, static_argnames=("sm_scale",))
    compiled = compile_for(mesh, new, at((tokens, heads, 192)), at((tokens, heads, 192)),
                           at((tokens, heads, 128)), args["cu_q_lens"], args["num_seqs"],
                           sm_scale=0.1)
    out, lse = compiled.out_info
    assert out.shape == (tokens, heads, 128) and lse.shape == (tokens, heads)
