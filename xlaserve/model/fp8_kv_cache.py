"""An FP8 KV cache (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`, SGLang's and vLLM's names): each
layer's new K and V rows are divided by the layer's per-tensor scale (`k_scale`, `v_scale`: the
checkpoint's, weights/kv_scales.py, else 1.0), clipped to the format's finite range and stored as
one byte an entry; twice the tokens of a bfloat16 cache in the same memory.

The kernels take the FP8 rows and widen them to the queries' dtype before each dot
(`pallas_kernels/ragged_paged_attention/reference.widened`); the scales never reach them: a
key's scale multiplies every score, so it joins the softmax scale (`sm_scale * k_scale`), and a
value's scale multiplies the output (`out * v_scale`), as vLLM's and SGLang's kernels fold them.
Multi-head latent attention keeps one latent row per token, its keys and values both: it takes
the layer's `k_scale` for both halves.

Quantization error: e4m3 keeps 3 mantissa bits (relative step 1/16), e5m2 2 bits (1/8) with a
wider range; docs/server.md has the measured logit differences against a bfloat16 cache."""
from __future__ import annotations

import jax.numpy as jnp

# The flag's values; "fp8" is vLLM's name for e4m3.
KV_CACHE_DTYPES = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
ALIASES = {"fp8": "fp8_e4m3"}


def resolve_kv_cache_dtype(name: str, model_dtype) -> jnp.dtype:
    """The KV cache's dtype for `--kv-cache-dtype name`: "auto" is the model's."""
    if name == "auto":
        return jnp.dtype(model_dtype)
    name = ALIASES.get(name, name)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name}: choose auto, {', '.join(KV_CACHE_DTYPES)}")
    return jnp.dtype(KV_CACHE_DTYPES[name])


def is_fp8(dtype) -> bool:
    """Whether a cache of `dtype` holds FP8 rows (scaled, one byte an entry)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def rescaled(x, scale: float):
    """`x` times an FP8 cache's `scale` (in float32, back in x's dtype); `x` itself at 1.0."""
    if scale == 1.0:
        return x
    return (x.astype(jnp.float32) * scale).astype(x.dtype)


def quantize(x, scale: float, dtype):
    """x / scale in the FP8 `dtype`, clipped to its finite range first: e4m3fn has no infinity,
    so a value past 448 would otherwise become NaN (and e5m2's 57344 an infinity)."""
    limit = float(jnp.finfo(dtype).max)
    x = x.astype(jnp.float32)
    if scale != 1.0:
        x = x * (1.0 / scale)
    return jnp.clip(x, -limit, limit).astype(dtype)
