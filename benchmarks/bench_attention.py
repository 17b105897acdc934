"""Times the ragged paged attention implementations of this platform on two batches:
decode (64 sequences x 1 new token, 1024 keys each) and prefill (8 sequences x 512 new tokens).

    python benchmarks/bench_attention.py [--dtype bfloat16 [float32]] [--iters 20]
    python benchmarks/bench_attention.py --mla [--head-dim 576 --value-dim 512]
    python benchmarks/bench_attention.py --batches decode --kv-len 16384 --sliding-window 0 512

--mla times multi-head latent attention instead (`mla_ragged_paged_attention`, DeepSeek-V3 per
device by default: 16 query heads, a 576-entry latent row per token of which 512 are the values).

Per implementation: milliseconds of device time per call (calls enqueued back to back, as in a
step; `device_seconds`), achieved HBM (memory) bandwidth over the bytes the call
must move (every attended K/V once, q, out, the new K/V written) and TFLOP/s over the causal
attention's two matmuls. On CPU the run opens with the memory's read bandwidth (a jitted sum
over 512 MiB), what the GB/s figures compare with. Platforms: the reference (XLA) everywhere,
plus the Pallas TPU kernel on TPU, the Pallas GPU (Triton) kernel on GPU, the native CPU kernel
on CPU. The Pallas kernels do not run natively on CPU (only in interpret mode, far too slow to
time), which the output says.
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.pallas_kernels.ragged_paged_attention import kernel_cpu, kernel_gpu, kernel_tpu
from xlaserve.pallas_kernels.ragged_paged_attention import reference

BATCHES = {"decode": (64, 1, 1024), "prefill": (8, 512, 512)}  # seqs, new tokens, kv length


def implementations(platform: str, latent: bool = False) -> dict:
    """Name -> attention function of this platform; `latent`: the multi-head latent attention
    functions (and on CPU the kernel's float32 arithmetic, timed on bfloat16 batches only)."""
    name = "mla_ragged_paged_attention" if latent else "ragged_paged_attention"
    found = {"reference (XLA)": getattr(reference, name)}
    if platform == "tpu":
        found["pallas tpu"] = getattr(kernel_tpu, name)
    elif platform == "gpu":
        found["pallas gpu (triton)"] = getattr(kernel_gpu, name)
    else:
        print(f"{platform}: the Pallas TPU and GPU kernels need a TPU or an NVIDIA GPU (on CPU they "
              "only run in interpret mode, for tests); timing the reference and the CPU kernel")
        try:
            kernel_cpu.load()
            found["cpu kernel"] = getattr(kernel_cpu, name)
            if latent and kernel_cpu.bf16_pairs_supported():
                found[WIDENED] = functools.partial(kernel_cpu.mla_ragged_paged_attention,
                                                   bf16_pairs=False)
        except kernel_cpu.KernelUnavailable as error:
            print(f"the CPU kernel is unavailable: {error}")
    return found


WIDENED = "cpu kernel, bf16_pairs=False"  # bfloat16 widened to float32, not VDPBF16PS


def make_batch(num_seqs, q_len, kv_len, *, num_q_heads, num_kv_heads, head_dim, page_size, dtype,
               seed=0):
    """Each sequence's pages in shuffled order, kv_len keys of which the last q_len are new."""
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-kv_len // page_size)
    num_pages = num_seqs * pages_per_seq + 1
    page_indices = rng.permutation(np.arange(1, num_pages)).reshape(num_seqs, pages_per_seq)
    num_tokens = num_seqs * q_len
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    return dict(
        q=normal(num_tokens, num_q_heads, head_dim), k=normal(num_tokens, num_kv_heads, head_dim),
        v=normal(num_tokens, num_kv_heads, head_dim),
        kv_cache=normal(num_pages, page_size, 2 * num_kv_heads, head_dim),
        kv_lens=jnp.full((num_seqs,), kv_len, jnp.int32),
        page_indices=jnp.asarray(page_indices, jnp.int32),
        cu_q_lens=jnp.arange(0, num_tokens + 1, q_len, dtype=jnp.int32),
        num_seqs=jnp.array([num_seqs], jnp.int32))


def make_latent_batch(num_seqs, q_len, kv_len, *, num_q_heads, head_dim, page_size, dtype,
                      seed=0):
    """`make_batch` for multi-head latent attention: q [T, Hq, Dk], latent [T, Dk] and
    kv_cache [pages, page_size, Dk] (Dk = head_dim)."""
    batch = make_batch(num_seqs, q_len, kv_len, num_q_heads=num_q_heads, num_kv_heads=1,
                       head_dim=head_dim, page_size=page_size, dtype=dtype, seed=seed)
    batch["latent"], batch["kv_cache"] = batch.pop("k")[:, 0], batch["kv_cache"][:, :, 0]
    del batch["v"]
    return batch


def latent_traffic_and_flops(num_seqs, q_len, kv_len, num_q_heads, head_dim, value_dim, itemsize):
    """`traffic_and_flops` of multi-head latent attention: one Dk-entry row per key, read once
    for every head; each head's scores over Dk and value sums over value_dim entries."""
    tokens = num_seqs * q_len
    nbytes = (num_seqs * kv_len * head_dim + tokens * num_q_heads * (head_dim + value_dim) +
              tokens * head_dim) * itemsize
    attended = sum(kv_len - q_len + r + 1 for r in range(q_len))
    return nbytes, 2 * num_seqs * attended * num_q_heads * (head_dim + value_dim)


def read_bandwidth(nbytes: int = 512 << 20) -> float:
    """Bytes per second that a jitted sum reads from memory (the best of 5 runs)."""
    x = jnp.ones(nbytes // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    return nbytes / min(device_seconds(lambda: total(x), 1) for _ in range(5))


def traffic_and_flops(num_seqs, q_len, kv_len, num_q_heads, num_kv_heads, head_dim, itemsize,
                      window: int = 0):
    """Bytes a call must move at least and the flops of QK^T and PV under the causal mask (and
    the sliding `window`'s, > 0: each row's last `window` keys)."""
    read = kv_len if window <= 0 else min(kv_len, window + q_len - 1)
    kv_bytes = num_seqs * read * 2 * num_kv_heads * head_dim * itemsize
    q_out_bytes = 2 * num_seqs * q_len * num_q_heads * head_dim * itemsize
    new_kv_bytes = num_seqs * q_len * 2 * num_kv_heads * head_dim * itemsize
    seen = lambda keys: keys if window <= 0 else min(keys, window)
    attended = sum(seen(kv_len - q_len + r + 1) for r in range(q_len))  # keys the rows see
    flops = 4 * num_seqs * attended * num_q_heads * head_dim
    return kv_bytes + q_out_bytes + new_kv_bytes, flops


def device_seconds(dispatch, iters: int, rounds: int = 3) -> float:
    """Device time of one call: `dispatch()` enqueues a call (without waiting) and returns what
    to wait on; each round enqueues `iters` calls back to back and waits once, so the host's
    dispatch hides behind the device wherever the device is the slower (as in a serving step,
    one compiled program). Median of `rounds` after one warm call (the compile). Waiting on
    every call, as this did before, adds the host's round trip to each: on an H200 that timed
    the decode batch below (134 MB of KV) at 0.188 ms a call, 0.7 TB/s, where ncu timed the
    kernel on a bigger one (277 MB: sweep_gpu_attention's decode_256x256) at 0.108 ms, 2.6 TB/s."""
    jax.block_until_ready(dispatch())
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            last = dispatch()
        jax.block_until_ready(last)
        times.append((time.perf_counter() - start) / iters)
    return float(np.median(times))


def seconds_per_call(fn, batch, iters: int) -> float:
    """Device time per call (`device_seconds`); the cache is donated and threaded through, as in
    serving, which also orders the calls."""
    step = jax.jit(lambda cache, rest: fn(kv_cache=cache, **rest, sm_scale=0.1), donate_argnums=0)
    rest = {k: v for k, v in batch.items() if k != "kv_cache"}
    cache = [jnp.copy(batch["kv_cache"])]

    def dispatch():
        out, cache[0] = step(cache[0], rest)
        return out, cache[0]

    return device_seconds(dispatch, iters)


def attention_timings(found: dict, batches: dict, *, dtype, iters: int, page_size: int,
                      value_dim: int | None = None, window: int = 0, **heads):
    """Yields one row per (batch, implementation) as it is timed: the batch's label, ms per call,
    GB/s over the bytes it must move, TFLOP/s. `batches`: name -> (seqs, new tokens, kv length);
    `heads`: num_q_heads, num_kv_heads, head_dim; or with `value_dim`, multi-head latent
    attention's: num_q_heads, head_dim (the latent row). `window` > 0: a sliding window's
    attention (not with `value_dim`)."""
    for name, (num_seqs, q_len, kv_len) in batches.items():
        shape = (num_seqs, q_len, kv_len)
        if value_dim is None:
            batch = make_batch(*shape, page_size=page_size, dtype=dtype, **heads)
            nbytes, flops = traffic_and_flops(*shape, itemsize=dtype.itemsize, window=window,
                                              **heads)
        else:
            batch = make_latent_batch(*shape, page_size=page_size, dtype=dtype, **heads)
            nbytes, flops = latent_traffic_and_flops(*shape, value_dim=value_dim,
                                                     itemsize=dtype.itemsize, **heads)
        label = f"{name} {num_seqs}x{q_len} new, {kv_len} kv" + (f", window {window}"
                                                                 if window > 0 else "")
        for impl, fn in found.items():
            if value_dim is not None:
                fn = functools.partial(fn, value_dim=value_dim)
            elif window > 0:
                fn = functools.partial(fn, sliding_window=window)
            s = seconds_per_call(fn, batch, iters)
            yield {"batch": label, "implementation": impl, "ms": s * 1e3,
                   "gb_s": nbytes / s / 1e9, "tflop_s": flops / s / 1e12}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    platform = jax.default_backend()
    parser.add_argument("--dtype", nargs="+",
                        default=["float32" if platform == "cpu" else "bfloat16"])
    parser.add_argument("--iters", type=int, default=5 if platform == "cpu" else 20)
    parser.add_argument("--num-q-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, help="default 128, or 576 with --mla")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batches", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    parser.add_argument("--mla", action="store_true",
                        help="multi-head latent attention: --head-dim is the latent row")
    parser.add_argument("--value-dim", type=int, default=512, help="with --mla: the values' width")
    parser.add_argument("--kv-len", type=int, help="every batch's keys a sequence (default: "
                        "decode 1024, prefill 512)")
    parser.add_argument("--sliding-window", type=int, nargs="+", default=[0],
                        help="sliding windows to time, each in turn (0: none; not with --mla)")
    args = parser.parse_args()
    if args.mla and any(args.sliding_window):
        parser.error("--sliding-window: not with --mla")
    if args.kv_len is not None and args.kv_len < max(BATCHES[b][1] for b in args.batches):
        parser.error("--kv-len: at least each batch's new tokens (prefill: 512)")
    head_dim = args.head_dim or (576 if args.mla else 128)
    if args.mla:
        heads = dict(num_q_heads=args.num_q_heads, head_dim=head_dim)
        layout = f"latent attention, {args.num_q_heads} q heads, rows of {head_dim} " \
                 f"({args.value_dim} values)"
    else:
        heads = dict(num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                     head_dim=head_dim)
        layout = f"{args.num_q_heads} q heads, {args.num_kv_heads} kv heads, head dim {head_dim}"
    print(f"device: {jax.devices()[0].device_kind} ({platform}), {layout}, "
          f"page size {args.page_size}")
    if platform == "cpu":
        print(f"memory read bandwidth: {read_bandwidth() / 1e9:.1f} GB/s (a jitted sum over 512 MiB)")
    found = implementations(platform, latent=args.mla)
    print(f"{'dtype':<9} {'batch':<40} {'implementation':<28} {'ms':>9} {'GB/s':>9} {'TFLOP/s':>9}")
    batches = {name: BATCHES[name][:2] + (args.kv_len or BATCHES[name][2],)
               for name in args.batches}
    for dtype, window in [(d, w) for d in map(jnp.dtype, args.dtype) for w in args.sliding_window]:
        timed = {k: fn for k, fn in found.items() if k != WIDENED or dtype == jnp.bfloat16}
        for row in attention_timings(timed, batches, dtype=dtype, iters=args.iters,
                                     page_size=args.page_size, window=window,
                                     value_dim=args.value_dim if args.mla else None, **heads):
            print(f"{dtype.name:<9} {row['batch']:<40} {row['implementation']:<28} "
                  f"{row['ms']:9.3f} {row['gb_s']:9.1f} {row['tflop_s']:9.3f}", flush=True)


if __name__ == "__main__":
    main()
