"""The serving step as a pure function, and the host arrays it is called with.

`make_step` is the jitted step (forward, sampling, penalty counts, last tokens, the page table's
writes) over flat weight arguments, so that it can also be compiled for hardware that is not here (runtime/executor/aot.py);
`step_vectors` packs a batch's host arrays into the step's vectors; `idle_step` / `idle_vectors`
are a bucket's all-padding inputs, which the precompile and the ahead-of-time compiles lower the
step with. ModelRunner (model_runner.py) owns the device state and calls these.

One host-to-device transfer per dtype for a step's inputs (`concat_leaves`, `split_leaves`): a
step's inputs are ~20 small numpy arrays (the batch, the sampling parameters, the slots). Sent
one by one, `jax.device_put` and the jit call spent ~3 ms per step on them on a 2-core CPU, a
tenth of a single stream's 1-token step. Here every leaf goes into one int32 or one float32
vector on the host (bool and uint32 leaves as int32), and the jitted step slices them back out
with static offsets: two transfers, and the layout is part of the program's static arguments, so
each bucket still compiles once.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.runtime.executor.forward_batch import ForwardBatch
from xlaserve.runtime.executor.page_table import (PageWrites, apply_writes, empty_writes, gather_rows,
                                         write_capacity)
from xlaserve.runtime.executor.draft_head_step import catch_up_head
from xlaserve.runtime.executor.verified_rows import (kept_path_moves, kept_rows,
                                                     move_kv_entries, prior_draft_ids,
                                                     tree_kept_rows, tree_prior_draft_ids)
from xlaserve.runtime.executor.weight_args import leaves_from_args
from xlaserve.model.lora import LoraSpec, lora_batch, token_request_slots
from xlaserve.model.sharding import TP
from xlaserve.model.transformer import AttentionMetadata, rope_cos_sin
from xlaserve.runtime.sampling.params import (MAX_LOGIT_BIAS, MAX_SUPPRESSED_IDS, MAX_TOP_LOGPROBS,
                                     RowSamplingParams)
from xlaserve.runtime.sampling.prompt_logprobs import NO_TARGET, PromptLogprobs, prompt_logprobs
from xlaserve.runtime.sampling.sampler import (SampleOutput, SamplingMetadata, add_sampled,
                                      build_sampling_metadata, sample)
from xlaserve.runtime.sampling.step_needs import RUN_TIME, StepNeeds, part

# --- a step's inputs as one int32 and one float32 vector ------------------------------------

_INT, _FLOAT = "int32", "float32"
# dtype -> (buffer, name); a dict lookup, where `dtype.name` costs ~5 us per leaf per step.
_PLACES = {np.dtype(np.float32): (_FLOAT, "float32"), np.dtype(np.int32): (_INT, "int32"),
           np.dtype(np.uint32): (_INT, "uint32"), np.dtype(np.bool_): (_INT, "bool")}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a pytree lives in the two vectors (hashable: a static argument)."""

    treedef: Any
    leaves: tuple[tuple[str, int, tuple[int, ...], str], ...]  # (buffer, offset, shape, dtype)


