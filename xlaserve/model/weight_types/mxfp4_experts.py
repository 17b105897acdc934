"""A mixture of experts' weight kept in MXFP4, as gpt-oss's checkpoint stores it
(weights/formats/mxfp4.py): four bits a weight and one E8M0 scale a group of 32 input features,
multiplied on GPU by pallas_kernels/grouped_matmul_mxfp4.py, which decodes them in registers.

    experts_gate_up: blocks uint8 [E, 2, I, K/32, 16], scales uint8 [E, 2, I, K/32]
                     (gate's output features, then up's: our gate_up [E, K, 2, I] layout)
    experts_down:    blocks uint8 [E, H, I/32, 16],    scales uint8 [E, H, I/32]

Output features lead, input features are packed last (the checkpoint's orientation; our float
layout is [E, K, N...]). Sharded as the float weights are (`partition_specs`): experts over
"expert", the intermediate axis over "tensor" (gate_up's I; down's I/32 groups).

Made by `--quantization mxfp4` from a gpt-oss checkpoint (weights/kept_quantized/mxfp4_kept.py) or
as dummy weights, on NVIDIA GPU meshes (int8.check_platform) whose devices each hold whole
64-feature K steps of both experts (`mxfp4_mesh_problem`); model/moe.py multiplies it where a model
holds one.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.model.weight_types.whole_weight import ReadWhole

GROUP = 32  # input features sharing one scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Mxfp4Experts(ReadWhole):
    blocks: jax.Array  # uint8 [E, N..., K/32, 16]: two e2m1 codes a byte, the low nibble first
    scales: jax.Array  # uint8 [E, N..., K/32]: 2**(byte - 127) each

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape in the float layout: [E, K, N...]."""
        experts, *outputs, groups = self.scales.shape
        return (experts, groups * GROUP, *outputs)

    @property
    def dtype(self):
        """What x goes into the dot in: the codes are decoded to bfloat16."""
        return jnp.dtype(jnp.bfloat16)

    def flat(self) -> tuple[jax.Array, jax.Array]:
        """(blocks [E, N, K/32, 16], scales [E, N, K/32]) with the output axes merged: the
        kernel's operands (gate_up's N is gate's I features, then up's)."""
        experts, *_, groups, half = self.blocks.shape
        return (self.blocks.reshape(experts, -1, groups, half),
                self.scales.reshape(experts, -1, groups))


def partition_specs(name: str) -> Mxfp4Experts:
    """The PartitionSpecs of an MXFP4 `experts_gate_up` or `experts_down` (as the float weight's
    in model/sharding.py: experts over "expert", the intermediate axis over "tensor")."""
    if name == "experts_gate_up":
        return Mxfp4Experts(P("expert", None, "tensor", None, None), P("expert", None, "tensor"))
    if name == "experts_down":
        return Mxfp4Experts(P("expert", None, "tensor", None), P("expert", None, "tensor"))
    raise ValueError(f"{name} is not an expert weight MXFP4 can hold")


# The parameters `--quantization mxfp4` keeps in MXFP4: a gpt-oss layer's experts.
MXFP4_KEPT = ("experts_gate_up", "experts_down")


def abstract_mxfp4(name: str, weight: jax.ShapeDtypeStruct) -> Mxfp4Experts:
    """The Mxfp4Experts of ShapeDtypeStructs (uint8, sharded by `partition_specs`) that the float
    expert weight `name` [E, K, 2, I] or [E, I, H] (`weight`, with its sharding) is kept as."""
    if name == "experts_gate_up":
        experts, k, _, inter = weight.shape
        outputs = (2, inter)
    else:
        experts, k, hidden = weight.shape
        outputs = (hidden,)
    if k % GROUP:
        raise ValueError(f"{name}: {k} input features is not a multiple of the MXFP4 group of "
                         f"{GROUP}")
    specs = partition_specs(name)
    mesh = weight.sharding.mesh
    return Mxfp4Experts(
        jax.ShapeDtypeStruct((experts, *outputs, k // GROUP, GROUP // 2), jnp.uint8,
                             sharding=NamedSharding(mesh, specs.blocks)),
        jax.ShapeDtypeStruct((experts, *outputs, k // GROUP), jnp.uint8,
                             sharding=NamedSharding(mesh, specs.scales)))


def mxfp4_mesh_problem(hidden: int, inter: int, mesh) -> str | None:
    """Why `mesh` cannot multiply MXFP4 experts of `hidden` x `inter` features (None: it can):
    each device's share of both projections must be whole K steps of the kernel (gpt-oss's inter
    2880 leaves that at tensor parallel size 1 only: 1440 is not a multiple of 64; expert
    parallelism splits experts, not features). That the devices are NVIDIA GPUs is
    int8.check_platform's to say."""
    from xlaserve.pallas_kernels.grouped_matmul_mxfp4 import supports

    tp = dict(mesh.shape).get("tensor", 1)
    if inter % tp:
        return f"{inter} intermediate features do not split over tensor parallel size {tp}"
    for what, k, n in (("gate_up", hidden, 2 * inter // tp), ("down", inter // tp, hidden)):
        problem = supports(k, n)
        if problem is not None:
            return f"each device's {what} at tensor parallel size {tp}: {problem}"
    return None
