"""The flags whose best value depends on the hardware: filled in once the platform is known.

`--max-running-requests`, `--chunked-prefill-size`, `--max-prefill-tokens` and
`--mem-fraction-static` default to None on the command line; `resolve` gives each its
platform's value (a value the user gives is kept), and `startup.build` logs the result in one line.

CPU: the defaults this project measured on 2-8 cores (64 running requests, 256-token prompt
pieces, 512 new tokens a step: a bigger step only adds latency where the matmuls already fill the
cores; KV from 0.1 of free RAM, which the rest of the machine shares).

TPU and GPU follow SGLang's choices per GPU (its `server_args.py`, for an H100 at tp < 4):
8192-token prompt pieces from 35 GB of device memory (2048 below), and 256 decoded requests (its
CUDA-graph batch limit there; here the largest sequence bucket, so one compiled step covers them
all); a step takes a whole 8192-token piece. A GPU whose KV pool holds more requests decodes more at
once (`running_requests_for_pool`, up to 512). At 64 running requests an 8B model's decode step
on an H100 reads its 16 GB of weights for 64 tokens; at 256 for 256 (predicted 13.3k against 3.4k
tok/s, docs/tpu-gpu.md). Memory: `mem_fraction_static` of what XLA may allocate holds the
weights and the KV pool, the rest is the steps' temporaries (Llama-3.1-8B's 8192-token step
compiled for an H100 needs 3.36 GiB; the rest at 0.9 is ~7.6 GB). JAX lets XLA take 75% of a GPU by default (XLA_PYTHON_CLIENT_MEM_FRACTION), so
an 80 GB H100 gave the KV pool 37 GB where SGLang takes ~54 GB: `prepare_gpu_memory` raises it
to 0.95 before JAX starts its GPU client, unless the variable is set.
"""
from __future__ import annotations

import dataclasses
import logging
import os

logger = logging.getLogger(__name__)

GPU_CLIENT_MEMORY_FRACTION = "0.95"  # XLA's GPU allocator pool, of the device's memory

# (max_running_requests, chunked_prefill_size, max_prefill_tokens, mem_fraction_static)
CPU_DEFAULTS = (64, 256, 512, 0.1)
ACCELERATOR_RUNNING_REQUESTS = 256
ACCELERATOR_MEM_FRACTION = 0.9  # of XLA's limit: 0.9 x 0.95 = 0.855 of an H100 (SGLang: 0.88)
SMALL_DEVICE_BYTES = 35 * 2**30  # SGLang's line between 2048- and 8192-token prompt pieces
# GPU: the running requests double from 256 while the KV pool holds this many tokens for each
# (a 1024-token prompt and as many out, the serving benchmarks' shape), up to MOST_RUNNING_REQUESTS.
# Past 256 rows a decode step is still far from its compute on an H200 (Qwen2.5-0.5B: 6.34 ms at
# 256 rows against a 0.32 ms floor, accelerator_check.md), so more rows a step are more tokens a
# second. An 8B model's pool on an 80-141 GB GPU holds 256 such requests at most and stays at 256;
# Qwen2.5-0.5B's (4.5M tokens on an H100) takes 512. TPU keeps 256: its kernels hold the page
# table in SMEM (1 MiB), which the page size is chosen to fit for that many requests.
TOKENS_PER_RUNNING_REQUEST = 2048
MOST_RUNNING_REQUESTS = 512


def prepare_gpu_memory() -> None:
    """Lets XLA's GPU allocator take 95% of the device instead of JAX's 75% (the KV pool is
    sized from it). Effective only before JAX starts its GPU client; a no-op on CPU and TPU."""
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = GPU_CLIENT_MEMORY_FRACTION


def device_memory(device) -> tuple[int, int] | None:
    """(bytes XLA may allocate on `device`, bytes in use there), or None on CPU or where the
    runtime does not say."""
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def defaults_for(platform: str, memory_limit: int | None) -> dict[str, float | int]:
    """Each hardware-dependent flag's default on `platform` ("cpu", "gpu", "tpu") with
    `memory_limit` bytes that XLA may allocate on one device."""
    if platform == "cpu":
        running, chunk, prefill, fraction = CPU_DEFAULTS
    else:
        chunk = 2048 if memory_limit is not None and memory_limit < SMALL_DEVICE_BYTES else 8192
        running, prefill, fraction = ACCELERATOR_RUNNING_REQUESTS, chunk, ACCELERATOR_MEM_FRACTION
    return {"max_running_requests": running, "chunked_prefill_size": chunk,
            "max_prefill_tokens": prefill, "mem_fraction_static": fraction}


def resolve(args, platform: str, device=None) -> tuple[object, list[str]]:
    """`args` (ServerArgs) with every hardware-dependent flag left None set to its platform
    default (`device`: one of the devices it will run on; None for compile-only targets, which
    have no memory to ask about); and the names of those it set (for the log line)."""
    unset = [name for name in ("max_running_requests", "chunked_prefill_size",
                               "max_prefill_tokens", "mem_fraction_static")
             if getattr(args, name) is None]
    if not unset:
        return args, []
    memory = device_memory(device) if device else None
    defaults = defaults_for(platform, memory[0] if memory else None)
    return dataclasses.replace(args, **{name: defaults[name] for name in unset}), unset


def running_requests_for_pool(platform: str, pool_tokens: int) -> int:
    """The default --max-running-requests once the KV pool is sized (`pool_tokens` a replica):
    ACCELERATOR_RUNNING_REQUESTS, doubled on GPU while the pool holds TOKENS_PER_RUNNING_REQUEST
    tokens for each, up to MOST_RUNNING_REQUESTS."""
    running = ACCELERATOR_RUNNING_REQUESTS
    while (platform == "gpu" and 2 * running <= MOST_RUNNING_REQUESTS
           and pool_tokens >= 2 * running * TOKENS_PER_RUNNING_REQUEST):
        running *= 2
    return running


def log_resolved(args, platform: str, names: list[str]) -> None:
    if names:
        logger.info("Defaults for %s: %s", platform,
                    ", ".join(f"{name}={getattr(args, name)}" for name in names))
