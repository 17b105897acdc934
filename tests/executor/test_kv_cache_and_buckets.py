"""Page allocator, KV pool sizing and padding buckets."""
import logging

import jax.numpy as jnp
import pytest

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.config.rope_config import RopeConfig
from xlaserve.weights.loader import default_mesh
from xlaserve.runtime.executor.forward_batch import bucket_for
from xlaserve.runtime.executor.buckets import buckets_for_limits, pow2_buckets
from xlaserve.runtime.executor.kv_pool import bytes_per_token, init_kv_pool, num_pages_for, round_down_coarsely
from xlaserve.runtime.scheduler.page_allocator import NULL_PAGE, OutOfPagesError, PageAllocator, pages_for_tokens

CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64,
                     intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     rms_norm_eps=1e-6, rope=RopeConfig(), max_position_embeddings=256)


def test_allocator_never_hands_out_the_null_page_and_tracks_usage():
    allocator = PageAllocator(5)
    assert allocator.capacity == 4
    pages = allocator.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and NULL_PAGE not in pages
    assert allocator.num_free == 0 and allocator.usage() == 1.0
    assert not allocator.can_allocate(1)
    with pytest.raises(OutOfPagesError):
        allocator.allocate(1)
    allocator.free(pages[:2])
    assert allocator.num_free == 2 and allocator.usage() == 0.5
    assert sorted(allocator.allocate(2)) == sorted(pages[:2])


def test_allocator_rejects_double_free_and_foreign_pages():
    allocator = PageAllocator(4)
    pages = allocator.allocate(2)
    allocator.free(pages)
    with pytest.raises(ValueError, match="double free"):
        allocator.free(pages[:1])
    with pytest.raises(ValueError):
        allocator.free([NULL_PAGE])


def test_pool_size_from_max_total_tokens_rounds_up_to_pages_plus_null_page():
    assert pages_for_tokens(33, 16) == 3
    assert num_pages_for(CONFIG, jnp.float32, 16, max_total_tokens=100, mem_fraction_static=0.9) == 8


def test_pool_size_from_free_memory_respects_the_fraction():
    small = num_pages_for(CONFIG, jnp.float32, 16, max_total_tokens=None, mem_fraction_static=0.1)
    large = num_pages_for(CONFIG, jnp.float32, 16, max_total_tokens=None, mem_fraction_static=0.2)
    assert 1.7 < large / small < 2.3  # each rounded down by at most 1/8
    assert bytes_per_token(CONFIG, jnp.bfloat16, "cpu") == 2 * 2 * 2 * 16 * 2


