"""The kernels a forward pass runs with (`layers.Kernels`), picked for the platform: the
attention backend (see pallas_kernels/ragged_paged_attention/api.py); on a single CPU device, the
native GEMM over packed weights (xlaserve/native/gemm_cpu.cc), and the experts' grouped GEMM over
packed experts (native/grouped_gemm_cpu.cc); on TPU and GPU the Pallas gated delta rule of hybrid
models (pallas_kernels/linear_attention/), per device on a mesh; for experts not packed on the
CPU (on a mesh, or with `matmul_backend="xla"`), the grouped matmul in tiles (model/grouped_matmul.py); on GPU, the experts'
grouped matmul that multiplies only routed rows, gate_up's with the SwiGLU fused
(pallas_kernels/grouped_matmul_gpu.py), and on a
single GPU the block-scaled FP8 matmul of FP8 checkpoints (pallas_kernels/fp8_block_matmul.py).
Nemotron-H's Mamba-2 scan (`Kernels.mamba2_ssm`) runs on the same kernels, the rule without its
delta (pallas_kernels/mamba2/reference.py); on TPU only where its state's rows are whole lane
tiles (`tpu_mamba2_ssm`), else the jnp scan.

The native GEMM beat XLA's CPU dot at every row count measured on the default model's shapes
(AMD EPYC, float32): 2-2.5x for steps of 2-32 rows, where XLA runs at a third of the memory
bandwidth, and 5-20% at 64-512 rows. `matmul_backend="xla"` keeps XLA's dots (and the weights in
their own layout)."""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from xlaserve.model.grouped_matmul import grouped_matmul_ragged_dot, grouped_matmul_tiled
from xlaserve.model.layers import Kernels, norm_by_rows, swiglu_xla
from xlaserve.model.moe import expert_parallel
from xlaserve.model.sharding import DELTA_STATE_SPEC
from xlaserve.model.weight_types.int8 import QUANTIZED_TYPES
from xlaserve.model.weight_types.quantized_rows import QuantizedLinear
from xlaserve.native import gemm_cpu, norm_cpu, qkv_rope_cpu, swiglu_cpu
from xlaserve.native.build import KernelUnavailable
from xlaserve.pallas_kernels.linear_attention import kernel_cpu as linear_kernel_cpu
from xlaserve.pallas_kernels.linear_attention import kernel_gpu as linear_kernel_gpu
from xlaserve.pallas_kernels.linear_attention import kernel_tpu as linear_kernel_tpu
from xlaserve.pallas_kernels.linear_attention.reference import all_writes
from xlaserve.pallas_kernels.mamba2.reference import mamba2_ssm as mamba2_ssm_reference
from xlaserve.pallas_kernels.mamba2.reference import through_rule
from xlaserve.pallas_kernels.fp8_block_matmul import block_fp8_matmul
from xlaserve.pallas_kernels import (grouped_matmul_gpu, grouped_matmul_mxfp4, invariant_matmul,
                                     invariant_norm)
from xlaserve.pallas_kernels.ragged_paged_attention import bidirectional_cpu
from xlaserve.pallas_kernels.ragged_paged_attention.api import (fixed_work_items,
                                                                get_attention_fn,
                                                                get_expanded_prefill_fns,
                                                                get_latent_attention_fn)

logger = logging.getLogger(__name__)

MATMUL_BACKENDS = ("auto", "native", "xla")


