"""An embedding server's step (issue 54): the model over a batch of prompt chunks, each chunk's
final hidden states reduced for the checkpoint's pooling, and nothing else: no LM head, no
sampling, no penalty state.

    step(weights, kv_caches, page_table, ints, floats, *, layout)
        -> (f32[seqs, hidden] each chunk's rows reduced, kv_caches, page_table)

A prompt longer than a step's tokens runs in chunks like a generation server's (the KV cache
carries the earlier chunks), so the step returns each chunk's first row, row sum or last row
(model/pooling.reduce_chunks) and the engine finishes the vector on the host
(runtime/engine/pooled_outputs.py). The inputs travel as a generation step's do, in one int32
and one float32 vector (step_program.concat_leaves): the batch, the slots, RoPE's cos/sin and
the page table's writes.

`EmbeddingRunner` is a ModelRunner (the KV pool, the page table, the weights and their layouts,
the precompile and the executable cache are its) whose step is this one: one program per
bucket shape, compiled before serving like the generation step's.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.model.transformer import AttentionMetadata
from xlaserve.runtime.executor.forward_batch import ForwardBatch
from xlaserve.runtime.executor.model_runner import ModelRunner, StagedStep
from xlaserve.runtime.executor.page_table import apply_writes, gather_rows
from xlaserve.runtime.executor.precompile import warn_compiled_while_serving
from xlaserve.runtime.executor.step_program import (NULL_SLOT, RopeTable, StaticKeywordsBound,
                                                    concat_leaves, empty_batch, split_leaves)
from xlaserve.runtime.executor.weight_args import leaves_from_args
from xlaserve.runtime.sampling.step_needs import RUN_TIME

NO_WIDTHS = (0, 0)  # an embedding step has no sampling tables


def make_embedding_step(graphdef, state_treedef, weight_layout, kernels, mesh, kv_sharding,
                        pooling_mode: str, weight_formats=None, token_types: bool = False):
    """The jitted embedding step (module docstring), a pure function of its arguments like
    step_program.make_step; `weight_formats` as there. `token_types`: the vectors end with each
    token's type (an encoder's: a BERT pair's second segment is type 1)."""
    replicated = NamedSharding(mesh, P())
    jit_options = {"donate_argnums": (1, 2),
                   "out_shardings": (replicated, kv_sharding, replicated)}

    def step(weights, kv_caches, page_table, ints, floats, layout):
        batch, slots, rope, writes, *types = split_leaves(ints, floats, layout)
        state = jax.tree.unflatten(state_treedef, leaves_from_args(weights, weight_layout))
        model = nnx.merge(graphdef, state)
        page_table = apply_writes(page_table, writes)
        metadata = AttentionMetadata(batch.kv_lens, gather_rows(page_table, slots, batch.pages),
                                     batch.cu_q_lens, batch.num_seqs)
        options = {"token_types": types[0]} if token_types else {}
        hidden, kv_caches = model.hidden_states(batch.input_ids, batch.positions, kv_caches,
                                                metadata, kernels, rope, **options)
        reduced = model.chunk_embeddings(hidden, batch.cu_q_lens, pooling_mode)
        return jax.lax.with_sharding_constraint(reduced, replicated), kv_caches, page_table

    if weight_formats is None:
        return jax.jit(step, static_argnames=("layout",), **jit_options)
    in_shardings = (list(weight_formats),) + (None,) * 4
    return StaticKeywordsBound(step, in_shardings=in_shardings, **jit_options)


def embedding_vectors(rope: RopeTable, batch: ForwardBatch, slots, writes, token_types=None):
    """(int32 vector, float32 vector, layout) of an embedding step's host arrays (and the
    tokens' types, where given)."""
    leaves = (batch, np.asarray(slots, np.int32), rope.cos_sin(batch.positions), writes)
    if token_types is not None:
        leaves += (np.asarray(token_types, np.int32),)
    return concat_leaves(leaves)


class EmbeddingRunner(ModelRunner):
    """A ModelRunner whose step pools instead of sampling (module docstring): `stage(batch,
    slots)`, then `run(staged)` -> f32[seqs, hidden] on the device."""

    def __init__(self, loaded, *, pooling_mode: str, **options):
        self.pooling_mode = pooling_mode  # read by _make_step, which __init__ calls
        if options.get("lora") is not None or options.get("verify_tokens", 1) > 1:
            raise ValueError("an embedding server runs no LoRA adapters and no speculation")
        super().__init__(loaded, static_variants=False, **options)
        self._description += f"\npooling {pooling_mode}"

    def _make_step(self, weight_formats=None):
        graphdef, state_treedef, weight_layout, kv_sharding = self.program_parts
        return make_embedding_step(graphdef, state_treedef, weight_layout, self.kernels,
                                   self.mesh, kv_sharding, self.pooling_mode, weight_formats,
                                   token_types=self.config.encoder is not None)

    def stage(self, batch: ForwardBatch, slots: np.ndarray,
              token_types: np.ndarray | None = None) -> StagedStep:
        """The step's inputs; `token_types` i32[tokens]: an encoder's (None: all 0)."""
        if len(slots) != batch.shape[1]:
            raise ValueError(f"{len(slots)} slots for a batch of {batch.shape[1]} sequence rows")
        if self.sink is not None:
            raise NotImplementedError("an embedding server runs in one process (--nnodes 1)")
        tokens, seqs, _ = batch.shape
        writes, updates, overflow = self.page_table.step_writes(slots, batch.page_ids, tokens,
                                                                seqs)
        if self.config.encoder is not None and token_types is None:
            token_types = np.zeros(tokens, np.int32)
        ints, floats, layout = embedding_vectors(self._rope, batch, slots, writes,
                                                 token_types if self.config.encoder else None)
        return StagedStep(ints, floats, (), layout, batch.shape, NO_WIDTHS,
                          page_updates=updates, overflow_writes=overflow)

    def run(self, staged: StagedStep, token_bitmask=None) -> jax.Array:
        """Dispatches a staged step; returns each chunk's rows reduced, f32[seqs, hidden], on
        the device (the caller's read is the sync point)."""
        if staged.overflow_writes is not None:
            self.write_pages(*staged.overflow_writes)
        args = (self._weight_args, self.kv_caches, self.page_table.array, staged.ints,
                staged.floats)
        program = self._programs.get((staged.shape, NO_WIDTHS, RUN_TIME, 0))
        if program is not None:
            reduced, self.kv_caches, self.page_table.array = program(*args)
        else:
            compiled_before = self._step._cache_size()
            reduced, self.kv_caches, self.page_table.array = self._step(*args,
                                                                        layout=staged.layout)
            if self._precompiled and self._step._cache_size() > compiled_before:
                warn_compiled_while_serving(staged.shape, NO_WIDTHS, RUN_TIME)
        self.page_table.rows.commit(staged.page_updates)
        return reduced

    def precompile(self, shapes, **options) -> None:
        """ModelRunner.precompile, into the table `run` reads (one program per shape)."""
        super().precompile(shapes, **options)
        # compile_steps keys its programs by the generation step's sampling widths.
        self._programs = {(shape, NO_WIDTHS, needs, tree): program
                          for (shape, _, needs, tree), program in self._programs.items()}

    def _lowering_args(self, shape, needs=RUN_TIME, tree_width: int = 0):
        tokens, seqs, pages = shape
        staged = self.stage(empty_batch(tokens, seqs, pages), np.full(seqs, NULL_SLOT, np.int32))
        args = (self._weight_args, self._kv_specs, self.page_table.array, staged.ints,
                staged.floats)
        return args, {"layout": staged.layout}
