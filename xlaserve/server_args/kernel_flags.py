"""The step's kernels: attention's and the matmuls' implementations, the CPU's quantized
activations, multi-head latent attention's form, and the KV cache's page size."""
from __future__ import annotations

import dataclasses
from typing import Optional

from xlaserve.server_args.flag import flag


@dataclasses.dataclass
class KernelFlags:
    """The kernels a step runs, and the KV cache's pages."""

    attention_backend: str = flag("auto", "ragged paged attention implementation",
                                  choices=["auto", "reference", "cpu", "pallas"])
    matmul_backend: str = flag(
        "auto", "matmuls: auto (the native GEMM over packed weights on a single CPU device, XLA's "
                "dots elsewhere), native, xla", choices=["auto", "native", "xla"])
    quantized_activations: str = flag(
        "q8", "weights kept quantized on the CPU (a GGUF's blocks, --quantization int8's rows): "
              "q8 (default) quantizes each matmul's input per block of 32 (256 for K-quants) to "
              "8 bits and multiplies integers, as llama.cpp does (its numerics; W8A8 for int8 "
              "where K is a multiple of 32); float32 multiplies the exact float32 input by the "
              "exactly decoded weights (slower; logits closer to the dequantized model's)",
        choices=["q8", "float32"])
    mla_expanded_prefill_tokens: int = flag(
        0, "multi-head latent attention models (DeepSeek-V2/V3, Kimi K2): steps of at least this "
           "many tokens take the expanded form, new tokens attended with per-head keys and "
           "values, the cached prefix in the latent space, merged by log-sum-exp (SGLang's and "
           "vLLM's form for prefills); 0 (default): the absorbed form always (on CPU the "
           "native absorbed kernel was faster below ~1000-token prompts; TPU/GPU untimed)")
    enable_deterministic_inference: bool = flag(
        False, "SGLang's: a request's tokens and logprobs are the same bits whatever else shares "
               "its steps (their number, the chunking of prompts, the prefix cache): every row "
               "summed in one order by the native GEMM, per-row sampling reductions "
               "(docs/server.md, RL rollouts, for the cost); a single CPU device with the native "
               "GEMM and a float or bfloat16 checkpoint; refused with speculative decoding, "
               "LoRA, mixtures of experts and GGUF blocks kept quantized")
    page_size: Optional[int] = flag(
        None, "tokens per KV cache page (default 16; on TPU the smallest power of two from 16 "
              "whose page table fits the attention kernel's scalar memory)")

    def check_mla_expanded_prefill(self) -> None:
        if self.mla_expanded_prefill_tokens < 0:
            raise ValueError("--mla-expanded-prefill-tokens must be 0 (never) or a token count; "
                             f"got {self.mla_expanded_prefill_tokens}")