def kernels_for(attention_backend: str = "auto", mesh: Mesh | None = None,
                matmul_backend: str = "auto", platform: str | None = None,
                mla_expanded_prefill_tokens: int = 0, deterministic: bool = False) -> Kernels:
    """`matmul_backend`: `auto` takes the native GEMM where it applies (a single CPU device, a
    compiler), `native` insists on it, `xla` keeps XLA's dots. `platform`: the one the step will
    be compiled for (default: JAX's default backend; "tpu" or "gpu" to compile for hardware that
    is not here, runtime/executor/aot.py). `mla_expanded_prefill_tokens`: steps of at least this many
    tokens take multi-head latent attention's expanded form (0: never; model/mla.py)."""
    platform = platform or jax.default_backend()
    if matmul_backend not in MATMUL_BACKENDS:
        raise ValueError(f"matmul backend {matmul_backend!r} is not one of {MATMUL_BACKENDS}")
    packed_matmul = None
    if matmul_backend != "xla":
        # A custom call is not split by XLA's partitioner: on a mesh the dots stay XLA's.
        applies = platform == "cpu" and (mesh is None or mesh.size == 1)
        if matmul_backend == "native" and not applies:
            raise ValueError("the native GEMM runs on a single CPU device only")
        if applies and _gemm_builds(required=matmul_backend == "native"):
            packed_matmul = gemm_cpu.packed_matmul
    kernels = Kernels(attention=get_attention_fn(attention_backend, mesh, platform=platform),
                      latent_attention=get_latent_attention_fn(attention_backend, mesh,
                                                               platform=platform),
                      packed_matmul=packed_matmul,
                      packed_grouped_matmul=(gemm_cpu.packed_grouped_matmul
                                             if packed_matmul is not None else None))
    # The latent kernel's prefix part: the expanded form's, and speculative tree rows' (mla.py).
    prefix, new = get_expanded_prefill_fns(attention_backend, mesh, platform=platform)
    bidirectional = functools.partial(new, causal=False)
    if platform == "cpu" and (mesh is None or mesh.size == 1) and attention_backend != "reference":
        # An encoder's attention: the native kernel, ~4x the blocked jnp form's speed (47 inputs
        # of ~40 tokens, 12 heads of 32: 6.4 against 25 ms a layer, 2-core AMD EPYC); built
        # when an encoder's step is first traced (a generation server never builds it), the
        # blocked form where it cannot be.
        bidirectional = bidirectional_cpu.bidirectional_attention
        # A hybrid model's gated delta rule: the native kernel, its state read and written once
        # a (sequence, head) (the reference's row loop moved the whole pool a row); built when
        # first traced, the reference where it cannot be.
        kernels = dataclasses.replace(kernels, gated_delta_rule=linear_kernel_cpu.gated_delta_rule,
                                      mamba2_ssm=through_rule(linear_kernel_cpu.gated_delta_rule))
    kernels = dataclasses.replace(kernels, latent_prefix_attention=prefix,
                                  bidirectional_attention=bidirectional)
    if mla_expanded_prefill_tokens > 0:
        kernels = dataclasses.replace(
            kernels, mla_expanded_prefill_tokens=mla_expanded_prefill_tokens,
            new_token_attention=new)
    if platform in ("tpu", "gpu"):
        # The gated delta rule's Pallas kernel, each (sequence, heads) state kept on chip over
        # its rows (the reference's row loop moved the whole pool a row); on a mesh, each device
        # on its own heads.
        rule = split_by_value_head(
            {"tpu": linear_kernel_tpu, "gpu": linear_kernel_gpu}[platform].gated_delta_rule, mesh)
        scan = through_rule(rule) if platform == "gpu" else tpu_mamba2_ssm(through_rule(rule))
        kernels = dataclasses.replace(kernels, gated_delta_rule=rule, mamba2_ssm=scan)
    if platform == "gpu" and (mesh is None or mesh.size == 1):
        # A custom call is not split by XLA's partitioner: on a mesh, FP8 checkpoints with block
        # scales are dequantized at load (weights/kept_quantized/fp8_kept.py) and this stays None.
        kernels = dataclasses.replace(kernels, fp8_block_matmul=block_fp8_matmul)
    if mesh is not None and mesh.size > 1:
        # The experts under shard_map on any mesh, expert axis or not: left to XLA's partitioner,
        # the [E, hidden, 2, I] gate_up split over I became an all-gather of every layer's whole
        # experts each step (Qwen3-30B-A3B, v6e, tp 4: 805 MB a layer).
        kernels = dataclasses.replace(kernels, run_experts=expert_parallel(mesh))
    if platform == "gpu":
        # XLA's GPU ragged_dot multiplies every row by every expert, G / top_k times the routed
        # FLOPs (pallas_kernels/grouped_matmul_gpu.py). Under shard_map on a mesh: per device.
        kernels = dataclasses.replace(
            kernels, grouped_matmul=gpu_grouped_matmul, grouped_swiglu=gpu_grouped_swiglu,
            mxfp4_grouped_matmul=grouped_matmul_mxfp4.grouped_matmul_mxfp4)
    if platform == "gpu":
        # Not on TPU: rounded, the v6e tp 4 step relaid Llama-3.1-8B's qkv weight out every
        # step (tests/executor/test_predicted_costs.py's weight copies).
        kernels = dataclasses.replace(kernels, round_projections=True)
    if platform == "tpu":
        kernels = dataclasses.replace(kernels, gate_up_as_groups=True, lora_add_apart=True)
    if platform == "cpu":
        # XLA's CPU ragged_dot multiplies every row by every expert (model/grouped_matmul.py).
        kernels = dataclasses.replace(kernels, grouped_matmul=grouped_matmul_tiled)
    if packed_matmul is not None and _elementwise_builds():
        # The norms, RoPE and the activation go with the GEMM: where XLA's dots are kept, so are
        # XLA's fusions.
        kernels = dataclasses.replace(kernels, rms_norm=norm_cpu.rms_norm,
                                      add_rms_norm=norm_cpu.add_rms_norm,
                                      qkv_rope=qkv_rope_cpu.qkv_rope, swiglu=swiglu_cpu.swiglu,
                                      packed_matmul_swiglu=gemm_cpu.packed_matmul_swiglu)
    if deterministic and attention_backend == "reference":  # the jnp form: batched shapes
        raise ValueError("--enable-deterministic-inference takes the platform's attention "
                         "kernel, not --attention-backend reference")
    if deterministic and mesh is not None and mesh.size > 1:
        raise ValueError("--enable-deterministic-inference runs on one device (its kernels are "
                         "custom calls that XLA's partitioner does not split)")
    return deterministic_kernels(kernels, platform) if deterministic else kernels


