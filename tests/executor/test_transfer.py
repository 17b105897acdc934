"""A step's host inputs concatenated into one int32 and one float32 vector, and split back
inside jit (runtime/executor/step_inputs.py)."""
import jax
import numpy as np

from xlaserve.runtime.executor.step_inputs import concat_leaves, split_leaves


def test_every_leaf_comes_back_with_its_dtype_shape_and_bits():
    tree = {
        "ids": np.arange(6, dtype=np.int32).reshape(2, 3),
        "seeds": np.array([0, 2**31, 2**32 - 1], np.uint32),  # past int32's range
        "live": np.array([True, False, True]),
        "temperature": np.array([0.0, 0.7, -1e30], np.float32),
        "num_seqs": np.array([5], np.int32),
        "empty": np.zeros((0, 4), np.float32),
    }
    ints, floats, layout = concat_leaves(tree)
    assert ints.dtype == np.int32 and floats.dtype == np.float32
    assert ints.size == 6 + 3 + 3 + 1 and floats.size == 3

    out = jax.jit(split_leaves, static_argnums=2)(ints, floats, layout)
    for name, expected in tree.items():
        got = np.asarray(out[name])
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        np.testing.assert_array_equal(got, expected)


def test_equal_shapes_give_equal_layouts_so_a_bucket_compiles_once():
    first = concat_leaves({"a": np.zeros(4, np.int32), "b": np.ones(2, np.float32)})[2]
    second = concat_leaves({"a": np.full(4, 7, np.int32), "b": np.zeros(2, np.float32)})[2]
    other = concat_leaves({"a": np.zeros(8, np.int32), "b": np.ones(2, np.float32)})[2]
    assert first == second and hash(first) == hash(second)
    assert first != other
