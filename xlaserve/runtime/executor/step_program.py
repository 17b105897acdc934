"""The serving step as a pure function: `make_step` is the jitted step (forward, sampling, penalty
counts, last tokens, the page table's writes) over flat weight arguments, so that it can also be
compiled for hardware that is not here (runtime/executor/aot.py). What it is called with, and
how a batch's host arrays become its two vectors: step_inputs.py. ModelRunner (model_runner.py)
owns the device state and calls it; the Python here runs when a program is traced, at start-up.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.runtime.executor.kv_pool import layer_pool_arrays
from xlaserve.runtime.executor.page_table import apply_writes, gather_rows
from xlaserve.runtime.executor.state_pool import copy_states
from xlaserve.runtime.executor.step_inputs import NULL_SLOT, split_leaves
from xlaserve.runtime.executor.draft_head_step import catch_up_head
from xlaserve.runtime.executor.verified_rows import (kept_path_moves, kept_rows,
                                                     move_kv_entries, prior_draft_ids,
                                                     state_rollback, tree_kept_rows,
                                                     tree_prior_draft_ids)
from xlaserve.runtime.executor.weight_args import leaves_from_args
from xlaserve.model.lora import LoraSpec, lora_batch, token_request_slots
from xlaserve.model.sharding import TP
from xlaserve.model.transformer import AttentionMetadata
from xlaserve.runtime.sampling.params import MAX_TOP_LOGPROBS
from xlaserve.runtime.sampling.prompt_logprobs import PromptLogprobs, prompt_logprobs
from xlaserve.runtime.sampling.sampler import SampleOutput, add_sampled, sample
from xlaserve.runtime.sampling.step_needs import RUN_TIME, StepNeeds, part

# --- the step ------------------------------------------------------------------------------



@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutput:
    sample: SampleOutput  # one row per sample row (ForwardBatch.logits_indices)
    prompt: PromptLogprobs  # one row per token row; zeros in a step where no row has a target
    # f32[T, hidden]: every token row's last hidden state after the final norm, in the programs
    # of a server started with --enable-return-hidden-states (make_step's `hidden_rows`); None
    # in the others, which return nothing more.
    hidden: jax.Array | None = None


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
              takes_images: bool = False, hidden_rows: bool = False):
    """The jitted serving step: forward, sampling, penalty counts and last tokens, over the
    device's page table with the step's writes (runtime/executor/page_table.py). A pure function of its
    arguments, so that it can also be compiled for hardware that is not here
    (runtime/executor/aot.py). `weight_formats`: the weight arguments' formats (weight_args.auto_formats:
    XLA chooses their layouts); None: the arguments' own (the other arguments' always are).
    `verify_tokens` > 1: speculative decoding's verified rows (verified_rows.py) are counted
    and kept in the step; 1, the program of a server without speculation. `lora`: the LoRA
    adapter slots among the weight arguments (None: a server without adapters). `takes_images`:
    a vision model's step, which also takes `input_embeds` [T, hidden] (the rows of image
    tokens, runtime/executor/image_rows.py) after the grammar masks. `hidden_rows`: the step also
    returns every token row's hidden state after the final norm (`StepOutput.hidden`, what
    transformers' last `hidden_states` is), for --enable-return-hidden-states: one RMSNorm over
    the rows and an output buffer the host reads only in steps where a request asked."""
    replicated = NamedSharding(mesh, P())
    by_vocab = NamedSharding(mesh, P(None, TP))
    jit_options = {"donate_argnums": (1, 2, 3, 4),
                   "out_shardings": (replicated, kv_sharding, replicated, replicated, replicated)}

    def step(weights, kv_caches, output_counts, last_tokens, page_table, prompt_masks, ints,
             floats, table_ints, table_floats, token_bitmask, input_embeds=None, layout=None,
             needs: StepNeeds | None = RUN_TIME):
        batch, sampling, slots, rope, writes, copies = split_leaves(ints, floats, layout[0])
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
        # A hybrid model's linear layers read and write their states by request slot.
        metadata = AttentionMetadata(batch.kv_lens, gather_rows(page_table, slots, batch.pages),
                                     batch.cu_q_lens, batch.num_seqs,
                                     batch.tree_masks if tree else None, batch.tree_width,
                                     state_slots=slots)
        head = getattr(model, "draft_head", None)
        if head is not None:  # its cache and state follow the layers' (kv_pool.DraftHeadPool)
            layers = layer_pool_arrays(model.config)
            kv_caches, head_state = kv_caches[:layers], kv_caches[layers:]
        # A hybrid model's linear layers: cached prefixes' states into admitted requests' slots
        # first, prompts' states into snapshot slots after (state_pool.StateCopies); a verified
        # row's state rolled back to its accepted drafts (verified_rows.StateRollback).
        first_state = len(model.config.cache_layers)
        rollback = state_rollback(model.config, 1 if tree else verify_tokens)
        metadata = rollback.metadata(metadata, batch.sample_seqs)
        kv_caches = copy_states(kv_caches, copies.restores, first_state)
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
        else:  # the layers the head reads (EAGLE-3's), its cache and state apart
            hidden, kv_caches, captured = model.hidden_states(
                input_ids, batch.positions, kv_caches, metadata, kernels, rope,
                capture=head.capture_layers)
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
                     num_top_logprobs=MAX_TOP_LOGPROBS, needs=needs, prior_ids=prior,
                     invariant=kernels.deterministic)
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
            kv_caches = rollback.commit(kv_caches, metadata, kept, batch.sample_seqs)
            output_counts = add_sampled(output_counts, out.tokens, batch.sample_rows & kept,
                                        rows=sample_slots)
            write = jnp.where(batch.sample_rows & last_kept, sample_slots, last_tokens.shape[0])
            last_tokens = last_tokens.at[write].set(out.tokens, mode="drop")
        kv_caches = copy_states(kv_caches, copies.snapshots, first_state)
        if head is not None:
            head_state = catch_up_head(
                model, head, head_state, hidden, captured, input_ids, batch, metadata,
                out.tokens, batch.sample_rows & last_kept, sample_slots, kernels)
            if tree:  # the head's cache entries of the path too
                head_state[0], = move_kv_entries(head_state[:1], *moves)
            kv_caches = kv_caches + head_state
        prompt = prompt_logprobs(whole_vocab_logits, hidden, batch.target_ids, MAX_TOP_LOGPROBS,
                                 part(needs, "prompt_logprobs"))
        rows = model.final_norm(hidden).astype(jnp.float32) if hidden_rows else None
        return StepOutput(out, prompt, rows), kv_caches, output_counts, last_tokens, page_table

    if weight_formats is None:
        return jax.jit(step, static_argnames=("layout", "needs"), **jit_options)
    # Of the eleven (twelve) positional arguments; None: the argument's own sharding and layout.
    in_shardings = (list(weight_formats),) + (None,) * (11 if takes_images else 10)
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