def concat_leaves(tree) -> tuple[np.ndarray, np.ndarray, Layout]:
    """(int32 vector, float32 vector, layout) holding every numpy leaf of `tree`."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = {_INT: [], _FLOAT: []}
    sizes = {_INT: 0, _FLOAT: 0}
    placed = []
    for leaf in leaves:
        leaf = np.asarray(leaf)
        if leaf.dtype not in _PLACES:
            raise TypeError(f"cannot transfer a {leaf.dtype} leaf")
        buffer, dtype_name = _PLACES[leaf.dtype]
        flat = leaf.reshape(-1)
        if dtype_name == "uint32":
            flat = flat.view(np.int32)
        elif dtype_name == "bool":
            flat = flat.astype(np.int32)
        placed.append((buffer, sizes[buffer], leaf.shape, dtype_name))
        parts[buffer].append(flat)
        sizes[buffer] += flat.size
    ints = np.concatenate(parts[_INT]) if parts[_INT] else np.zeros(0, np.int32)
    floats = np.concatenate(parts[_FLOAT]) if parts[_FLOAT] else np.zeros(0, np.float32)
    return ints, floats, Layout(treedef, tuple(placed))


def split_leaves(ints: jax.Array, floats: jax.Array, layout: Layout):
    """The pytree `concat_leaves` concatenated, inside a jitted function (static slices)."""
    leaves = []
    for buffer, offset, shape, dtype in layout.leaves:
        source = ints if buffer == _INT else floats
        size = int(np.prod(shape, dtype=np.int64))
        leaf = source[offset:offset + size].reshape(shape)
        if dtype == "bool":
            leaf = leaf != 0
        elif dtype == "uint32":
            leaf = jax.lax.bitcast_convert_type(leaf, jnp.uint32)
        leaves.append(leaf)
    return jax.tree.unflatten(layout.treedef, leaves)


# --- the step ------------------------------------------------------------------------------

SAMPLING_WIDTHS = (MAX_LOGIT_BIAS, MAX_SUPPRESSED_IDS)
NULL_SLOT = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutput:
    sample: SampleOutput  # one row per sample row (ForwardBatch.logits_indices)
    prompt: PromptLogprobs  # one row per token row; zeros in a step where no row has a target


@dataclasses.dataclass(frozen=True)
class LoraArgs:
    """Where a step's LoRA slot arrays are (runtime/executor/lora_slots.py): its weight
    arguments from `first` on, in model/lora.slot_shapes order, then the request slots'
    adapters."""

    spec: LoraSpec
    num_layers: int
    first: int


def make_step(graphdef, state_treedef, weight_layout, kernels, mesh, kv_sharding,
              weight_formats=None, verify_tokens: int = 1, lora: LoraArgs | None = None,
              multimodal: bool = False):
    """The jitted serving step: forward, sampling, penalty counts and last tokens, over the
    device's page table with the step's writes (runtime/executor/page_table.py). A pure function of its
    arguments, so that it can also be compiled for hardware that is not here
    (runtime/executor/aot.py). `weight_formats`: the weight arguments' formats (weight_args.auto_formats:
    XLA chooses their layouts); None: the arguments' own (the other arguments' always are).
    `verify_tokens` > 1: speculative decoding's verified rows (verified_rows.py) are counted
    and kept in the step; 1, the program of a server without speculation. `lora`: the LoRA
    adapter slots among the weight arguments (None: a server without adapters). `multimodal`:
    a vision model's step, which also takes `input_embeds` [T, hidden] (the rows of image
    tokens, runtime/executor/multimodal_rows.py) after the grammar masks."""
    replicated = NamedSharding(mesh, P())
    by_vocab = NamedSharding(mesh, P(None, TP))
    jit_options = {"donate_argnums": (1, 2, 3, 4),
                   "out_shardings": (replicated, kv_sharding, replicated, replicated, replicated)}

    def step(weights, kv_caches, output_counts, last_tokens, page_table, prompt_masks, ints,
             floats, table_ints, table_floats, token_bitmask, input_embeds=None, layout=None,
             needs: StepNeeds | None = RUN_TIME):
        batch, sampling, slots, rope, writes = split_leaves(ints, floats, layout[0])
        bias_ids, bias_values, suppressed = split_leaves(table_ints, table_floats, layout[1])
        sampling = dataclasses.replace(sampling, logit_bias_ids=bias_ids,
                                       logit_bias_values=bias_values, suppressed_ids=suppressed)
        state = jax.tree.unflatten(state_treedef, leaves_from_args(weights, weight_layout))
        model = nnx.merge(graphdef, state)

        def whole_vocab_logits(rows):
            # The vocabulary whole on every device (an all-gather under tensor parallelism)
            # before the sampler's and prompt logprobs' top_k. JAX 0.11's XLA left the logits
            # sharded into it, and libtpu's SPMD partitioning of a top_k over a sharded axis
            # aborts the compile there ("Stable sort expects more than 1 operand", libtpu
            # 0.0.48); libtpu 0.0.42 (JAX 0.10) compiles it but returns indices of 0.
            # Computed where the LM head's vocabulary columns are, then gathered: left to itself
            # XLA gathered the 1 GB LM head onto every device instead of the logits (Llama-3.1-8B,
            # v6e, tp 4: an all-gather of bf16[4096, 128256] twice a step).
            logits = jax.lax.with_sharding_constraint(model.logits(rows, kernels), by_vocab)
            return jax.lax.with_sharding_constraint(logits, replicated)

        input_ids = jnp.where(batch.input_slots >= 0,
                              last_tokens[jnp.maximum(batch.input_slots, 0)], batch.input_ids)
        # Each sequence's row of the page table by its slot (padding rows: the null slot's).
        page_table = apply_writes(page_table, writes)
        tree = batch.tree_width > 0  # static: the tree program (verified_rows.py)
        metadata = AttentionMetadata(batch.kv_lens, gather_rows(page_table, slots, batch.pages),
                                     batch.cu_q_lens, batch.num_seqs,
                                     batch.tree_masks if tree else None, batch.tree_width)
        head = getattr(model, "draft_head", None)
        if lora is not None:
            *arrays, slot_adapters = weights[lora.first:]
            adapters = lora_batch(lora.spec, lora.num_layers, arrays, slot_adapters,
                                  token_request_slots(batch.cu_q_lens, slots, input_ids.shape[0]),
                                  skip_idle=needs is RUN_TIME, dtype=arrays[0].dtype,
                                  grouped_matmul=kernels.packed_grouped_matmul)
            hidden, kv_caches = model.hidden_states(input_ids, batch.positions, kv_caches,
                                                    metadata, kernels, rope, lora=adapters)
        elif head is None:
            hidden, kv_caches = model.hidden_states(input_ids, batch.positions, kv_caches,
                                                    metadata, kernels, rope,
                                                    input_embeds=input_embeds)
        else:  # the head's cache and state follow the layers' (kv_pool.DraftHeadPool)
            head_state = kv_caches[len(model.layers):]
            hidden, kv_caches, captured = model.hidden_states(
                input_ids, batch.positions, kv_caches[:len(model.layers)], metadata, kernels,
                rope, capture=head.capture_layers)
        logits = whole_vocab_logits(hidden[batch.logits_indices])
        # Each sample row's slot (its sequence's; the null slot for padding): without
        # speculation, sample row i is sequence i.
        sample_slots = jnp.where(batch.sample_seqs >= 0,
                                 slots[jnp.maximum(batch.sample_seqs, 0)], NULL_SLOT)
        if verify_tokens <= 1:
            prior = None
        elif tree:
            prior = tree_prior_draft_ids(input_ids, batch.tree_masks, batch.logits_indices,
                                         batch.sample_seqs, batch.cu_q_lens, verify_tokens - 1)
        else:
            prior = prior_draft_ids(input_ids, batch.logits_indices, batch.sample_seqs,
                                    verify_tokens - 1)
        out = sample(logits, sampling, output_counts, prompt_masks, sample_slots, token_bitmask,
                     num_top_logprobs=MAX_TOP_LOGPROBS, needs=needs, prior_ids=prior)
        last_kept = batch.sample_rows
        if verify_tokens <= 1:
            output_counts = add_sampled(output_counts, out.tokens, batch.sample_rows,
                                        rows=sample_slots)
            # Rows that sample nothing (padding: the null slot; a prompt chunk) keep the old
            # token.
            last_tokens = last_tokens.at[sample_slots].set(
                jnp.where(batch.sample_rows, out.tokens, last_tokens[sample_slots]))
        else:  # a verified row keeps a prefix of its tokens: those are counted, the last kept
            if tree:  # a path of its tree, whose KV goes to the path's positions
                kept, last_kept, depth = tree_kept_rows(
                    out.tokens, input_ids, batch.tree_masks, batch.logits_indices,
                    batch.sample_seqs, batch.cu_q_lens, batch.tree_width)
                moves = kept_path_moves(kept, depth, batch.logits_indices, batch.sample_seqs,
                                        batch.cu_q_lens, batch.kv_lens, metadata.page_indices,
                                        kv_caches[0].shape[1], kv_caches[0].shape[0])
                kv_caches = move_kv_entries(kv_caches, *moves)
            else:
                kept, last_kept = kept_rows(out.tokens, input_ids, batch.logits_indices,
                                            batch.sample_seqs)
            output_counts = add_sampled(output_counts, out.tokens, batch.sample_rows & kept,
                                        rows=sample_slots)
            write = jnp.where(batch.sample_rows & last_kept, sample_slots, last_tokens.shape[0])
            last_tokens = last_tokens.at[write].set(out.tokens, mode="drop")
        if head is not None:
            head_state = catch_up_head(
                model, head, head_state, hidden, captured, input_ids, batch, metadata,
                out.tokens, batch.sample_rows & last_kept, sample_slots, kernels)
            if tree:  # the head's cache entries of the path too
                head_state[0], = move_kv_entries(head_state[:1], *moves)
            kv_caches = kv_caches + head_state
        prompt = prompt_logprobs(whole_vocab_logits, hidden, batch.target_ids, MAX_TOP_LOGPROBS,
                                 part(needs, "prompt_logprobs"))
        return StepOutput(out, prompt), kv_caches, output_counts, last_tokens, page_table

    if weight_formats is None:
        return jax.jit(step, static_argnames=("layout", "needs"), **jit_options)
    # Of the eleven (twelve) positional arguments; None: the argument's own sharding and layout.
    in_shardings = (list(weight_formats),) + (None,) * (11 if multimodal else 10)
    return StaticKeywordsBound(step, in_shardings=in_shardings, **jit_options)


class StaticKeywordsBound:
    """`fn` jitted with its keyword arguments (static ones: `layout`, `needs`) bound first, for
    lowering only: jit refuses keyword arguments where `in_shardings` is given."""

    def __init__(self, fn, **jit_options):
        self.fn, self.jit_options = fn, jit_options

    def trace(self, *args, **kwargs):
        return jax.jit(functools.partial(self.fn, **kwargs), **self.jit_options).trace(*args)

    def lower(self, *args, **kwargs):
        return self.trace(*args, **kwargs).lower()


class RopeTable:
    """RoPE's (cos, sin) by position, computed once per position (`rope_cos_sin`'s values) and
    looked up per step: computing them cost ~0.12 ms of host time a 256-row decode step at
    head_dim 64 (twice that at 128), the lookup ~10 us. Grows (doubling) to the largest
    position asked for: 512 bytes a position at head_dim 128, 4 MB at 8K positions."""

    def __init__(self, inv_freq: np.ndarray, attention_factor: float = 1.0,
                 mrope_section: tuple[int, ...] = (), mrope_interleaved: bool = False):
        self.inv_freq, self.attention_factor = inv_freq, attention_factor
        half = len(inv_freq)
        self._cos = self._sin = np.zeros((0, half), np.float32)
        # Multimodal RoPE (RopeConfig.mrope_section): which of a row's three positions each
        # rotation pair takes (transformers' recomposition: the sections in turn, or
        # interleaved).
        self._axis = None
        if mrope_section and mrope_interleaved:
            pairs = np.arange(half)
            self._axis = np.zeros(half, np.int64)
            for axis in (1, 2):
                self._axis[(pairs % 3 == axis) & (pairs < 3 * mrope_section[axis])] = axis
        elif mrope_section:
            self._axis = np.repeat(np.arange(len(mrope_section)) % 3, mrope_section)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 (cos, sin) [T, head_dim / 2] of the rows at `positions` (>= 0): i32[T], or
        i32[3, T] (temporal, height, width) for multimodal RoPE."""
        if positions.ndim == 2:
            cos, sin = self.cos_sin(positions.reshape(-1))
            tokens, pairs = positions.shape[1], np.arange(len(self.inv_freq))
            cos, sin = cos.reshape(3, tokens, -1), sin.reshape(3, tokens, -1)
            return cos[self._axis, :, pairs].T, sin[self._axis, :, pairs].T
        needed = int(positions.max(initial=0)) + 1
        if needed > len(self._cos):
            size = max(needed, 2 * len(self._cos), 1024)
            cos, sin = rope_cos_sin(self.inv_freq, np.arange(len(self._cos), size, dtype=np.int32),
                                    self.attention_factor)
            self._cos = np.concatenate([self._cos, cos])
            self._sin = np.concatenate([self._sin, sin])
        return self._cos[positions], self._sin[positions]


