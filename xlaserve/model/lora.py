"""LoRA adapters inside the serving step (issue 53): every loaded adapter's low-rank matrices sit
in fixed device slots, and each token row adds the product of its own adapter's, so rows of
different adapters (and rows of none) share one batch and one program.

Shapes. `LoraSpec` fixes them: `max_loras` adapter slots, every rank padded to `max_rank` (a
padded rank's rows and columns are zeros: they add nothing), the target modules. A fused
projection (qkv, gate_up) is multiplied by its modules' A matrices at once, side by side:

    a [K, slots * modules * rank]           one shrink: x @ a
    b [slots * rank, N of the module]       one expand per module, into its part of the output

stored 2-D as the masked form multiplies them (on TPU, merging a tiled array's axes is a copy;
the grouped form packs each slot's, below), with B
already scaled (lora_alpha / r, or / sqrt(r) for rsLoRA). Loading or unloading an adapter writes
or zeroes its slot of these arrays (runtime/executor/lora_slots.py): same shapes, no compile.

The product, in one of two forms (`LoraSpec.grouped`; ModelRunner picks).

Masked (TPU, GPU, a mesh, or `--matmul-backend xla`): each token's adapter (0: none; slot s
holds adapter s + 1) becomes a one-hot mask over the slots, and the shrink's columns of the
other slots are zeroed before the expand:

    delta = ((x @ a) * mask) @ b            [T, K] -> [T, slots * r] -> [T, N]

All slots are multiplied for every token (2 T (K + N) slots r flops), dense, with no sort of the
rows, and tensor parallelism shards it as XLA shards any dot (a, b sharded like their base
weight: the output axis split where the base splits it, the input axis where the base's input
is split). On TPU the delta is added apart from the base matmul (`Kernels.lora_add_apart`).

Grouped (a single CPU device with the native GEMM): the rows sorted by adapter once a step
(`Grouping`), each group times its own slot's a and b through the native grouped GEMM over
packed slots, rows of no adapter past the groups (zeros), sorted back: 2 T (K + N) r flops, a
slot nobody uses never read. The slots are stored packed (`gemm_cpu.pack_columns` per slot).

A step with no adapter row skips the product on the CPU (`lax.cond`); on TPU and GPU a
conditional is a host sync mid-step, so a server with adapters computes it in every step. What
it costs (docs/performance.md, "LoRA adapters"): on 2 CPU cores, the default model at 64
requests runs 0.82x the base model's tokens/s with adapter rows in the grouped form (0.62x in
the masked form, side by side); predicted for Llama-3.1-8B at 64 rows, 0.92x on an H100 and
0.63x on v6e.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from xlaserve.server_args import TARGET_MODULES
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.sharding import TP
from xlaserve.native import gemm_cpu

# Each fused projection of our layout and the PEFT target modules it holds, in order.
PROJECTIONS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
assert TARGET_MODULES == tuple(module for modules in PROJECTIONS.values() for module in modules)
ATTENTION_MODULES = PROJECTIONS["qkv"] + PROJECTIONS["o_proj"]
MLP_MODULES = PROJECTIONS["gate_up"] + PROJECTIONS["down"]

# Partition specs: a's input axis split where the base weight's input is (o_proj's heads,
# down's intermediate), b's output axes where the base weight's are (qkv's kv heads, gate and
# up's intermediate).
# q, k and v's N is [kv heads, heads a group, head_dim] flattened, kv heads first: split on it,
# each device's block is its kv heads'.
A_SPECS = {"qkv": P(), "o_proj": P(TP, None), "gate_up": P(), "down": P(TP, None)}
B_SPECS = {"q_proj": P(None, TP), "k_proj": P(None, TP), "v_proj": P(None, TP), "o_proj": P(),
           "gate_proj": P(None, TP), "up_proj": P(None, TP), "down_proj": P()}


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The adapter slots' static shape: part of the step program."""

    max_loras: int  # slots: adapters one batch (and the server) holds at once
    max_rank: int  # every adapter's rank padded to this
    target_modules: tuple[str, ...]  # of TARGET_MODULES, in its order
    # The grouped form (a single CPU device with the native GEMM; ModelRunner decides): slots
    # stored as the native GEMM's panels, each row multiplied by its own adapter's matrices only.
    grouped: bool = False

    def __post_init__(self):
        unknown = set(self.target_modules) - set(TARGET_MODULES)
        if unknown:
            raise ValueError(f"LoRA target modules {sorted(unknown)} are not supported; "
                             f"supported: {', '.join(TARGET_MODULES)}")
        if self.max_loras < 1 or self.max_rank < 1:
            raise ValueError(f"--max-loras-per-batch and --max-lora-rank must be at least 1 "
                             f"(got {self.max_loras}, {self.max_rank})")
        object.__setattr__(self, "target_modules",
                           tuple(m for m in TARGET_MODULES if m in self.target_modules))

    def projections(self) -> dict[str, tuple[str, ...]]:
        """Each fused projection with a targeted module: its targeted modules, in order."""
        out = {}
        for projection, modules in PROJECTIONS.items():
            targeted = tuple(m for m in modules if m in self.target_modules)
            if targeted:
                out[projection] = targeted
        return out


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each target module's (input width, output axes in our fused layout's part)."""
    c = config
    inter = c.intermediate_size
    return {"q_proj": (c.hidden_size, (c.num_kv_heads, c.queries_per_kv, c.head_dim)),
            "k_proj": (c.hidden_size, (c.num_kv_heads, 1, c.head_dim)),
            "v_proj": (c.hidden_size, (c.num_kv_heads, 1, c.head_dim)),
            "o_proj": (c.num_heads * c.head_dim, (c.hidden_size,)),
            "gate_proj": (c.hidden_size, (inter,)), "up_proj": (c.hidden_size, (inter,)),
            "down_proj": (inter, (c.hidden_size,))}


def check_model(config: ModelConfig, spec: LoraSpec) -> None:
    """A model whose targeted modules are not plain matrices of our layout stops here."""
    if config.mla is not None and set(spec.target_modules) & set(ATTENTION_MODULES):
        raise ValueError("LoRA on multi-head latent attention (DeepSeek's q/kv projections) is "
                         "not supported: target the MLP modules only")
    if config.rope_interleaved and set(spec.target_modules) & {"q_proj", "k_proj"}:
        raise ValueError("LoRA on q_proj or k_proj of a model whose RoPE rotates interleaved "
                         "pairs (Llama 4: its q and k rows are reordered at load) is not "
                         "supported: target v_proj and o_proj only")
    if any(config.value_is_key) and set(spec.target_modules) & {"k_proj", "v_proj"}:
        raise ValueError("LoRA on k_proj or v_proj of a model whose values are its keys' "
                         "projection (Gemma 4's attention_k_eq_v) is not supported: target "
                         "q_proj, o_proj and the MLP")
    if any(copies > 1 for copies in config.kv_replicas) and \
            set(spec.target_modules) & {"k_proj", "v_proj"}:
        raise ValueError("LoRA on k_proj or v_proj of a model whose KV heads are copied over "
                         "more devices than it has (--tp-size above its KV heads) is not "
                         "supported: target q_proj, o_proj and the MLP, or a --tp-size that "
                         "divides its KV heads")
    if len(config.cache_layers) < config.num_layers and \
            set(spec.target_modules) & set(ATTENTION_MODULES):
        raise ValueError("LoRA on the attention of a model whose later layers read earlier "
                         "layers' KV caches (Gemma 4's num_kv_shared_layers) is not supported: "
                         "target the MLP (--lora-target-modules gate_proj up_proj down_proj)")
    if len(set(config.layer_heads)) > 1 and set(spec.target_modules) & set(ATTENTION_MODULES):
        raise ValueError("LoRA on the attention of a model whose layers differ in head size or "
                         "KV heads (Gemma 4's full layers) is not supported: target the MLP "
                         "(--lora-target-modules gate_proj up_proj down_proj)")
    if any(config.moe_layers) and set(spec.target_modules) & set(MLP_MODULES):
        raise ValueError("LoRA on a mixture-of-experts model's MLP (its experts) is not "
                         "supported: target the attention modules only "
                         "(--lora-target-modules q_proj k_proj v_proj o_proj)")


def slot_shapes(config: ModelConfig, spec: LoraSpec) -> list[tuple[str, tuple, P]]:
    """(name, shape, partition spec) of every slot array, in the order the step takes them:
    per layer, per projection, its a then its modules' b; names "layers.{i}.{projection}.a" and
    "layers.{i}.{module}.b". Grouped: slot s's a [K, modules * rank] and b [rank, N] each packed
    as the native GEMM packs a weight (`gemm_cpu.pack_columns`), stacked over the slots."""
    shapes = module_shapes(config)
    lanes = gemm_cpu.panel_width() if spec.grouped else 0
    out = []
    for layer in range(config.num_layers):
        for projection, modules in spec.projections().items():
            width, columns = shapes[modules[0]][0], len(modules) * spec.max_rank
            out.append((f"layers.{layer}.{projection}.a",
                        (spec.max_loras, -(-columns // lanes), width, lanes) if spec.grouped
                        else (width, spec.max_loras * columns),
                        P() if spec.grouped else A_SPECS[projection]))
            for module in modules:
                n = math.prod(shapes[module][1])
                out.append((f"layers.{layer}.{module}.b",
                            (spec.max_loras, -(-n // lanes), spec.max_rank, lanes) if spec.grouped
                            else (spec.max_loras * spec.max_rank, n),
                            P() if spec.grouped else B_SPECS[module]))
    return out


def scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    """PEFT's scale of B @ A: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


