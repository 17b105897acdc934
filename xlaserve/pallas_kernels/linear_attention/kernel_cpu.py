"""The gated delta rule of Gated DeltaNet layers on the CPU (issue 76): `kernel_cpu.cc` as an XLA
FFI custom call over a ragged step, its state pool updated in place, with reference.py's contract
and arithmetic (float32):

    out, pool = gated_delta_rule(q, k, v, g, beta, pool, state_slots, kv_lens, cu_q_lens, num_seqs,
                                 writes=None)   # writes: which sequences' slots take their state

q and k are normalized, q scaled and both repeated to the value heads here (elementwise, in
XLA); the kernel runs each (sequence, value head) over its rows with its state in a private
buffer, read and written once. The jnp reference's row loop moved the whole pool through memory
at each row. Built on first use by `xlaserve.native`; the reference runs where it cannot be.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from xlaserve.native.build import builds, register
from xlaserve.pallas_kernels.linear_attention import reference

TARGET_NAME = "xlaserve_gated_delta_rule_cpu"
_SOURCE = Path(__file__).with_name("kernel_cpu.cc")


def load():
    """Builds and registers the custom call (once); raises KernelUnavailable."""
    return register(_SOURCE, "XlaserveGatedDeltaRule", TARGET_NAME)


@functools.cache
def _builds() -> bool:
    return builds(load, "The native CPU gated delta rule is unavailable; the jnp reference runs it")


def gated_delta_rule(q, k, v, g, beta, state_pool, state_slots, kv_lens, cu_q_lens, num_seqs,
                     writes=None, form: str = "delta"):
    """reference.gated_delta_rule on the CPU: out [T, Hv, Dv] in v's dtype (padding rows zero),
    the pool (float32 [slots, Hv, Dk, Dv]) with each sequence's state after its last row (but
    where `writes` is 0); `form` "ssd": Mamba-2's scan (reference.py)."""
    if state_pool.dtype != jnp.float32 or not _builds():
        return reference.gated_delta_rule(q, k, v, g, beta, state_pool, state_slots, kv_lens,
                                          cu_q_lens, num_seqs, writes, form)
    q, k, v32, g, beta = (x.astype(jnp.float32)
                          for x in reference.prepared_inputs(q, k, v, g, beta, form=form))
    call = jax.ffi.ffi_call(
        TARGET_NAME, (jax.ShapeDtypeStruct(v32.shape, jnp.float32),
                      jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)),
        input_output_aliases={5: 1})
    out, pool = call(q, k, v32, g, beta, state_pool, *(jnp.asarray(x, jnp.int32) for x in (
        state_slots, kv_lens, cu_q_lens, num_seqs)), reference.all_writes(writes, state_slots),
                     delta=form == "delta")
    return out.astype(v.dtype), pool