def step_vectors(rope: RopeTable, batch: ForwardBatch, sampling: SamplingMetadata, slots,
                 writes: PageWrites):
    """The step's host arrays but the sampling tables (`table_arrays`, sent apart), with the
    page table's writes and the rows' RoPE cos/sin (`rope`: the config's frequencies and `rope.attention_factor`), as one
    int32 and one float32 vector (above) and their layout (which the values do not
    change). RoPE stays on the host: computed in the step, XLA's CPU fusion recomputes cos/sin
    in each layer's RoPE fusion (an optimization barrier does not stop it: the CPU compiler
    removes barriers before fusion; 64 cos fusions in the 32-layer step)."""
    rest = dataclasses.replace(sampling, logit_bias_ids=None, logit_bias_values=None,
                               suppressed_ids=None)
    positions = batch.positions if batch.rope_positions is None else batch.rope_positions
    return concat_leaves((batch, rest, np.asarray(slots, np.int32), rope.cos_sin(positions),
                          writes))


def table_arrays(sampling: SamplingMetadata) -> tuple:
    """The sampling tables the step takes as vectors of their own (ModelRunner._tables)."""
    return sampling.logit_bias_ids, sampling.logit_bias_values, sampling.suppressed_ids


def idle_vectors(inv_freq, tokens: int, seqs: int, pages: int, page_size: int, rows: int,
                 tree_width: int = 0):
    """((ints, floats, table ints, table floats), layout) of an idle step of the bucket shape
    with `rows` sample rows (of the tree program: `tree_width`): the step's transfer arguments,
    for compiling it ahead of time (runtime/executor/aot.py)."""
    batch, sampling, slots = idle_step(tokens, seqs, pages, rows, tree_width)
    writes = empty_writes(write_capacity(tokens, seqs, page_size), 0)
    ints, floats, layout = step_vectors(RopeTable(inv_freq), batch, sampling, slots, writes)
    table_ints, table_floats, table_layout = concat_leaves(table_arrays(sampling))
    return (ints, floats, table_ints, table_floats), (layout, table_layout)