@dataclasses.dataclass
class Grouping:
    """The grouped form's rows: sorted by adapter, rows of none last (past the groups, where the
    grouped matmul gives zeros)."""

    order: jax.Array  # i32[T]: the sorted rows' original rows
    inverse: jax.Array  # i32[T]: each original row's place in the sorted order
    sizes: jax.Array  # i32[slots]: rows of each adapter slot
    matmul: Callable  # gemm_cpu.packed_grouped_matmul's contract


@dataclasses.dataclass
class LayerLora:
    """One layer's slot arrays and the step's token mask, as the layer's projections use them."""

    projections: dict[str, tuple[jax.Array, dict[str, jax.Array]]]  # projection -> (a, {module: b})
    mask: jax.Array  # [T, slots] 1.0 where the token's adapter is the slot's
    active: jax.Array | None  # bool scalar: some token has an adapter (None: compute anyway)
    rank: int
    grouping: Grouping | None = None  # the grouped form's (None: the masked form)

    def delta(self, projection: str, x: jax.Array, output_axes: tuple[int, ...]) -> jax.Array | None:
        """float32 [T, *output_axes]: what the rows' adapters add to the projection of x; None
        where no adapter targets it."""
        if projection not in self.projections:
            return None
        a, bs = self.projections[projection]

        def compute():
            if self.grouping is not None:
                return _grouped_delta(x, a, bs, self.grouping, projection, output_axes,
                                      self.rank)
            return _projection_delta(x, a, bs, self.mask, projection, output_axes, self.rank)

        if self.active is None:
            return compute()
        return jax.lax.cond(self.active, compute,
                            lambda: jnp.zeros((x.shape[0], *output_axes), jnp.float32))


