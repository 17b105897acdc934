"""The weights go into the jitted step as few arguments: shared arrays once, small leaves of one
shape stacked, and the step gets every leaf back as it was."""
import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.runtime.executor.weight_args import leaves_from_args, weight_args


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


def test_layer_weights_go_stacked_by_shape_and_sharding_and_come_back_whole():
    # TPU's stacking (`stack_layers`): big leaves of one shape, dtype and sharding become one
    # argument, stacked on a new leading axis and sharded below it as they were; a leaf that
    # appears twice (tied embeddings) goes once, unstacked; the stacked arrays are deleted.
    mesh = jax.make_mesh((1,), ("tensor",))
    by_column = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tensor"))
    layers = [jax.device_put(jnp.full((300, 300), float(i)), by_column) for i in range(3)]
    other = [jax.device_put(jnp.full((300, 200), float(i)), by_column) for i in range(2)]
    tied = jax.device_put(jnp.ones((300, 300)), by_column)
    leaves = [layers[0], other[0], tied, layers[1], other[1], layers[2], tied]
    expected = [np.asarray(leaf) for leaf in leaves]
    args, layout = weight_args(leaves, stack_small=False, stack_layers=True)
    assert sorted(a.shape for a in args) == [(2, 300, 200), (3, 300, 300), (300, 300)]
    stacked = next(a for a in args if a.shape == (3, 300, 300))
    assert stacked.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    assert all(leaf.is_deleted() for leaf in layers + other) and not tied.is_deleted()
    rebuilt = jax.jit(lambda args: leaves_from_args(args, layout))(args)
    for got, want in zip(rebuilt, expected, strict=True):
        np.testing.assert_array_equal(got, want)
