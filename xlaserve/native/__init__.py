"""Native CPU kernels: C++ sources compiled on first use (build.py: `register`, or
`KernelUnavailable` without a compiler) and called from jitted code as XLA FFI custom calls: the
packed-weight GEMM, the quantized GEMM, RMSNorm, q/k/v with RoPE, SwiGLU."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "cpu_signature": "build", "KernelUnavailable": "build", "register": "build", "builds": "build",
    "registered": "build", "Registration": "build",
    "gemm_cpu": "gemm_cpu",
    "norm_cpu": "norm_cpu",
    "qkv_rope_cpu": "qkv_rope_cpu",
    "quantized_gemm_cpu": "quantized_gemm_cpu",
    "swiglu_cpu": "swiglu_cpu",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