def _projection_delta(x, a, bs, mask, projection, output_axes, rank):
    """a [K, slots * modules * rank], bs {module: [slots * rank, N]} -> float32 [T, *output_axes]."""
    tokens, slots = x.shape[0], mask.shape[1]
    shrunk = jax.lax.dot_general(x.astype(a.dtype), a, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    # Each token keeps its own slot's columns: [T, slots, modules, rank] masked per slot.
    shrunk = shrunk.reshape(tokens, slots, -1, rank) * mask[:, :, None, None]
    parts = []
    for module in PROJECTIONS[projection]:
        if module not in bs:
            parts.append(None)
            continue
        b = bs[module]
        h = shrunk[:, :, list(bs).index(module)].reshape(tokens, slots * rank).astype(b.dtype)
        parts.append(jax.lax.dot_general(h, b, (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32))
    return _assemble(projection, parts, tokens, output_axes)


def _grouped_delta(x, a, bs, grouping, projection, output_axes, rank):
    """The grouped form: x's rows sorted by adapter, group s times slot s's packed a, then each
    module's rank columns times its packed b; rows of no adapter come out zero. Each row does
    its own adapter's flops alone (the masked form does every slot's); sorted back at the end."""
    g = grouping
    shrunk = g.matmul(x[g.order], a, g.sizes, len(bs) * rank)  # float32 [T, modules * rank]
    widths = _module_widths(projection, output_axes)
    columns = {module: slice(j * rank, (j + 1) * rank) for j, module in enumerate(bs)}
    parts = [None if module not in bs else
             g.matmul(shrunk[:, columns[module]], bs[module], g.sizes, widths[module])
             for module in PROJECTIONS[projection]]
    return _assemble(projection, parts, x.shape[0], output_axes)[g.inverse]


def _module_widths(projection, output_axes) -> dict[str, int]:
    """Each module's N in the fused projection's output axes."""
    if projection in ("o_proj", "down"):
        return {PROJECTIONS[projection][0]: math.prod(output_axes)}
    if projection == "gate_up":
        return {"gate_proj": output_axes[-1], "up_proj": output_axes[-1]}
    kv_heads, width, head_dim = output_axes
    return {"q_proj": kv_heads * (width - 2) * head_dim, "k_proj": kv_heads * head_dim,
            "v_proj": kv_heads * head_dim}


def _assemble(projection, parts, tokens, output_axes):
    """The modules' products in the fused projection's output layout (zeros for the untargeted)."""
    if projection in ("o_proj", "down"):
        return parts[0].reshape(tokens, *output_axes)
    if projection == "gate_up":  # [T, 2, I]
        inter = output_axes[-1]
        return jnp.stack([jnp.zeros((tokens, inter), jnp.float32) if p is None else p
                          for p in parts], axis=1)
    kv_heads, width, head_dim = output_axes  # qkv: [T, kv heads, group + 2, head_dim]
    sizes = (width - 2, 1, 1)
    return jnp.concatenate([
        jnp.zeros((tokens, kv_heads, size, head_dim), jnp.float32) if p is None
        else p.reshape(tokens, kv_heads, size, head_dim) for p, size in zip(parts, sizes)],
        axis=2)


@dataclasses.dataclass
class LoraBatch:
    """A step's LoRA inputs: every layer's slot arrays and the token mask."""

    layers: list[dict[str, tuple[jax.Array, dict[str, jax.Array]]]]
    mask: jax.Array
    active: jax.Array | None
    rank: int
    grouping: Grouping | None = None

    def layer(self, index: int) -> LayerLora:
        return LayerLora(self.layers[index], self.mask, self.active, self.rank, self.grouping)


def lora_batch(spec: LoraSpec, num_layers: int, arrays: list[jax.Array],
               slot_adapters: jax.Array, token_slots: jax.Array, *, skip_idle: bool,
               dtype, grouped_matmul: Callable | None = None) -> LoraBatch:
    """The step's LoraBatch from `slot_arrays`' arrays in `slot_shapes` order, each request
    slot's adapter (`slot_adapters` i32[request slots], 0: none) and each token's request slot.
    `skip_idle`: the product runs under a conditional on whether any token has an adapter (the
    CPU's programs). `grouped_matmul`: the grouped form's (`spec.grouped`) packed grouped matmul."""
    adapters = slot_adapters[token_slots]  # i32[T]; 0: none, s + 1: slot s
    mask = jax.nn.one_hot(adapters - 1, spec.max_loras, dtype=dtype)  # -1: a row of zeros
    grouping = None
    if spec.grouped:
        if grouped_matmul is None:
            raise ValueError("grouped LoRA slots need the native grouped GEMM")
        order = jnp.argsort(jnp.where(adapters > 0, adapters, spec.max_loras + 1), stable=True)
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        sizes = jnp.bincount(adapters, length=spec.max_loras + 1)[1:].astype(jnp.int32)
        grouping = Grouping(order, inverse, sizes, grouped_matmul)
    layers, at = [], 0
    for _ in range(num_layers):
        layer = {}
        for projection, modules in spec.projections().items():
            a = arrays[at]
            bs = dict(zip(modules, arrays[at + 1:at + 1 + len(modules)]))
            at += 1 + len(modules)
            layer[projection] = (a, bs)
        layers.append(layer)
    return LoraBatch(layers, mask, jnp.any(adapters > 0) if skip_idle else None, spec.max_rank,
                     grouping)


def token_request_slots(cu_q_lens: jax.Array, slots: jax.Array, num_tokens: int) -> jax.Array:
    """i32[T]: each token row's request slot (the sequence whose rows hold it; the padding rows
    after the last sequence take the last row's slot, whose output nothing reads)."""
    # compare_all: a [T, S] comparison; the default (a scan) is a while loop, which on a GPU
    # reads its trip count on the host mid-step (the H100 step had one).
    seq = jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens, dtype=cu_q_lens.dtype),
                           side="right", method="compare_all")
    return slots[jnp.minimum(seq, slots.shape[0] - 1)]
