"""A GGUF file's matmul weights kept in their quantized blocks, for the native quantized GEMM on a
single CPU device (model/weight_types/quantized_rows.py, native/quantized_gemm_cpu.py), instead of
being dequantized at load.

Kept: each layer's attention (q, k, v, output) and MLP (gate, up, down) weights, the token
embedding and the output head, where stored as Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K or Q6_K (what
llama.cpp users download most: a Q4_K_M file is Q4_K and Q6_K, with Q5_0 where a matrix's K is
not a multiple of 256 (Q5_1 in a Q5_K_M file); the embedded default model Q4_1 and Q8_0).
Their bytes are the file's own: a row of a GGUF [N, K] tensor is output n's K inputs as
consecutive blocks, which is the GEMMs' layout; with q8 activations (--quantized-activations, the
default) the formats of blocks of 32 are interleaved 8 rows at a time (the same bytes reordered,
native/q8_interleaved.h), which the Q8 GEMM multiplies 8 outputs at a time. q and k rows are put
back in the transformers order (llama.cpp permutes them for its interleaved RoPE), whole rows at
a time. A weight made of several tensors (qkv, gate_up) is fused into one matrix where they share
a format, else kept as parts. A weight with any tensor of another type (F16, BF16, Q5_K, ...) is
dequantized at load as before, and a log line names them. Everything else (norms, biases) is
float as before.

A Q4_K_M 8B file (4.9 GB) dequantized was 16 GB in bfloat16 and 32 GB in float32; kept, the
model is the file's size and a decode step reads its bytes, not 3-6x as many.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.weights.formats.gguf_file import GGUFSource
from xlaserve.weights.placement import put
from xlaserve.model.weight_types.quantized_rows import (QuantizedLinear, QuantizedRows,
                                                        interleaved, native_gemm_available,
                                                        stack_layers)

logger = logging.getLogger(__name__)

# GGUF tensor types kept quantized -> the GEMM's format names.
KEPT_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1",
              "Q4_K": "q4_k", "Q6_K": "q6_k"}
# The conversion cache entry of a file loaded this way holds only the parameters not kept.
CACHE_VARIANT = "gguf-kept"


def keeps_quantized(mesh: Mesh, matmul_backend: str) -> bool:
    """Whether a GGUF's quantized weights stay quantized: on a single CPU device, where the
    native GEMMs run (runtime/executor/kernels.py), unless `--matmul-backend xla` asks for XLA's dots
    (which take float weights), and where the quantized GEMM builds."""
    if matmul_backend == "xla" or mesh.size != 1 or mesh.devices.flat[0].platform != "cpu":
        return False
    return native_gemm_available()


def placed(kept: dict[tuple, QuantizedLinear], mesh: Mesh) -> dict[tuple, QuantizedLinear]:
    """`kept` with each kind's layers stacked (quantized_rows.stack_layers) and put on the
    mesh's one device, each stack once."""
    replicated = NamedSharding(mesh, P())
    on_device = {}

    def put_once(rows: np.ndarray):
        if id(rows) not in on_device:
            on_device[id(rows)] = put(np.ascontiguousarray(rows), replicated)
        return on_device[id(rows)]

    return {path: dataclasses.replace(value, parts=tuple(
                dataclasses.replace(part, rows=put_once(part.rows)) for part in value.parts))
            for path, value in stack_layers(kept).items()}


def kept_weights(config: ModelConfig, source: GGUFSource,
                 activations: str = "float32") -> dict[tuple, QuantizedLinear]:
    """{parameter path: QuantizedLinear of host (numpy) rows} for every weight kept quantized;
    the paths missing here are dequantized by weights.convert as before. `activations`: how
    every kept matrix meets x (QuantizedRows.activations); with "q8" the ones of Q8_0, Q4_0,
    Q4_1, Q5_0 and Q5_1 blocks are also interleaved for the Q8 GEMM (`interleaved`)."""
    c = config
    hidden, head_dim, inter = c.hidden_size, c.head_dim, c.intermediate_size
    kept, dequantized = {}, []

    def keep(path, names, weight_shape, output_axes, qkv_heads=None, rows_layout=False):
        raws = [source.raw(name) for name in names]
        if any(kind not in KEPT_TYPES for kind, _, _ in raws):
            dequantized.extend(f"{name} ({kind})" for name, (kind, _, _) in zip(names, raws)
                               if kind not in KEPT_TYPES)
            return
        parts = [QuantizedRows(rows, KEPT_TYPES[kind], k) for kind, rows, k in raws]
        if len({part.fmt for part in parts}) == 1 and len(parts) > 1:
            parts = [_fused(parts, qkv_heads)]
        if activations == "q8":
            parts = [interleaved(part) for part in parts]
        kept[path] = QuantizedLinear(tuple(parts), weight_shape, output_axes,
                                     qkv_heads if len(parts) > 1 else None, rows_layout)

    keep(("embedding",), ["model.embed_tokens.weight"], (c.vocab_size, hidden), (c.vocab_size,),
         rows_layout=True)
    if not c.tie_word_embeddings:
        keep(("lm_head",), ["lm_head.weight"], (hidden, c.vocab_size), (c.vocab_size,))
    for i in range(c.num_layers):
        attn, mlp, layer = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", ("layers", i)
        group = c.queries_per_kv
        keep(layer + ("attn", "qkv"), [attn + f"{p}_proj.weight" for p in "qkv"],
             (hidden, c.num_kv_heads, group + 2, head_dim), (c.num_kv_heads, group + 2, head_dim),
             qkv_heads=(c.num_kv_heads, group, head_dim))
        keep(layer + ("attn", "o_proj"), [attn + "o_proj.weight"],
             (c.num_heads, head_dim, hidden), (hidden,))
        keep(layer + ("mlp", "gate_up"), [mlp + "gate_proj.weight", mlp + "up_proj.weight"],
             (hidden, 2, inter), (2, inter))
        keep(layer + ("mlp", "down"), [mlp + "down_proj.weight"], (inter, hidden), (hidden,))
    if dequantized:
        logger.info("GGUF tensors of types the quantized GEMM does not take (it takes %s), "
                    "dequantized at load: %s", ", ".join(KEPT_TYPES), ", ".join(dequantized[:8])
                    + (f" and {len(dequantized) - 8} more" if len(dequantized) > 8 else ""))
    return kept


def _fused(parts: list[QuantizedRows], qkv_heads) -> QuantizedRows:
    """Parts of one format as one matrix: rows concatenated (gate then up), or for q, k, v
    interleaved per kv head into our qkv order [kv_heads, group + 2, head_dim]."""
    if qkv_heads is None:
        return QuantizedRows(np.concatenate([p.rows for p in parts]), parts[0].fmt, parts[0].k)
    kv_heads, group, head_dim = qkv_heads
    q, k, v = (p.rows for p in parts)
    row_bytes = q.shape[-1]
    rows = np.concatenate([q.reshape(kv_heads, group, head_dim, row_bytes),
                           k.reshape(kv_heads, 1, head_dim, row_bytes),
                           v.reshape(kv_heads, 1, head_dim, row_bytes)], axis=1)
    return QuantizedRows(rows.reshape(-1, row_bytes), parts[0].fmt, parts[0].k)
