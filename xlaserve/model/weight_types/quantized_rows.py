"""Matmul weights kept quantized in rows of blocks, multiplied by the CPU's native quantized GEMM
(native/quantized_gemm_cpu.py): GGUF's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K as the file stores them
(weights/kept_quantized/gguf_kept.py), and `--quantization int8` on a single CPU device ("i8_row": a
float32 scale and K int8 values per row).

A `QuantizedRows` is one matrix used as y = x @ W.T: `rows` uint8 [N, row_bytes], row n being
output n's K inputs as consecutive blocks, or a stack of every layer's [L, N, row_bytes] of which
`layer` is read (one argument of the step for all layers, as packed.py's stacks). A
`QuantizedLinear` is a weight of the model ([K..., N...] in our layout: qkv, o_proj, gate_up, down,
the LM head, an embedding) as one or more such matrices whose outputs are joined: one when every
part had the same format (the rows were fused at load), else one per source tensor (a Q4_K_M file
stores attn_v and half of ffn_down in Q6_K beside Q4_K q, k, gate and up), their outputs
concatenated, and for qkv interleaved into [kv_heads, group + 2, head_dim] as the fused rows
would be.

Each matrix says how x meets it (`QuantizedRows.activations`, from --quantized-activations): "q8"
quantizes x per block and multiplies integers as llama.cpp does (native/q8_gemm_cpu.cc; the
blocks of 32 in their interleaved "x8" layouts); "float32" keeps x as is against the exactly
decoded weights (native/quantized_gemm_cpu.cc), as int8's "i8_row" matrices always do.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.model.weight_types.whole_weight import ReadWhole
from xlaserve.native import quantized_gemm_cpu
from xlaserve.native.build import KernelUnavailable

logger = logging.getLogger(__name__)


@functools.cache
def native_gemm_available() -> bool:
    """Whether the native quantized GEMM builds here (once; a warning says why not)."""
    try:
        quantized_gemm_cpu.load()
        return True
    except KernelUnavailable as error:
        logger.warning("The native quantized GEMM is unavailable: GGUF weights are dequantized "
                       "at load and --quantization int8 runs on XLA's dots: %s", error)
        return False


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedRows:
    """One matrix [N, K] in rows of `fmt` blocks (module docstring)."""

    rows: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))
    layer: int = dataclasses.field(default=0, metadata=dict(static=True))
    # How x meets the rows (quantized_gemm_cpu.ACTIVATIONS): "q8" quantized per block, integer
    # dot products as llama.cpp's (GGUF formats; the "x8" layouts take nothing else), "float32"
    # as is, against the exactly decoded weights.
    activations: str = dataclasses.field(default="float32", metadata=dict(static=True))

    @property
    def n(self) -> int:
        return self.rows.shape[-2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedLinear(ReadWhole):
    """A model weight of shape `weight_shape` (our layout) as `parts` (module docstring).
    `qkv_heads`: (kv_heads, queries_per_kv, head_dim) when the parts are q, k and v unfused."""

    parts: tuple[QuantizedRows, ...]
    weight_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    output_axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    qkv_heads: tuple[int, int, int] | None = dataclasses.field(default=None,
                                                               metadata=dict(static=True))
    # The weight's own layout is the rows' [N, K] (an embedding, used as x @ E.T for the LM head)
    rows_layout: bool = dataclasses.field(default=False, metadata=dict(static=True))


    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight_shape

    @property
    def dtype(self):
        return jnp.dtype(jnp.uint8)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(part.fmt for part in self.parts)


def quantized_linear(x: jax.Array, weight: QuantizedLinear, matmul) -> jax.Array:
    """x [T, K] @ weight -> float32 [T, *output axes]; `matmul(x, rows, fmt=, k=, layer=,
    activations=)` is the native GEMM (quantized_gemm_cpu.quantized_matmul)."""
    x = x.astype(jnp.float32)
    outputs = [matmul(x, part.rows, fmt=part.fmt, k=part.k, layer=part.layer,
                      activations=part.activations) for part in weight.parts]
    return _joined(outputs, weight.qkv_heads, jnp).reshape(x.shape[0], *weight.output_axes)


def dequantized(weight: QuantizedLinear) -> np.ndarray:
    """The float32 weight [K..., N...] (our layout) a QuantizedLinear stands for, on the host:
    for tests and inspection."""
    columns = [quantized_gemm_cpu.dequantize(
        np.asarray(part.rows if part.rows.ndim == 2 else part.rows[part.layer]), part.fmt, part.k).T
        for part in weight.parts]  # each [K, N_part]
    matrix = _joined(columns, weight.qkv_heads, np)
    return (matrix.T if weight.rows_layout else matrix).reshape(weight.weight_shape)


def _joined(parts: list, qkv_heads, xp):
    """The parts' outputs [R, N_part] as the weight's [R, N]: concatenated, or for unfused q, k and
    v interleaved per kv head as the fused rows would be ([R, kv_heads, group + 2, head_dim])."""
    if len(parts) == 1:
        return parts[0]
    if qkv_heads is None:
        return xp.concatenate(parts, axis=-1)
    kv_heads, _, head_dim = qkv_heads
    rows = parts[0].shape[0]
    q, k, v = (part.reshape(rows, kv_heads, -1, head_dim) for part in parts)
    return xp.concatenate([q, k, v], axis=2)


def embed_rows(embedding: QuantizedLinear, ids: jax.Array, lookup) -> jax.Array:
    """embedding[ids] float32 [T, hidden] of a quantized embedding (one part, [vocab, hidden]
    rows); `lookup(rows, ids, fmt=, k=, layer=)` dequantizes only those rows."""
    (part,) = embedding.parts
    return lookup(part.rows, ids, fmt=part.fmt, k=part.k, layer=part.layer)


def int8_rows(matrix, i8_rows, activations: str = "float32") -> QuantizedLinear:
    """An int8.Int8Matrix (values [K..., N...], scales [N...]) as "i8_row" rows for the native
    GEMM: values transposed to [N, K], each row led by its float32 scale (`i8_rows`, the
    GEMM module's packer). `activations` "q8": interleaved 8 rows at a time for the Q8 GEMM
    (W8A8: x quantized per block of 32) where K is a multiple of 32 and N of 8, else float32."""
    output_axes = tuple(matrix.scales.shape)
    n = math.prod(output_axes)
    k = math.prod(matrix.values.shape) // n
    values = matrix.values.reshape(k, n).T
    rows = i8_rows(values, matrix.scales.reshape(n))
    part = QuantizedRows(rows, "i8_row", k)
    if activations == "q8":
        part = interleaved(part, jnp)
    return QuantizedLinear((part,), tuple(matrix.values.shape), output_axes)


def interleaved(part: QuantizedRows, xp=np) -> QuantizedRows:
    """`part` with q8 activations, in its format's "x8" layout where it has one (GGUF's blocks of
    32, i8_row with K a multiple of 32) and its rows come in groups of 8: the Q8 GEMM's fast path
    (native/q8_interleaved.h); else as it is (the K-quants: the Q8 GEMM's one-row path; i8_row:
    float32 activations, the only ones its file layout takes). `xp`: the rows' array module."""
    fmt = part.fmt
    if (fmt not in quantized_gemm_cpu.X8.values() or part.n % 8
            or (fmt == "i8_row" and part.k % 32)):
        return part if fmt == "i8_row" else dataclasses.replace(part, activations="q8")
    return dataclasses.replace(part, rows=quantized_gemm_cpu.interleave_x8(part.rows, fmt, xp),
                               fmt=fmt + "x8", activations="q8")


