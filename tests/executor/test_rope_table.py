"""The step's RoPE cos/sin come from a table by position (step_inputs.RopeTable): the values
rope_cos_sin computes for the same positions, as the table grows."""
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
