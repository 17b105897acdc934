"""Linear attention of hybrid models (Qwen3.5, Qwen3-Next: Gated DeltaNet layers; issue 76): the
gated delta rule and its causal short convolution over ragged batches and a state pool, the jnp
specification (reference.py), and the kernels of the rule: the CPU's native one (kernel_cpu.py),
Pallas for TPU (kernel_tpu.py) and GPU (kernel_gpu.py)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "gated_delta_rule": "reference", "chunked_gated_delta_rule": "reference",
    "causal_conv1d": "reference", "scan_rows": "reference", "prepared_inputs": "reference",
    "delta_rule_update": "reference", "pallas_inputs": "reference", "all_writes": "reference",
    "kernel_cpu": "kernel_cpu", "kernel_tpu": "kernel_tpu", "kernel_gpu": "kernel_gpu",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
