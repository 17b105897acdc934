"""The step's RoPE cos/sin come from a table by position (step_inputs.RopeTable): the values
rope_cos_sin computes for the same positions, as the table grows; multimodal RoPE's sections
over a partial RoPE's rotated pairs as transformers' Qwen3.5 recomposes them."""
import numpy as np

from xlaserve.runtime.executor.step_inputs import RopeTable
from xlaserve.model.rope import rope_cos_sin


def test_the_rope_table_gives_rope_cos_sin_values_as_it_grows():
    inv_freq = (1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)).astype(np.float32)
    table = RopeTable(inv_freq, attention_factor=1.25)
    rng = np.random.default_rng(0)
    for high in (8, 900, 5000, 70000):  # within the first rows, then past them each time
        positions = rng.integers(0, high, 300).astype(np.int32)
        for ours, expected in zip(table.cos_sin(positions),
                                  rope_cos_sin(inv_freq, positions, 1.25), strict=True):
            assert ours.dtype == np.float32 and ours.shape == (300, 64)
            np.testing.assert_array_equal(ours, expected)
    assert len(table._cos) < 2 * 70000


def test_multimodal_sections_of_a_partial_rope_give_transformers_qwen3_5_cos_sin():
    """Qwen3.5's interleaved sections [2, 1, 1] over the 4 pairs RoPE turns (a quarter of a
    32-wide head): those pairs' cos/sin are transformers' (Qwen3_5TextRotaryEmbedding, the rows
    reordered at load: rope_config.partial_rope_rows), the 12 past them turn not at all. Sections
    in turn (Qwen2-VL's form) cover the rotated pairs the same way."""
    import torch
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from xlaserve.model.config.rope_config import RopeConfig

    rope = RopeConfig(partial_rotary=0.25, mrope_section=(2, 1, 1), mrope_interleaved=True)
    positions = np.random.default_rng(0).integers(0, 500, (3, 20)).astype(np.int32)
    cos, sin = RopeTable(rope.inv_freq(32), 1.0, rope.mrope_section, True).cos_sin(positions)
    hf = Qwen3_5TextRotaryEmbedding(transformers.Qwen3_5TextConfig(
        head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]}))
    hf_cos, hf_sin = (t[0, :, :4].numpy() for t in hf(
        torch.zeros(1, dtype=torch.float32), torch.from_numpy(positions[:, None].astype(np.int64))))
    np.testing.assert_allclose(cos[:, :4], hf_cos, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sin[:, :4], hf_sin, rtol=1e-6, atol=1e-6)
    assert (cos[:, 4:] == 1).all() and (sin[:, 4:] == 0).all()
    cos, _ = RopeTable(rope.inv_freq(32), 1.0, (2, 1, 1)).cos_sin(positions)
    for pair, axis in enumerate((0, 0, 1, 2)):  # t, t, h, w; then t for the still pairs
        expected, _ = rope_cos_sin(rope.inv_freq(32), positions[axis], 1.0)
        np.testing.assert_array_equal(cos[:, pair], expected[:, pair])
    assert cos.shape == (20, 16) and (cos[:, 4:] == 1).all()