def stack_layers(values: dict) -> dict:
    """`{path: value}` with the layers' QuantizedLinears of one kind, part and format stacked into
    one array each, every layer's part a view of it (`layer`), as packed.pack_model stacks the
    packed weights: a step takes one argument per stack, not one per layer. Host (numpy) rows are
    stacked on the host, before they are put on the device once."""
    groups: dict[tuple, list[tuple[tuple, int]]] = {}
    for path, value in values.items():
        if isinstance(value, QuantizedLinear) and path[0] == "layers":
            for index, part in enumerate(value.parts):
                if part.rows.ndim != 2:  # stacked already
                    continue
                key = (path[2:], index, part.fmt, tuple(part.rows.shape))
                groups.setdefault(key, []).append((path, index))
    parts = {path: list(value.parts) for path, value in values.items()
             if isinstance(value, QuantizedLinear) and path[0] == "layers"}
    for members in groups.values():
        members_rows = [parts[path][index].rows for path, index in members]
        stack = (np.stack if isinstance(members_rows[0], np.ndarray) else jnp.stack)(members_rows)
        for layer, (path, index) in enumerate(members):
            parts[path][index] = dataclasses.replace(parts[path][index], rows=stack, layer=layer)
    return {path: dataclasses.replace(value, parts=tuple(parts[path])) if path in parts else value
            for path, value in values.items()}


def check_quantized_rows(model, kernels) -> None:
    """A model with weights kept quantized runs only with the native CPU kernels (a single CPU
    device): one clear error where the step would be another's (loaded for the native GEMM, run
    with `--matmul-backend xla`)."""
    from flax import nnx

    if kernels.packed_matmul is not None:
        return
    leaves = jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, QuantizedLinear))
    if any(isinstance(leaf, QuantizedLinear) for leaf in leaves):
        raise ValueError("this model's weights are kept quantized for the native CPU GEMM, which "
                         "this step does not use: load it with matmul_backend='xla' to "
                         "dequantize them")
