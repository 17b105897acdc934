"""The flags that size and shape the steps: the context length, the running requests, the KV
pool, the prompt pieces a step takes, precompilation and the overlap schedule. Four of them
default by hardware once the platform is known: platform_defaults.py."""
from __future__ import annotations

import dataclasses
from typing import Optional

from xlaserve.server_args.flag import flag


@dataclasses.dataclass
class SchedulingFlags:
    """Memory, batches and compilation of the steps."""

    context_length: Optional[int] = flag(None, "longest prompt + output (default: the model's)",
                                         aliases=("--max-model-len",))
    max_running_requests: Optional[int] = flag(
        None, "requests decoded together at most (default 64 on CPU, 256 on TPU/GPU, 512 on a "
              "GPU whose KV pool holds 2048 tokens for each: the largest sequence bucket of the "
              "compiled steps)", aliases=("--max-num-seqs",))
    max_total_tokens: Optional[int] = flag(
        None, "KV cache size in tokens (default: from --mem-fraction-static)")
    mem_fraction_static: Optional[float] = flag(
        None, "TPU/GPU: fraction of the memory XLA may allocate that holds the weights and the "
              "KV cache, the rest left to the steps' temporaries (default 0.9; on a GPU XLA may "
              "take 0.95 of the device unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise). "
              "CPU: fraction of free host RAM for the KV cache (default 0.1: the rest of the "
              "machine shares it)")
    chunked_prefill_size: Optional[int] = flag(
        None, "longest prompt piece per step; <= 0 disables chunking (default 256 on CPU; on "
              "TPU/GPU 8192, or 2048 on a device of under 35 GB, as SGLang)")
    max_prefill_tokens: Optional[int] = flag(
        None, "new prompt tokens per step at most (default 512 on CPU, the prompt piece's size "
              "on TPU/GPU)")
    disable_precompile: bool = flag(False, "compile step shapes on first use instead of at start")
    precompile_threads: int = flag(
        1, "step programs compiled at once at start (default 1: on a 2-core CPU two at once took "
           "1.36x as long)")
    precompile_token_paddings: Optional[str] = flag(
        None, "comma-separated token-count buckets (default: powers of two)")
    precompile_bs_paddings: Optional[str] = flag(
        None, "comma-separated sequence-count buckets (default: powers of two)")
    disable_overlap_schedule: bool = flag(
        False, "wait for each step before handing out its tokens (default: detokenize and hand "
               "out a step's tokens while the next step computes)")

    def check_precompile(self) -> None:
        if self.precompile_threads < 1:
            raise ValueError(f"--precompile-threads must be 1 or more; got "
                             f"{self.precompile_threads}")
