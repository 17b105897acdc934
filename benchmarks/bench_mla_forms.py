"""Multi-head latent attention for prefill, in its two forms, side by side:

    python benchmarks/bench_mla_forms.py [--seqs 2 --tokens 512 --dtype bfloat16]

- absorbed (what xlaserve serves, model/mla.py): each query taken into the latent space
  (q_nope @ W_UK), scored against 576-wide latent rows, the latent output times W_UV; the
  platform's kernel ("auto": native on CPU, Pallas on TPU/GPU) and the jnp reference;
- expanded (what SGLang and vLLM use for long prefills): each chunk of latent rows expanded into
  per-head keys [c W_UK, k_rope] (192 wide) and values c W_UV (128), then ordinary attention,
  here in jnp over the reference's paged chunks (`reference.attend_paged`);
- expanded, dense: the same expansion of the new rows alone (these are fresh prompts, so they are
  the whole context) into [seqs, tokens, heads, 192 / 128], then one fused causal attention,
  `jax.nn.dot_product_attention` (cuDNN's flash attention on a GPU, where it takes these widths;
  else XLA's): what a server's prefill does when a chunk has no cached prefix. It leaves the
  cache unwritten, a scatter of the new rows that the other forms do;
- expanded, as served (`--mla-expanded-prefill-tokens`, model/mla.py `expanded_attention`): the
  cached prefix absorbed (the platform's latent kernel with prefix_only; none here, these are
  fresh prompts) and the new tokens expanded (JAX's Pallas flash attention on a GPU, the blocked
  jnp form on CPU), merged by log-sum-exp.

Per (query, key) pair the absorbed form costs Hq x (576 + 512) multiply-adds and the expanded one
Hq x (192 + 128), plus the expansion, Hq x 512 x 256 per key read by each work item: for a long
prompt the expanded form does fewer FLOPs (2.8x for a 4K prompt of DeepSeek-V3). Which is faster
is a measurement per platform. Shapes: DeepSeek-V3 at tp 8 (16 heads; nope 128, RoPE 64, values
128, kv_lora 512), fresh prompts of `--tokens` each, 16-token pages. Prints each form's time and
the largest difference of its output from the first one's.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.model.layers import Kernels
from xlaserve.model.mla import expanded_attention
from xlaserve.pallas_kernels.ragged_paged_attention import api, cases, reference

HEADS, NOPE, ROPE, RANK, V_DIM, PAGE = 16, 128, 64, 512, 128, 16
SM_SCALE = (NOPE + ROPE) ** -0.5


def latent_query(q_nope, q_rope, w_uk, dtype):
    """The absorbed form's query, as model/mla.py makes it: q_nope @ W_UK, then the RoPE'd part."""
    q_latent = jnp.einsum("thn,hnr->thr", q_nope, w_uk, preferred_element_type=jnp.float32)
    return jnp.concatenate([q_latent.astype(dtype), q_rope], -1)


def absorbed(attention, w_uk, w_uv, dtype):
    def step(q_nope, q_rope, latent, cache, kv_lens, page_indices, cu_q_lens, num_seqs):
        query = latent_query(q_nope, q_rope, w_uk, dtype)
        out, cache = attention(query, latent, cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                               sm_scale=SM_SCALE, value_dim=RANK)
        return jnp.einsum("thr,hrv->thv", out, w_uv, preferred_element_type=jnp.float32), cache
    return jax.jit(step, donate_argnums=3)


def expanded(w_uk, w_uv, dtype):
    def read_chunk(cache, pages):
        rows = cache.at[pages].get(mode="clip").reshape(pages.shape[0], -1, cache.shape[-1])
        latent, k_rope = rows[..., :RANK], rows[..., RANK:RANK + ROPE]
        keys = jnp.einsum("wlr,hnr->wlhn", latent, w_uk, preferred_element_type=jnp.float32)
        keys = keys.astype(dtype)
        keys = jnp.concatenate([keys, jnp.broadcast_to(k_rope[:, :, None],
                                                        keys.shape[:3] + (ROPE,))], -1)
        values = jnp.einsum("wlr,hrv->wlhv", latent, w_uv, preferred_element_type=jnp.float32)
        return keys, values.astype(dtype)

    def step(q_nope, q_rope, latent, cache, kv_lens, page_indices, cu_q_lens, num_seqs):
        return reference.attend_paged(
            jnp.concatenate([q_nope, q_rope], -1), latent, cache, kv_lens, page_indices,
            cu_q_lens, num_seqs, num_kv_heads=HEADS, value_dim=V_DIM, read_chunk=read_chunk,
            sm_scale=SM_SCALE)
    return jax.jit(step, donate_argnums=3)


def expanded_dense(w_uk, w_uv, dtype, seqs):
    def step(q_nope, q_rope, latent, cache, *metadata):
        del metadata  # fresh prompts of one length: the new rows are each prompt's whole context
        rows = latent.reshape(seqs, -1, latent.shape[-1])
        c, k_rope = rows[..., :RANK], rows[..., RANK:RANK + ROPE]
        keys = jnp.einsum("slr,hnr->slhn", c, w_uk, preferred_element_type=jnp.float32)
        keys = jnp.concatenate([keys.astype(dtype), jnp.broadcast_to(
            k_rope[:, :, None], keys.shape[:3] + (ROPE,))], -1)
        values = jnp.einsum("slr,hrv->slhv", c, w_uv, preferred_element_type=jnp.float32)
        # cuDNN wants one head width for keys and values: pad the values with zeros.
        values = jnp.pad(values.astype(dtype), ((0, 0),) * 3 + ((0, NOPE + ROPE - V_DIM),))
        query = jnp.concatenate([q_nope, q_rope], -1).reshape(seqs, -1, HEADS, NOPE + ROPE)
        implementation = "cudnn" if jax.default_backend() == "gpu" else None
        out = jax.nn.dot_product_attention(query, keys, values, is_causal=True,
                                           scale=SM_SCALE, implementation=implementation)
        return out[..., :V_DIM].reshape(-1, HEADS, V_DIM), cache
    return jax.jit(step, donate_argnums=3)


def expanded_served(w_uk, w_uv):
    prefix, new = api.get_expanded_prefill_fns()
    kernels = Kernels(attention=None, latent_prefix_attention=prefix, new_token_attention=new)

    def step(q_nope, q_rope, latent, cache, *metadata):
        query = latent_query(q_nope, q_rope, w_uk, latent.dtype)
        return expanded_attention(q_nope, q_rope, (query, latent, cache, *metadata), w_uk, w_uv,
                                  kernels, kv_lora_rank=RANK, sm_scale=SM_SCALE)
    return jax.jit(step, donate_argnums=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512, help="new tokens of each prompt")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    pages = -(-args.tokens // PAGE)
    batch = cases.make_mla_case(rng, [(args.tokens, args.tokens)] * args.seqs,
                                num_q_heads=HEADS, row_dim=RANK + ROPE, max_seqs=args.seqs,
                                num_tokens=args.tokens * args.seqs, page_size=PAGE,
                                pages_per_seq=pages, num_pages=pages * args.seqs + 8)
    cache = jnp.asarray(np.nan_to_num(batch["kv_cache"]), dtype)
    metadata = [jnp.asarray(batch[k]) for k in ("kv_lens", "page_indices", "cu_q_lens",
                                                 "num_seqs")]
    tokens = args.tokens * args.seqs
    q_nope = jnp.asarray(rng.normal(0, 1, (tokens, HEADS, NOPE)), dtype)
    q_rope = jnp.asarray(batch["q"][..., RANK:], dtype)
    latent = jnp.asarray(batch["latent"], dtype)
    w_uk = jnp.asarray(rng.normal(0, 0.05, (HEADS, NOPE, RANK)), dtype)
    w_uv = jnp.asarray(rng.normal(0, 0.05, (HEADS, RANK, V_DIM)), dtype)
    platform_kernel = api.get_latent_attention_fn()
    forms = {"absorbed, platform kernel": absorbed(platform_kernel, w_uk, w_uv, dtype),
             "absorbed, jnp reference": absorbed(reference.mla_ragged_paged_attention, w_uk,
                                                 w_uv, dtype),
             "expanded, jnp": expanded(w_uk, w_uv, dtype),
             "expanded, dense": expanded_dense(w_uk, w_uv, dtype, args.seqs),
             "expanded, as served": expanded_served(w_uk, w_uv)}
    print(f"{jax.devices()[0].device_kind}: {args.seqs} prompts x {args.tokens} tokens, "
          f"{HEADS} heads, {args.dtype}")
    first = None
    for name, fn in forms.items():
        times = []
        try:
            for _ in range(args.iters + 1):  # the first call compiles
                start = time.perf_counter()
                out, _ = fn(q_nope, q_rope, latent, jnp.array(cache, copy=True), *metadata)
                out.block_until_ready()
                times.append(time.perf_counter() - start)
        except Exception as error:  # a form this platform cannot run (cuDNN's limits)
            print(f"  {name:28s} failed: {type(error).__name__}: {str(error)[:300]}")
            continue
        out = np.asarray(out, np.float32)
        first = out if first is None else first
        print(f"  {name:28s} {min(times[1:]) * 1e3:8.1f} ms   max |diff| "
              f"{np.abs(out - first).max():.2e} (outputs up to {np.abs(first).max():.2f})")


if __name__ == "__main__":
    main()
