"""The weights go into the jitted step as few arguments: shared arrays once, small leaves of one
shape stacked, and the step gets every leaf back as it was."""
import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.executor.weight_args import leaves_from_args, weight_args


def test_shared_arrays_go_once_and_small_leaves_of_one_shape_go_stacked():
    big = jnp.ones((300, 300))  # over SMALL_LEAF_BYTES: never stacked
    other_big = jnp.zeros((300, 300))
    scales = [jnp.full((8,), float(i)) for i in range(4)]
    lone = jnp.arange(5, dtype=jnp.int32)
    leaves = [big, scales[0], big, scales[1], other_big, scales[2], lone, scales[3], big]
    args, layout = weight_args(leaves, stack_small=True)
    assert len(args) == 4  # big, other_big, the 4 scales stacked, lone
    rebuilt = jax.jit(lambda args: leaves_from_args(args, layout))(args)
    for got, want in zip(rebuilt, leaves, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_without_stacking_only_shared_arrays_are_merged():
    scales = [jnp.full((8,), float(i)) for i in range(3)]
    args, layout = weight_args([scales[0], scales[1], scales[0], scales[2]], stack_small=False)
    assert len(args) == 3
    assert [np.asarray(x)[0] for x in leaves_from_args(args, layout)] == [0.0, 1.0, 0.0, 2.0]
