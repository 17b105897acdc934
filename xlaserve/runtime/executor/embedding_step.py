"""An embedding server's step (issue 54): the model over a batch of prompt chunks, each chunk's
final hidden states reduced for the checkpoint's pooling, and nothing else: no LM head, no
sampling, no penalty state.

    step(weights, kv_caches, page_table, ints, floats, *, layout)
        -> (f32[seqs, hidden] each chunk's rows reduced, kv_caches, page_table)

A prompt longer than a step's tokens runs in chunks like a generation server's (the KV cache
carries the earlier chunks), so the step returns each chunk's first row, row sum or last row
(model/pooling.reduce_chunks) and the engine finishes the vector on the host
(runtime/engine/pooled_outputs.py). The inputs travel as a generation step's do, in one int32
and one float32 vector (step_inputs.concat_leaves): the batch, the slots, RoPE's cos/sin and
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
from xlaserve.runtime.executor.model_runner import ModelRunner
from xlaserve.runtime.executor.step_inputs import StagedStep
from xlaserve.runtime.executor.page_table import apply_writes, gather_rows
from xlaserve.runtime.executor.step_program import StaticKeywordsBound
from xlaserve.runtime.executor.step_inputs import (NULL_SLOT, RopeTable, concat_leaves,
                                                   empty_batch, split_leaves)
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


def idle_embedding_vectors(rope: RopeTable, writes, tokens: int, seqs: int, pages: int,
                           token_types: bool):
    """(int32 vector, float32 vector, layout) of an idle embedding step of the bucket shape
    (`token_types`: an encoder's step, which takes them): the one place they are made, for the
    runner's precompile and a compile-only target's (`compiled_for_target`). `writes`: the page
    table's idle writes (`empty_writes` where there is no page table)."""
    return embedding_vectors(rope, empty_batch(tokens, seqs, pages),
                             np.full(seqs, NULL_SLOT, np.int32), writes,
                             np.zeros(tokens, np.int32) if token_types else None)


class EmbeddingRunner(ModelRunner):
    """A ModelRunner whose step pools instead of sampling (module docstring): `stage(batch,
    slots)`, then `run(staged)` -> f32[seqs, hidden] on the device."""

    program_widths = NO_WIDTHS

    def __init__(self, loaded, *, pooling_mode: str, **options):
        self.pooling_mode = pooling_mode  # read by _make_step, which __init__ calls
        if options.get("lora") is not None or options.get("verify_tokens", 1) > 1:
            raise ValueError("an embedding server runs no LoRA adapters and no speculation")
        super().__init__(loaded, static_variants=False, **options)
        self._description += f"\npooling {pooling_mode}"
        # A generation step's penalty state and sampled tokens, vocabulary x slots (~190 MB for
        # Qwen3's vocabulary at 256 slots): nothing here reads them.
        self.output_counts = self.prompt_masks = self.last_tokens = None

    def _compile_reset_slots(self) -> None:
        """The page table's write program alone (no slot's penalty state to reset)."""
        self.page_table.compile()

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
        if self.sink.replays:
            raise NotImplementedError("an embedding server runs in one process (--nnodes 1)")
        tokens, seqs, _ = batch.shape
        writes, updates, overflow = self.page_table.step_writes(slots, batch.page_ids, tokens,
                                                                seqs)
        if self.config.encoder is not None and token_types is None:
            token_types = np.zeros(tokens, np.int32)
        ints, floats, layout = embedding_vectors(self.rope, batch, slots, writes, token_types)
        return StagedStep(ints, floats, (), layout, batch.shape, NO_WIDTHS,
                          page_updates=updates, overflow_writes=overflow)

    def run(self, staged: StagedStep, token_bitmask=None) -> jax.Array:
        """Dispatches a staged step; returns each chunk's rows reduced, f32[seqs, hidden], on
        the device (the caller's read is the sync point)."""
        if staged.overflow_writes is not None:
            self.write_pages(*staged.overflow_writes)
        args = (self._weight_args, self.kv_caches, self.page_table.array, staged.ints,
                staged.floats)
        reduced, self.kv_caches, self.page_table.array = self._dispatch(staged, args, RUN_TIME, {})
        return reduced

    def _lowering_args(self, shape, needs=RUN_TIME, tree_width: int = 0):
        """`run`'s arguments for an idle step of the bucket shape, the KV pool as shapes only."""
        tokens, seqs, pages = shape
        ints, floats, layout = idle_embedding_vectors(
            self.rope, self.page_table.idle_writes(tokens, seqs), tokens, seqs, pages,
            self.config.encoder is not None)
        args = (self._weight_args, self.kv_specs, self.page_table.array, ints, floats)
        return args, {"layout": layout}


def compiled_for_target(target: str, server_args, pooling_mode: str, tokens: int, seqs: int):
    """(the compiled embedding step, its abstract weights, a description): the step a server
    started with `server_args` (`model_path`: a folder with the model's config.json) would run
    on compile-only `target` (runtime/executor/aot.py: a TPU topology or "h100"), for one bucket
    shape, its weights in the layouts XLA chooses on TPU (as ModelRunner stores them)."""
    import dataclasses

    from xlaserve.server_args import platform_defaults
    from xlaserve.model.registry import model_class
    from xlaserve.model.sharding import serving_mesh
    from xlaserve.model.transformer import abstract_parameters
    from xlaserve.runtime.executor import aot
    from xlaserve.runtime.executor.buckets import with_page_size
    from xlaserve.runtime.executor.kernels import kernels_for
    from xlaserve.runtime.executor.kv_pool import kv_pool_specs
    from xlaserve.runtime.executor.page_table import empty_writes, write_capacity
    from xlaserve.runtime.executor.weight_args import auto_formats, leaf_names, weight_args
    from xlaserve.runtime.scheduler.page_allocator import pages_for_tokens

    platform, devices = aot.target_devices(target)
    server_args, _ = platform_defaults.resolve(server_args, platform)
    mesh = serving_mesh(devices, server_args.tp_size, server_args.ep_size)
    config, _ = aot.read_config(server_args.model_path, load_format="dummy")
    config = dataclasses.replace(config, lm_head=False)
    dtype = aot.resolve_dtype("bfloat16" if server_args.dtype == "auto" else server_args.dtype)
    context = server_args.context_length or config.max_position_embeddings
    page_size = with_page_size(server_args, platform, context).page_size
    kernels = kernels_for(server_args.attention_backend, mesh, matmul_backend="xla",
                          platform=platform)
    graphdef, _, parameters = abstract_parameters(config, dtype, mesh,
                                                  model_class(config.architecture))
    state = nnx.from_flat_state(parameters)
    leaves, state_treedef = jax.tree.flatten(state)
    weights, weight_layout = weight_args(leaves, stack_small=mesh.size == 1,
                                         stack_layers=platform == "tpu", names=leaf_names(state))
    pages = pages_for_tokens(context, page_size)
    num_pages = aot.DEFAULT_KV_TOKENS // page_size + 1
    caches = kv_pool_specs(config, num_pages, page_size, dtype, mesh)
    step = make_embedding_step(graphdef, state_treedef, weight_layout, kernels, mesh,
                               [c.sharding for c in caches], pooling_mode,
                               auto_formats(weights) if platform == "tpu" else None,
                               token_types=config.encoder is not None)
    writes = empty_writes(write_capacity(tokens, seqs, page_size), 0)
    rope = RopeTable(config.rope_inv_freq(), config.rope.attention_factor)
    ints, floats, layout = idle_embedding_vectors(rope, writes, tokens, seqs, pages,
                                                  config.encoder is not None)
    page_table = aot.abstract((server_args.max_running_requests + 1, pages), np.int32, mesh)
    args = (weights, caches, page_table, aot.abstract(ints.shape, ints.dtype, mesh),
            aot.abstract(floats.shape, floats.dtype, mesh))
    with jax.set_mesh(mesh):
        compiled = step.trace(*args, layout=layout).lower().compile()
    description = (f"{target} ({devices[0].device_kind}), {config.architecture} embedding step, "
                   f"{pooling_mode} pooling, {np.dtype(dtype).name}, tp {server_args.tp_size}, "
                   f"{tokens} tokens x {seqs} inputs")
    return compiled, weights, description
