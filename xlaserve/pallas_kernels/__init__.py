"""Attention and matmul kernels beyond XLA's own: ragged paged attention over the paged KV cache
(ragged_paged_attention: the jnp specification, the CPU, TPU and GPU kernels), the experts'
grouped matmuls on GPU (grouped_matmul_gpu; over MXFP4 experts, grouped_matmul_mxfp4), the
128x128 block-scaled FP8 matmul for GPUs with FP8 tensor cores (`block_fp8_matmul`), and the
batch-invariant matmul and RMSNorm of deterministic inference on TPU and GPU (invariant_matmul,
invariant_norm)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "block_fp8_matmul": "fp8_block_matmul", "supports": "fp8_block_matmul",
    "grouped_matmul_gpu": "grouped_matmul_gpu", "grouped_matmul_mxfp4": "grouped_matmul_mxfp4",
    "invariant_matmul": "invariant_matmul", "invariant_norm": "invariant_norm",
    "ragged_paged_attention": "ragged_paged_attention",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