def idle_step(tokens: int, seqs: int, pages: int, rows: int | None = None, tree_width: int = 0):
    """(batch, sampling, slots) of a step of the given bucket shape (and `rows` sample rows,
    default `seqs`; `tree_width`: of the tree program) with every row padding: nothing is
    written to a live page (padding tokens write to no page at all)."""
    rows = seqs if rows is None else rows
    return (empty_batch(tokens, seqs, pages, rows, tree_width), greedy_sampling(rows),
            np.full(seqs, NULL_SLOT, np.int32))


@functools.lru_cache(maxsize=None)
def greedy_sampling(rows: int) -> SamplingMetadata:
    """The sampling metadata of `rows` greedy sample rows (idle steps, a drafter's greedy
    drafts), made once per row count and shared: its arrays are read, never changed."""
    return build_sampling_metadata([RowSamplingParams(temperature=0.0, seed=0)], rows,
                                   SAMPLING_WIDTHS)


def empty_batch(tokens: int, seqs: int, pages: int, rows: int | None = None,
                tree_width: int = 0) -> ForwardBatch:
    """A batch of the given bucket shape (and `rows` sample rows, default `seqs`; `tree_width`:
    of the tree program) with no live sequence."""
    rows = seqs if rows is None else rows
    return ForwardBatch(input_ids=np.zeros(tokens, np.int32), positions=np.zeros(tokens, np.int32),
                        kv_lens=np.zeros(seqs, np.int32), cu_q_lens=np.zeros(seqs + 1, np.int32),
                        num_seqs=np.zeros(1, np.int32), logits_indices=np.zeros(rows, np.int32),
                        sample_rows=np.zeros(rows, np.bool_),
                        sample_seqs=np.full(rows, -1, np.int32),
                        target_ids=np.full(tokens, NO_TARGET, np.int32),
                        input_slots=np.full(tokens, -1, np.int32),
                        next_ids=np.full(seqs, -1, np.int32),
                        tree_masks=np.zeros(tokens, np.int32), pages=pages,
                        tree_width=tree_width)
