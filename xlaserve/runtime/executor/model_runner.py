"""ModelRunner: the device state of the serving step (KV pool, penalty state, last tokens) and its
compiled programs; the step itself is `step_program.make_step`.

    step(state, kv_caches, output_counts, last_tokens, page_table, prompt_masks, batch, sampling,
         slots, token_bitmask, *, layout, needs)
        -> (StepOutput, kv_caches, output_counts, last_tokens, page_table)

The KV caches, the penalty counts, the last sampled tokens and the page table are donated, so
XLA updates them in place. A program is
compiled per bucket shape (tokens, seqs, pages per seq, logit-bias width, suppressed width);
`precompile` compiles the expected ones at start-up (runtime/executor/precompile.py), and any
compile afterwards is logged as a warning with the shape, because a compile while serving stalls
every request for seconds.

Penalty state lives on the device, one row per request slot: `output_counts i32[slots, V]` (tokens
generated so far) and `prompt_masks bool[slots, V]` (tokens of the prompt). Slot 0 is the null slot
that padding rows use. `last_tokens i32[slots]` holds each slot's last sampled token, so a decode
step can be dispatched before the host has read the step that samples its input (the engine's
overlap: a row with `input_slots >= 0` reads its token there). `page_table i32[slots, pages]`
holds each slot's pages, written with each step's changes (runtime/executor/page_table.py): `stage`
finds the writes, `run` records them once it has dispatched the step, and writes past the
step's room go first through a program of their own (`write_pages`).

Prompt logprobs (runtime/sampling/prompt_logprobs.py) ride in the same program: the model returns every
row's final hidden state, the sampler takes the LM head of the sampled rows only, and the LM head
over all rows runs only in steps where some row has a target id. With
--enable-return-hidden-states (`hidden_rows`) every program also returns the rows' hidden states
after the final norm (StepOutput.hidden), which the host reads only when a request asked.

What a step computes beyond a greedy argmax (penalties, grammar mask, random draw, truncation,
logprobs, prompt logprobs) is a static argument, `needs` (runtime/sampling/step_needs.py), that `stage`
computes from the rows' parameters and `run` completes with whether the step sends grammar masks.
On the CPU it is RUN_TIME: one program per bucket, each part under a `lax.cond` on the device
(free there). On TPU and GPU, where a conditional is a host sync mid-step, it is one of
ACCELERATOR_VARIANTS, three programs per bucket with no conditional: greedy only, everything but
prompt logprobs, everything; `run` picks the smallest that covers the step.

Structured outputs' grammar masks and multi-host serving (the runner's command `sink`, which
replays its device calls on the followers): runtime/executor/step_inputs.py.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.model.fp8_kv_cache import resolve_kv_cache_dtype
from xlaserve.model.lora import LoraSpec
from xlaserve.weights.placement import put
from xlaserve.runtime.executor.forward_batch import ForwardBatch, sample_rows_for
from xlaserve.runtime.host.huge_pages import advise_huge_pages
from xlaserve.runtime.executor.kernels import check_deterministic_model, kernels_for
from xlaserve.runtime.compile.executable_cache import ExecutableCache, describe
from xlaserve.runtime.executor.kv_pool import (draft_head_description, draft_head_pool_of,
                                               init_kv_pool, kv_pool_specs)
from xlaserve.runtime.executor.lora_slots import lora_slots_for
from xlaserve.runtime.executor.state_pool import no_copies
from xlaserve.runtime.executor.page_table import DevicePageTable
from xlaserve.runtime.scheduler.page_allocator import pages_for_tokens
from xlaserve.runtime.sampling.params import SamplingMetadata
from xlaserve.runtime.sampling.step_needs import (ACCELERATOR_VARIANTS, RUN_TIME, StepNeeds, needs_of,
                                         program_needs)
from xlaserve.runtime.executor.precompile import (compile_steps, run_idle_steps,
                                                  warn_compiled_while_serving)
from xlaserve.runtime.executor.weight_args import auto_formats, leaf_names, weight_args
from xlaserve.runtime.executor.weight_swap import WeightSwap, dotted_names, prepare_model
from xlaserve.runtime.executor.step_program import StepOutput, make_step
from xlaserve.runtime.executor.step_inputs import (NULL_SLOT, SAMPLING_WIDTHS, NoFollowers,
                                                   RepeatedInputs, RopeTable, StagedStep,
                                                   greedy_sampling, idle_vectors, step_args,
                                                   step_vectors)

logger = logging.getLogger(__name__)

# Slots set up per device call when a step admits several (assign_slots): 8 rows of a
# 151936-token vocabulary are ~6 MB to send (int32 counts and a bool mask per row).
ASSIGN_ROWS = 8


class ModelRunner:
    # The sampling tables' widths the precompiled programs are keyed by (`run` looks a staged
    # step's up); an embedding step has none (embedding_step.EmbeddingRunner).
    program_widths = SAMPLING_WIDTHS

    def __init__(self, loaded, *, num_pages: int, page_size: int, max_running_requests: int,
                 attention_backend: str = "auto", matmul_backend: str = "auto",
                 static_variants: bool | None = None, choose_weight_layouts: bool | None = None,
                 context_length: int | None = None, mla_expanded_prefill_tokens: int = 0,
                 verify_tokens: int = 1, quantized_activations: str = "float32",
                 lora: LoraSpec | None = None, kv_cache_dtype: str = "auto",
                 hidden_rows: bool = False, deterministic: bool = False, state_snapshots: int = 0):
        """`context_length` (default: the model's) sets the page table's width, the pages of
        the longest sequence. `static_variants`: precompile and run ACCELERATOR_VARIANTS, a program per variant and
        bucket with no conditional, rather than one program deciding at run time (RUN_TIME);
        None: on TPU and GPU, not on the CPU. `choose_weight_layouts`: `precompile` lets XLA
        choose the weights' layouts and stores them so (precompile.choose_weight_layouts);
        None: on TPU in one process (the CPU's and the H100's choice is the default layouts).
        `mla_expanded_prefill_tokens`: kernels_for's. `verify_tokens`: the tokens of a
        speculative verified row at most (1: no speculation), which sets each bucket's sample
        rows (forward_batch.sample_rows_for). `quantized_activations`: how --quantization int8's
        rows take x (pack_model's int8_activations; a GGUF's kept blocks were laid out at load).
        `lora`: the LoRA adapter slots' shapes (lora_slots.py; None: no adapters).
        `kv_cache_dtype`: --kv-cache-dtype, the pool's entries (model/fp8_kv_cache.py).
        `hidden_rows`: every program also returns its token rows' hidden states
        (make_step's; --enable-return-hidden-states). `deterministic`: kernels whose rows do
        not depend on one another (kernels.deterministic_kernels). `state_snapshots`: a hybrid
        model's state-pool slots past the requests', for the prefix cache (state_reuse.py)."""
        self.config = loaded.config
        self.mesh = loaded.mesh
        self.page_size = page_size
        self.verify_tokens = verify_tokens
        self.hidden_rows = hidden_rows
        self.max_seqs = max_running_requests  # the largest sequence bucket: startup sets it
        if static_variants is None:
            static_variants = self.mesh.devices.flat[0].platform != "cpu"
        self.step_variants = ACCELERATOR_VARIANTS if static_variants else None
        # RoPE's cos/sin by position: the frequencies and YaRN's cos/sin scale (1.0 for others).
        self.rope = RopeTable(self.config.rope_inv_freq(),
                              self.config.rope.attention_factor, self.config.rope.mrope_section,
                              self.config.rope.mrope_interleaved)
        # A vision model's step takes its image rows (image_rows.py): zeros (one array per
        # token bucket, kept on the device: RepeatedInputs) in a step without them.
        self.takes_images = self.config.vision is not None
        self.num_pages = num_pages
        dtype = self._dtype = loaded.dtype
        self.kv_dtype = kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        self.kernels = kernels = kernels_for(
            attention_backend, self.mesh, matmul_backend,
            mla_expanded_prefill_tokens=mla_expanded_prefill_tokens, deterministic=deterministic)
        if deterministic:
            check_deterministic_model(self.config, loaded.model)
        # Zeroed on a thread while the weights are packed and the programs loaded (kv_pool.py);
        # the first step that needs the pool waits for it (`kv_caches`). A speculative draft
        # head's state rides at the end of the pool's list (kv_pool.DraftHeadPool).
        num_slots = max_running_requests + 1  # + the null slot
        self.draft_head_pool = draft_head_pool_of(loaded.model, num_slots)
        self.state_slots = num_slots + state_snapshots  # a hybrid model's pool (state_pool.py)
        self.no_copies = no_copies(self.config)  # a step's state copies when it has none
        self._kv_pool = init_kv_pool(self.config, num_pages, page_size, kv_dtype, self.mesh,
                                     in_background=True, draft_head=self.draft_head_pool,
                                     state_slots=self.state_slots)
        self._kv_caches = None
        self.kv_specs = kv_pool_specs(self.config, num_pages, page_size, kv_dtype, self.mesh,
                                       self.draft_head_pool, self.state_slots)
        prepare_model(loaded.model, self.config, kernels, quantized_activations)
        graphdef, state = nnx.split(loaded.model)
        vocab = self.config.vocab_size
        # Every persistent array keeps one explicit sharding in and out of the jitted functions:
        # an array whose sharding changed between calls would be a cache miss, i.e. a compile.
        replicated = NamedSharding(self.mesh, P())
        # Over several processes' devices, each puts its own copies (weights/placement.py).
        self._put = jax.device_put if replicated.is_fully_addressable else put
        self._vectors_in_call = replicated.is_fully_addressable  # StagedStep
        # Who replays this runner's device calls: the multi-host leader's followers
        # (runtime/distributed/leader.py), or in one process no one.
        self.sink = NoFollowers()
        kv_sharding = jax.tree.map(lambda spec: spec.sharding, self.kv_specs)
        self.output_counts = self._put(np.zeros((num_slots, vocab), np.int32), replicated)
        self.prompt_masks = self._put(np.zeros((num_slots, vocab), np.bool_), replicated)
        self.last_tokens = self._put(np.zeros(num_slots, np.int32), replicated)
        self.context_length = context_length or self.config.max_position_embeddings
        width = pages_for_tokens(self.context_length, page_size)  # the longest sequence's pages
        self.page_table = DevicePageTable(num_slots, width, page_size, self._put, replicated)

        # The weights go in as a flat list (flattening the nnx.State, 182 Variables for the
        # default model, cost ~0.4 ms of host time per step), and as few arrays as they can
        # (runtime/executor/weight_args.py).
        leaves, state_treedef = jax.tree.flatten(state)
        # What the step is made of besides its arguments' shapes: part of its executable cache key.
        # Everything the step closes over that its arguments do not show: a speculative server's
        # step (verify_tokens > 1) has the shapes of a plain one's, not its program.
        self._description = "\n".join([repr(self.config), np.dtype(dtype).name,
                                        f"kv cache {np.dtype(kv_dtype).name}", str(state_treedef),
                                        describe(kernels), f"verify_tokens {verify_tokens}",
                                        draft_head_description(loaded.model)]
                                       + ["hidden rows"] * hidden_rows)
        names = leaf_names(state)
        self._weight_args, weight_layout = weight_args(
            leaves, stack_small=self.mesh.size == 1,
            stack_layers=self.mesh.devices.flat[0].platform == "tpu", names=names)
        del leaves
        # New weights in the place of these, and their memory released (weight_swap.py).
        self.weights = WeightSwap(self, len(self._weight_args), dotted_names(state),
                                  weight_layout, quantized_activations)
        # LoRA slots after the model's arguments (lora_slots.py): weights the step also takes.
        self.lora = lora_slots_for(lora, kernels, self.config, dtype, self.mesh, num_slots,
                                   len(self._weight_args))
        self._weight_args += self.lora.args()
        self.lora.weights = self._weight_args  # whose tail a slot write or assignment updates
        self._description += self.lora.description
        del state
        if advised := advise_huge_pages(self._weight_args):  # a CPU decode step streams them
            logger.info("Weights on huge pages: %.2f GB", advised / 2**30)
        # What the step and a draft head's own programs (drafts/draft_head.py) are made of.
        self.program_parts = (graphdef, state_treedef, weight_layout, kv_sharding)
        self._lora_args = self.lora.step_args
        step = self._make_step()
        if choose_weight_layouts is None:
            # TPU only: there the default layouts had each step relay weights out (64 fused
            # relayouts in v6e's 8B step); XLA's choice on an H100 is the default layouts.
            # (Start-up passes False with a draft head: its draft steps take the same weights
            # in the layouts a plain jit takes.) LoRA slots are chosen with the weights and then
            # written in their layouts (LoraSlots.adopt): with the default layouts, the v6e
            # step of Llama-3.1-8B's first 8 layers (tp 4, 64 rows) moved 7.10 GB, 5.76 GB with
            # XLA's, the base model's 5.17 (docs/performance.md, "LoRA adapters").
            choose_weight_layouts = (self.mesh.devices.flat[0].platform == "tpu"
                                     and replicated.is_fully_addressable)
        # The step whose weight layouts XLA chooses, until `precompile` has used it.
        self._choosing_step = (self._make_step(auto_formats(self._weight_args))
                               if choose_weight_layouts else None)

        @functools.partial(jax.jit, donate_argnums=(0, 1), out_shardings=(replicated, replicated))
        def reset_slots(output_counts, prompt_masks, slots, counts_rows, prompt_mask_rows):
            return (output_counts.at[slots].set(counts_rows),
                    prompt_masks.at[slots].set(prompt_mask_rows))

        self._step = step
        self._reset_slots = reset_slots
        self._reset_programs: dict[int, object] = {}  # rows -> assign_slots' compiled program
        self._precompiled = False
        self._programs: dict[tuple, object] = {}  # (shape, widths, needs) -> its compiled step
        self._replicated = replicated
        self.bitmask_words = -(-vocab // 32)
        self.inputs = RepeatedInputs(self._put, replicated, self.bitmask_words, self.config,
                                     dtype)
        self.layouts: dict[tuple, object] = {}  # step_inputs.layout_for's, by bucket (multi-host)

    def _make_step(self, weight_formats=None):
        """The jitted serving step (step_program.make_step) of this runner's model, kernels,
        speculation and LoRA slots; `weight_formats`: make_step's (None: the weights' own)."""
        graphdef, state_treedef, weight_layout, kv_sharding = self.program_parts
        return make_step(graphdef, state_treedef, weight_layout, self.kernels, self.mesh,
                         kv_sharding, weight_formats, verify_tokens=self.verify_tokens,
                         lora=self._lora_args, takes_images=self.takes_images,
                         hidden_rows=self.hidden_rows)

    @property
    def kv_caches(self) -> list[jax.Array]:
        """The KV pool, once zeroed (the first call waits for the thread)."""
        if self._kv_caches is None:
            self._kv_caches = self._kv_pool.result()
            self._kv_pool = None
        return self._kv_caches

    @kv_caches.setter
    def kv_caches(self, caches: list[jax.Array]) -> None:
        self._kv_caches = caches

    def kv_caches_held(self) -> bool:
        """Whether the KV pool is on the devices (or being zeroed), not released."""
        return self._kv_caches is not None or self._kv_pool is not None

    def release_kv_caches(self) -> None:
        """Frees the KV pool's device memory (RL rollouts: nothing runs until `resume`)."""
        if self.kv_caches_held():
            for cache in jax.tree.leaves(jax.block_until_ready(self.kv_caches)):
                cache.delete()
        self._kv_caches = self._kv_pool = None

    def resume_kv_caches(self) -> None:
        """A zeroed KV pool again, of the released one's shapes."""
        if not self.kv_caches_held():
            self._kv_caches = init_kv_pool(
                self.config, self.num_pages, self.page_size, self.kv_dtype, self.mesh,
                draft_head=self.draft_head_pool, state_slots=self.state_slots)

    def assign_slots(self, assignments) -> None:
        """Start (or, after a retraction, resume) requests in their slots: each (slot, prompt_ids,
        output_ids) gets its output counts and prompt mask, built on the host, one device call
        for one request and one per `ASSIGN_ROWS` for more. A call per request cost ~0.3 ms of
        the engine thread each, i.e. several ms of a step that admits several
        (benchmarks/bench_host_step.py, the admission case). A partial call's rows are padded
        with rows for the null slot (zeros, what it holds: padding rows sample nothing), so two
        programs serve any number; `precompile` compiles both."""
        if not assignments:
            return
        self.sink.assign_slots(assignments)
        vocab = self.config.vocab_size
        rows = 1 if len(assignments) == 1 else ASSIGN_ROWS
        for start in range(0, len(assignments), rows):
            slots = np.full(rows, NULL_SLOT, np.int32)
            masks = np.zeros((rows, vocab), np.bool_)
            counts = np.zeros((rows, vocab), np.int32)
            for i, (slot, prompt_ids, output_ids) in enumerate(assignments[start:start + rows]):
                slots[i] = slot
                masks[i, np.asarray(prompt_ids, np.int64)] = True
                counts[i] = np.bincount(np.asarray(output_ids, np.int64), minlength=vocab)
            reset = self._reset_programs.get(rows, self._reset_slots)
            self.output_counts, self.prompt_masks = reset(
                self.output_counts, self.prompt_masks, slots, counts, masks)

    def _compile_reset_slots(self) -> None:
        """The two `assign_slots` programs and `write_pages`' (and the LoRA slot write),
        compiled before serving."""
        self.page_table.compile()
        self.lora.compile()
        vocab = self.config.vocab_size
        for rows in (1, ASSIGN_ROWS):
            self._reset_programs[rows] = self._reset_slots.lower(
                self.output_counts, self.prompt_masks, np.zeros(rows, np.int32),
                np.zeros((rows, vocab), np.int32), np.zeros((rows, vocab), np.bool_)).compile()

    def step(self, batch: ForwardBatch, sampling: SamplingMetadata, slots: np.ndarray,
             token_bitmask: np.ndarray | None = None) -> StepOutput:
        """Run one step; returns device arrays (the caller's `np.asarray` is the sync point).
        `slots` has a row per sequence row of the batch, NULL_SLOT for padding.
        `token_bitmask` (i32[sample rows, bitmask_words]): the grammar masks, None when no row
        has one."""
        return self.run(self.stage(batch, sampling, slots), token_bitmask)

    def sample_rows(self, shape) -> int:
        """The sample rows of a step of bucket shape (tokens, seqs, pages): `Buckets.sample_rows`
        with the server's largest sequence bucket (`max_seqs`, which start-up sets)."""
        return sample_rows_for(shape[0], shape[1], self.verify_tokens, self.max_seqs)

    def stage(self, batch: ForwardBatch, sampling: SamplingMetadata, slots: np.ndarray) -> "StagedStep":
        """The step's inputs but the grammar masks, sent to the device as two vectors, and the
        sampling tables as two more (or those already there: `_tables`): the engine stages a
        step before the tokens its masks depend on are known (runtime/engine/core.py, EngineCore._loop)."""
        if len(slots) != batch.shape[1]:
            raise ValueError(f"{len(slots)} slots for a batch of {batch.shape[1]} sequence rows")
        tokens, seqs, _ = batch.shape
        writes, updates, overflow = self.page_table.step_writes(slots, batch.page_ids, tokens,
                                                                seqs)
        copies = any(batch.state_copies) and self.no_copies.taking(*batch.state_copies)
        host = step_vectors(self.rope, batch, sampling, slots, writes, copies or self.no_copies)
        ints, floats = self._placed(host[:2])
        _, table_host, tables, table_layout = self.inputs.tables(sampling)
        # ~20 us of numpy over the rows' parameters; the sampled tokens play no part, so the
        # engine can stage a step before it reads the previous one.
        needs = (RUN_TIME if self.step_variants is None else
                 needs_of(sampling, batch.target_ids, grammar=False))
        return StagedStep(ints, floats, tables, (host[2], table_layout), batch.shape,
                          (sampling.logit_bias_ids.shape[1], sampling.suppressed_ids.shape[1]),
                          (*host[:2], *table_host), needs,
                          updates, overflow, tree_width=batch.tree_width,
                          input_embeds=self.inputs.image_rows(batch.input_embeds, tokens))

    def _placed(self, vectors: tuple[np.ndarray, np.ndarray]) -> tuple:
        """The step's int32 and float32 vectors as its call takes them: numpy arrays, which the
        call transfers (one process), or global device arrays put by each process."""
        return vectors if self._vectors_in_call else self._put(vectors, self.output_counts.sharding)

    def run(self, staged: "StagedStep", token_bitmask: np.ndarray | None = None) -> StepOutput:
        """Dispatches a staged step with its grammar masks (None: no row has one). Steps run in
        the order they were staged: each one's page-table writes are relative to the last."""
        if staged.overflow_writes is not None:
            self.write_pages(*staged.overflow_writes)
        self.sink.step(staged, token_bitmask)  # the followers make the same call first
        args = step_args(self._state(self.kv_caches), (staged.ints, staged.floats, *staged.tables),
                         self.inputs.bitmask(self.sample_rows(staged.shape), token_bitmask),
                         staged.image_args)
        needs = self._program_needs(staged.needs, token_bitmask is not None)
        (out, self.kv_caches, self.output_counts, self.last_tokens,
         self.page_table.array) = self._dispatch(staged, args, needs, {"needs": needs})
        return self.sink.ran(out)

    def _dispatch(self, staged: "StagedStep", args: tuple, needs, options: dict) -> tuple:
        """The step's outputs on `args`: the precompiled program of the staged shape and
        variant, or (none precompiled) the jitted step with `options`, which logs COMPILED
        WHILE SERVING once `precompile` has run; then the staged page-table rows are the
        record's. A generation step's `run` and an embedding step's share it."""
        program = self._programs.get((staged.shape, staged.widths, needs, staged.tree_width))
        if program is not None:
            outputs = program(*args)
        else:
            compiled_before = self._step._cache_size()
            outputs = self._step(*args, layout=staged.layout, **options)
            if self._precompiled and self._step._cache_size() > compiled_before:
                warn_compiled_while_serving(staged.shape, staged.widths, needs,
                                            staged.tree_width)
        self.page_table.rows.commit(staged.page_updates)
        return outputs

    def _state(self, kv) -> tuple:
        """The step's state arguments (step_inputs.step_args) over `kv`: the caches, or their
        shapes for a compile."""
        return (self._weight_args, kv, self.output_counts, self.last_tokens,
                self.page_table.array, self.prompt_masks)

    def put_replicated(self, arrays):
        """`arrays` on every device of the mesh (over several processes: each process's)."""
        return self._put(arrays, self._replicated)

    def write_pages(self, positions: np.ndarray, pages: np.ndarray) -> None:
        """Writes into the flattened page table (page_table.PageWrites): a step's writes past its
        own room, sent before it (`run`); the followers make the same calls."""
        self.sink.write_pages(positions, pages)
        self.page_table.write(positions, pages)

    def _program_needs(self, needs: StepNeeds | None, grammar: bool) -> StepNeeds | None:
        """The program a step with `needs` (and grammar masks, or not) runs."""
        if needs is RUN_TIME:
            return RUN_TIME
        # A follower runs what its leader staged, whatever its own `step_variants`.
        return program_needs(dataclasses.replace(needs, grammar=grammar),
                             self.step_variants or ACCELERATOR_VARIANTS)

    def compile_count(self) -> int:
        """Programs compiled or loaded: the precompiled ones and any the jitted step compiled."""
        return len(self._programs) + self._step._cache_size()

    def compiled_step(self, tokens: int, seqs: int, pages: int,
                      needs: StepNeeds | None = RUN_TIME):
        """The step compiled for one bucket shape (for its memory analysis and HLO text): the
        program of a step with `needs` (RUN_TIME: of an idle step)."""
        needs = needs or StepNeeds()
        args, kwargs = self._lowering_args((tokens, seqs, pages),
                                           self._program_needs(needs, needs.grammar))
        return self._step.lower(*args, **kwargs).compile()

    def program_variants(self) -> list[StepNeeds | None]:
        """The programs precompiled per bucket: RUN_TIME alone, or each static variant."""
        return [RUN_TIME] if self.step_variants is None else list(self.step_variants)

    def precompile(self, shapes, *, cache: ExecutableCache | None = None,
                   progress: bool = True, tree_shapes=(), tree_width: int = 0,
                   threads: int = 1) -> None:
        """Compile (or load from `cache`) one step per (tokens, seqs, pages) shape and program
        variant (`program_variants`), `threads` at a time, the tree program (`tree_width`) of
        each of `tree_shapes`, and the programs of `assign_slots` and `write_pages`:
        runtime/executor/precompile.py. Over several processes, run an idle step of each."""
        keys = [(tuple(shape), 0) for shape in shapes]
        keys += [(tuple(shape), tree_width) for shape in tree_shapes]
        if self.sink.replays:
            run_idle_steps(self, keys, progress)
        else:
            for (shape, needs, tree), program in compile_steps(self, keys, cache, progress,
                                                               threads).items():
                self._programs[(shape, self.program_widths, needs, tree)] = program
            self.lora.adopt(self._weight_args)  # as the weights now are (choose_weight_layouts)
            self._compile_reset_slots()
        self._precompiled = True

    def _lowering_args(self, shape, needs: StepNeeds | None, tree_width: int = 0):
        """The step's arguments for a bucket shape (and tree width), the KV pool as shapes only
        (it may not be zeroed yet), and its static layout and needs."""
        rows, (tokens, seqs, pages) = self.sample_rows(shape), shape
        host, layout = idle_vectors(self.rope, self.page_table.idle_writes(tokens, seqs),
                                    self.no_copies, tokens, seqs, pages, rows, tree_width)
        tables = self.inputs.tables(greedy_sampling(rows))[2]
        args = step_args(self._state(self.kv_specs), (*self._placed(host[:2]), *tables),
                         self.inputs.bitmask(rows, None), self.inputs.idle_image_args(tokens))
        return args, {"layout": layout, "needs": needs}