def check_deterministic_model(config, model) -> None:
    """ValueError for what --enable-deterministic-inference has not been made row-invariant:
    mixtures of experts (their routing's XLA reductions), weights kept quantized (the quantized
    GEMMs' tiles), and the parts whose norms and matmuls do not go through the kernels: latent
    attention's, per-layer inputs' and vision towers'."""
    for present, what in ((config.num_experts, "a mixture of experts"),
                          (config.mla, "multi-head latent attention"),
                          (config.per_layer_input_size, "per-layer inputs (Gemma 4)"),
                          (config.vision, "a vision tower")):
        if present:
            raise ValueError(f"--enable-deterministic-inference with {what} is not built (its "
                             "norms and matmuls are not yet row-invariant)")
    quantized = (QuantizedLinear, *QUANTIZED_TYPES)
    leaves = jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, quantized))
    if any(isinstance(leaf, quantized) for leaf in leaves):
        raise ValueError("--enable-deterministic-inference with quantized weights (a GGUF's "
                         "blocks, --quantization) is not built: serve a float or bfloat16 "
                         "checkpoint")


def deterministic_kernels(kernels: Kernels, platform: str = "cpu",
                          interpret: bool = False) -> Kernels:
    """`kernels` whose results for a row do not depend on the other rows of its step
    (--enable-deterministic-inference). XLA's own dots and fused row reductions do depend on
    them (measured on the CPU: a [M, 576] RMSNorm's rows differ in the last bits between M = 1
    and M = 23, a dot's from M = 2, a [M, 16, 128] q norm's at M = 256; on GPU its GEMMs choose
    tiles and split-K from M): the matmuls and norms go through kernels of fixed tiles. On a
    single CPU device the native ones, the GEMMs with Invariant tiles (native/gemm_tiles.h);
    on TPU and GPU (or `interpret`ed here, for tests) the Pallas ones
    (pallas_kernels/invariant_matmul.py, invariant_norm.py), and the Pallas attention kernels
    with work items, KV blocks and (GPU) KV splits of fixed sizes (api.fixed_work_items). The CPU
    attention kernel's rows are independent already (its key blocks sit at fixed positions:
    tests/kernels/test_batch_invariant_attention.py). ValueError where they do not all
    apply."""
    if platform in ("tpu", "gpu"):
        norm, add_norm = invariant_norm.for_platform(platform, interpret)
        return dataclasses.replace(
            kernels, deterministic=True,
            attention=functools.partial(fixed_work_items, kernels.attention, platform),
            dense_matmul=invariant_matmul.for_platform(platform, interpret),
            rms_norm=norm, add_rms_norm=add_norm,
            module_norm=functools.partial(norm_by_rows, norm))
    if kernels.packed_matmul is None or kernels.packed_matmul_swiglu is None:  # natives off
        raise ValueError("--enable-deterministic-inference runs on a single CPU device with the "
                         "native GEMM and kernels (not --matmul-backend xla) or on one TPU or GPU")
    invariant = dict(invariant=True)
    return dataclasses.replace(
        kernels, deterministic=True,
        module_norm=functools.partial(norm_by_rows, kernels.rms_norm),
        packed_matmul=functools.partial(kernels.packed_matmul, **invariant),
        packed_matmul_swiglu=functools.partial(kernels.packed_matmul_swiglu, **invariant),
        packed_grouped_matmul=functools.partial(kernels.packed_grouped_matmul, **invariant))


