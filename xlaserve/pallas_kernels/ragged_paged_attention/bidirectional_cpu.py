"""An encoder's attention on the CPU: `bidirectional_cpu.cc` as an XLA FFI custom call, with the
signature of `new_tokens.reference_new_token_attention(causal=False)` (the specification) but
no log-sum-exp (None: an encoder reads only the output); bfloat16 inputs are widened to float32.
Built by `xlaserve.native` when first traced; head dims that are not a multiple of 16, and a
machine where it does not build (no compiler: logged once), take the blocked jnp form.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.native.build import builds, register
from xlaserve.pallas_kernels.ragged_paged_attention import new_tokens

TARGET_NAME = "xlaserve_bidirectional_attention_cpu"
_SOURCE = Path(__file__).with_name("bidirectional_cpu.cc")


def load():
    """Builds and registers the custom call (once); raises KernelUnavailable."""
    return register(_SOURCE, "XlaserveBidirectionalAttention", TARGET_NAME)


@functools.cache
def _builds() -> bool:
    return builds(load, "The native CPU encoder attention is unavailable; XLA's blocked form runs it")


def bidirectional_attention(q, k, v, cu_q_lens, num_seqs, *, sm_scale, causal=False, window=0):
    """(out float32 [T, H, D], None): each token against its sequence's keys (at most `window`
    positions away where > 0); `causal` or other head dims: new_tokens' blocked form."""
    if causal or q.shape[-1] % 16 or k.shape != q.shape or not _builds():
        return new_tokens.blocked_new_token_attention(q, k, v, cu_q_lens, num_seqs,
                                                      sm_scale=sm_scale, causal=causal,
                                                      window=window)
    call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
               jnp.asarray(cu_q_lens, jnp.int32), jnp.asarray(num_seqs, jnp.int32),
               sm_scale=np.float32(sm_scale), window=np.int32(window))
    return out, None