def test_pool_size_from_memory_is_rounded_so_programs_keep_their_shape_across_starts():
    assert round_down_coarsely(1000) == 960 and round_down_coarsely(1023) == 960
    assert round_down_coarsely(1024) == 1024 and round_down_coarsely(5) == 5
    assert all(n * 7 // 8 <= round_down_coarsely(n) <= n for n in range(2, 5000))


def test_kv_pool_is_zeroed_per_layer_and_logged(caplog):
    with caplog.at_level(logging.INFO):
        pool = init_kv_pool(CONFIG, 6, 4, jnp.float32, default_mesh())
    assert len(pool) == 2 and pool[0].shape == (6, 4, 4 * 16) and float(abs(pool[1]).sum()) == 0
    assert "KV Cache is allocated. #tokens: 20, K size:" in caplog.text


def test_power_of_two_buckets_and_lookup():
    assert pow2_buckets(8, 100) == (8, 16, 32, 64, 100)  # the largest is the limit itself
    assert pow2_buckets(8, 64) == (8, 16, 32, 64)
    assert pow2_buckets(3, 4) == (4,)
    assert bucket_for(1, (8, 16)) == 8 and bucket_for(9, (8, 16)) == 16
    with pytest.raises(ValueError, match="over the largest bucket 16"):
        bucket_for(17, (8, 16))


def test_default_buckets_compile_one_program_per_token_bucket_and_page_width():
    buckets = buckets_for_limits(max_tokens_per_step=64, max_seqs=16, max_pages_per_seq=8,
                                 page_paddings=[8])
    assert buckets.step_shapes() == [(8, 8), (16, 16), (32, 16), (64, 16)]
    assert buckets.shape_for(num_tokens=37, num_seqs=5, pages_per_seq=3) == (64, 16, 8)
    assert buckets.shape_for(num_tokens=8, num_seqs=8, pages_per_seq=1) == (8, 8, 8)
    assert buckets.all_shapes() == [(8, 8, 8), (16, 16, 8), (32, 16, 8), (64, 16, 8)]
    with pytest.raises(ValueError, match="over the largest bucket"):
        buckets.shape_for(num_tokens=65, num_seqs=1, pages_per_seq=1)


def test_explicit_sequence_buckets_give_the_grid_without_more_seqs_than_tokens():
    buckets = buckets_for_limits(max_tokens_per_step=64, max_seqs=16, max_pages_per_seq=8,
                                 seq_paddings=[1, 4, 16])
    assert buckets.shape_for(num_tokens=37, num_seqs=3, pages_per_seq=3) == (64, 4, 4)
    shapes = buckets.all_shapes()
    assert (8, 16, 1) not in shapes  # more sequences than token slots can't happen
    assert (64, 16, 8) in shapes and (64, 1, 8) in shapes and len(shapes) == len(set(shapes))
    custom = buckets_for_limits(64, 16, 8, token_paddings=[48, 16, 16])
    assert custom.tokens == (16, 48)


def test_default_token_buckets_follow_what_cpu_matmuls_cost():
    import jax.numpy as jnp

    from xlaserve.runtime.executor.buckets import default_token_buckets

    assert default_token_buckets(576, jnp.float32, "cpu") == (1, 4, 8, 16, 32, 64, 128, 256, 512, 576)
    assert default_token_buckets(576, jnp.bfloat16, "cpu") == (2, 4, 8, 16, 32, 64, 128, 256, 512, 576)
    assert default_token_buckets(576, jnp.bfloat16, "tpu") == (8, 16, 32, 64, 128, 256, 512, 576)
    assert default_token_buckets(2, jnp.float32, "cpu") == (1, 2)  # the largest is always there
    assert default_token_buckets(16, jnp.bfloat16, "cpu", native_matmul=True) == (1, 2, 4, 8, 16)


def test_accelerator_decode_buckets_get_midpoints_where_padded_rows_cost():
    import jax.numpy as jnp

    from xlaserve.runtime.executor.buckets import default_seq_buckets, default_token_buckets

    # 256 running requests, 8192-token prompt pieces: 96 and 192 between the decode sizes (a
    # 129-row step runs as 192, not 256); none past the largest sequence bucket.
    tokens = default_token_buckets(8448, jnp.bfloat16, "gpu", max_seqs=256)
    assert tokens == (8, 16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096, 8192, 8448)
    seqs = default_seq_buckets(256, "gpu")
    assert seqs == (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256)
    assert default_seq_buckets(512, "tpu")[-3:] == (256, 384, 512)
    assert 384 in default_token_buckets(8704, jnp.bfloat16, "tpu", max_seqs=512)
    assert default_seq_buckets(100, "gpu")[-3:] == (64, 96, 100)  # a midpoint under the limit
    assert default_seq_buckets(256, "cpu") == (1, 2, 4, 8, 16, 32, 64, 128, 256)  # CPU unchanged
    buckets = buckets_for_limits(8448, 256, 8, token_paddings=tokens, page_paddings=[8],
                                 default_seqs=seqs)
    assert buckets.shape_for(num_tokens=129, num_seqs=129, pages_per_seq=1) == (192, 192, 8)
    assert buckets.shape_for(num_tokens=300, num_seqs=40, pages_per_seq=1) == (512, 256, 8)
    assert not buckets.grid  # the sequence bucket still follows the token bucket