def tpu_mamba2_ssm(pallas_scan):
    """Mamba-2's scan on TPU: the Pallas rule's where a state's rows are whole lane tiles
    (head_dim a multiple of 128), else the jnp scan. XLA lays a [state N, head_dim 64] pool out
    with N minor (no lane padding) where the kernel reads it row-major: every layer's pool was
    relaid out into the kernel and back each step (Nemotron-3-Nano at v6e tp 8: 1.45 GiB of
    temporaries against 0.17; Nemotron-H-56B's (512, 64) step out of memory, 34 GiB)."""

    @functools.wraps(pallas_scan)
    def mamba2_ssm(x, dt, A, B, C, D, state_pool, *rest):
        scan = pallas_scan if state_pool.shape[-1] % 128 == 0 else mamba2_ssm_reference
        return scan(x, dt, A, B, C, D, state_pool, *rest)

    return mamba2_ssm


def split_by_value_head(rule, mesh: Mesh | None):
    """A gated delta rule (reference.gated_delta_rule's signature) under shard_map on a mesh:
    each device runs it on its own heads and their slots' states, split as the layer splits
    them (model/sharding.py: value heads and the key heads they read contiguous, the pool by
    DELTA_STATE_SPEC); the step's metadata whole on every device. XLA's partitioner does not
    split a custom call. `rule` itself on one device."""
    if mesh is None or mesh.size == 1:
        return rule
    heads = DELTA_STATE_SPEC[1]
    rows, per_head = P(None, heads, None), P(None, heads)

    @functools.wraps(rule)
    def sharded(q, k, v, g, beta, state_pool, state_slots, kv_lens, cu_q_lens, num_seqs,
                writes=None, form="delta"):
        return jax.shard_map(functools.partial(rule, form=form), mesh=mesh,
                             in_specs=(rows, rows, rows, per_head, per_head, DELTA_STATE_SPEC)
                             + (P(),) * 5, out_specs=(rows, DELTA_STATE_SPEC), check_vma=False)(
            q, k, v, g, beta, state_pool, state_slots, kv_lens, cu_q_lens, num_seqs,
            all_writes(writes, state_slots))

    return sharded


def gpu_grouped_matmul(x: jax.Array, weights: jax.Array, group_sizes: jax.Array,
                       out_dtype=jnp.float32) -> jax.Array:
    """The GPU grouped matmul where it `supports` the experts' shape, else XLA's ragged_dot (the
    same product, every expert's FLOPs), logged when the step is traced."""
    problem = grouped_matmul_gpu.supports(x.shape[1], weights.shape[2])
    if problem is None:
        return grouped_matmul_gpu.grouped_matmul_gpu(x, weights, group_sizes, out_dtype=out_dtype)
    logger.warning("%s: the experts run as XLA's ragged_dot, a dot over every expert", problem)
    return grouped_matmul_ragged_dot(x, weights, group_sizes, out_dtype)


def gpu_grouped_swiglu(x: jax.Array, gate_up: jax.Array, group_sizes: jax.Array,
                       out_dtype=jnp.float32) -> jax.Array:
    """The GPU grouped matmul of gate_up [E, K, 2, I] with the SwiGLU fused, where it `supports`
    the shape; else the grouped matmul and XLA's SwiGLU."""
    experts, k, _, n = gate_up.shape
    if grouped_matmul_gpu.supports(k, n) is None:
        return grouped_matmul_gpu.grouped_swiglu_gpu(x, gate_up, group_sizes, out_dtype)
    both = gpu_grouped_matmul(x, gate_up.reshape(experts, k, -1), group_sizes, out_dtype)
    return swiglu_xla(both.reshape(-1, 2, n), out_dtype)


@functools.cache
def _gemm_builds(required: bool = False) -> bool:
    try:
        gemm_cpu.load()
        return True
    except KernelUnavailable as error:
        if required:
            raise
        logger.warning("The native CPU GEMM is unavailable; matmuls use XLA's dots, 2-2.5x slower "
                       "for decode steps of 2-32 rows: %s", error)
        return False


@functools.cache
def _elementwise_builds() -> bool:
    try:
        norm_cpu.load()
        qkv_rope_cpu.load()
        swiglu_cpu.load()
        return True
    except KernelUnavailable as error:
        logger.warning("The native CPU RMSNorm, RoPE and SwiGLU are unavailable; XLA's fusions run "
                       "them: %s", error)
        return False
