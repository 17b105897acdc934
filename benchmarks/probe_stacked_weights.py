"""Do the layers' weights cost more as one stacked argument than as one argument each?

A chain of `--layers` matmuls of bfloat16 [hidden, hidden] weights over an 8-row activation is
compiled for a compile-only target (runtime/executor/aot.py) twice: each layer's weight an argument of
its own (as the serving step takes Llama-3.1-8B's 131 weights on TPU and GPU today), and all
layers' weights one [layers, hidden, hidden] argument that the program slices statically (as
runtime/executor/weight_args.py stacks small leaves). Printed: XLA's bytes accessed per device (predict_accelerators'
`xla_costs`), the whole-array copies in the optimised HLO, and the temporary memory, for each.
With `--tp-size` the weights' output columns are split over that many devices.

    python benchmarks/probe_stacked_weights.py --target h100
    python benchmarks/probe_stacked_weights.py --target v6e:2x2 [--tp-size 4]

Each argument of a jitted call costs host time on every call (benchmarks/bench_host_step.py:
~0.3 ms for the step's ~171), so if stacking costs the device nothing, the step could take a
handful of weight arguments on accelerators too.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from xlaserve.runtime.executor import aot  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="h100", help="h100, v6e:2x2, v5e:2x2 ...")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tp-size", type=int, default=1,
                        help="devices the weights' output columns are split over")
    args = parser.parse_args(argv)
    aot.use_compile_only_packages()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.predict_accelerators import xla_costs

    _, devices = aot.target_devices(args.target)
    mesh = Mesh(np.array(devices[:args.tp_size]), ("x",))
    replicated = NamedSharding(mesh, P())
    by_column, stack_by_column = NamedSharding(mesh, P(None, "x")), NamedSharding(mesh, P(None, None, "x"))
    layers, hidden = args.layers, args.hidden

    def separate(weights, x):
        for w in weights:
            x = jax.lax.with_sharding_constraint(jnp.tanh(x @ w), replicated)
        return x

    def stacked(weights, x):
        for i in range(layers):
            x = jax.lax.with_sharding_constraint(jnp.tanh(x @ weights[i]), replicated)
        return x

    x = jax.ShapeDtypeStruct((8, hidden), jnp.bfloat16, sharding=replicated)
    one = jax.ShapeDtypeStruct((hidden, hidden), jnp.bfloat16, sharding=by_column)
    stack = jax.ShapeDtypeStruct((layers, hidden, hidden), jnp.bfloat16, sharding=stack_by_column)
    weight_gb = layers * hidden * hidden * 2 / 1e9 / args.tp_size
    print(f"{args.target}, tp {args.tp_size}: {layers} weights of bf16[{hidden},{hidden}], "
          f"{weight_gb:.3f} GB per device")
    for name, fn, weights in (("one argument each", separate, [one] * layers),
                              ("one stacked argument", stacked, stack)):
        with jax.set_mesh(mesh):
            compiled = jax.jit(fn).trace(weights, x).lower().compile()
        hlo = compiled.as_text()
        print(f"  {name:22s} GB accessed {xla_costs(compiled)['bytes'] / 1e9:.3f}, "
              f"copies {hlo.count(' copy(')}, "
              f"temp {compiled.memory_analysis().temp_size_in_bytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
