"""EAGLE3 and NEXTN speculative decoding: a draft head (model/draft_heads.py) on the target's
own runner drafts each request's next tokens, which the target verifies in one step
(runtime/scheduler/speculation.py).

The head lives on the target model (`model.draft_head`) and in its programs: every serving step
runs it over the step's rows once the target has sampled (draft_head_step.catch_up_head), so
its one-layer cache holds every token the target computed, in the target's pages (the
scheduler's page lists, the prefix cache and retraction serve both), and each request's slot
holds the head's state at its last token. `propose` runs one program (`make_chain`): the first
draft from that state (the head's LM head), then `num_draft_tokens - 2` single-token head
steps, each on the last one's draft and state, for rows sorted by their number of drafts (the
rows still drafting at step j are a prefix; the others are padding, which writes no cache), and
reads the drafts back once.
Drafts are greedy; the target samples each token of a verified row from its own distribution
and keeps those up to the first that differs from its draft, so every output is what plain
decoding gives with the same seed (a sampled request accepts a draft with the target's
probability of it).
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.model.transformer import AttentionMetadata
from xlaserve.runtime.executor.forward_batch import Buckets, make_forward_batch
from xlaserve.runtime.executor.kv_pool import layer_pool_arrays
from xlaserve.runtime.executor.drafts.draft_tree import chain_inputs, make_tree_chain, select_tree
from xlaserve.runtime.executor.precompile import warn_compiled_while_serving
from xlaserve.runtime.executor.step_inputs import SAMPLING_WIDTHS, greedy_sampling, idle_step
from xlaserve.runtime.scheduler.request import SeqChunk

logger = logging.getLogger(__name__)


class DraftHead:
    def __init__(self, runner, buckets: Buckets | None, max_drafts: int, topk: int = 1,
                 tree_steps: int = 0):
        """`runner`: the target's ModelRunner, its model carrying the head; `buckets`: the
        server's (None on a multi-host follower, which only replays `_run`); `max_drafts`: the
        drafts of a verified row at most (`--speculative-num-draft-tokens` - 1); `topk` > 1:
        trees of `tree_steps` levels (draft_tree.py; --speculative-eagle-topk and -num-steps)."""
        self.runner, self.buckets, self.topk = runner, buckets, topk
        self.steps = max_drafts - 1  # head steps after the first draft (its slot's state's)
        graphdef, state_treedef, weight_layout, kv_sharding = runner.program_parts
        parts = (graphdef, state_treedef, weight_layout, runner.kernels, runner.mesh,
                 kv_sharding, layer_pool_arrays(runner.config))
        if topk > 1:
            self.steps = tree_steps
            self._chain = make_tree_chain(*parts, topk, tree_steps)
        else:
            self._chain = make_chain(*parts, self.steps)
        self._programs: dict[tuple, object] = {}  # shape -> compiled chain
        self._precompiled = False

    def propose(self, requests: list, rooms: list[int]) -> list:
        """Up to `rooms[i]` greedy draft tokens for each request (running, decoding, its pages
        grown to hold `num_computed + 1 + rooms[i]` tokens), or with topk > 1 a DraftTree of
        as many nodes."""
        if self.topk > 1:  # a tree row is recomputed past the position: within the table
            capacity = self.buckets.pages[-1] * self.runner.page_size
            rooms = [room if r.num_computed + self.topk * self.steps < capacity else 0
                     for r, room in zip(requests, rooms)]
        order = sorted(range(len(requests)), key=lambda i: -rooms[i])
        # Page lists copied: the device page table skips a row whose list is the one it last
        # wrote (page_table.py), and the scheduler extends a request's in place.
        chunks = [SeqChunk([0], requests[i].num_computed, list(requests[i].page_ids), True)
                  for i in order]
        batch = make_forward_batch(chunks, self.buckets, self.runner.page_size)
        slots = np.zeros(batch.shape[1], np.int32)
        slots[:len(order)] = [requests[i].slot for i in order]
        sorted_rooms = np.zeros(batch.shape[1], np.int32)
        sorted_rooms[:len(order)] = [rooms[i] for i in order]
        staged = self.runner.stage(batch, greedy_sampling(self.runner.sample_rows(batch.shape)),
                                   slots)
        drafts = self._run(staged, sorted_rooms)
        out: list = [[] for _ in requests]
        if self.topk > 1:
            (nodes, scores) = jax.tree.map(np.asarray, drafts)
            for row, i in enumerate(order):
                if rooms[i]:
                    out[i] = select_tree(nodes[0, row], nodes[1, row], scores[row], rooms[i])
            return out
        drafts = np.asarray(drafts)
        for row, i in enumerate(order):
            out[i] = drafts[row, :rooms[i]].tolist()
        return out

    def _run(self, staged, rooms: np.ndarray):
        """Dispatches the chain over a staged batch; multi-host, the followers first make the
        same call (runtime/distributed/follower.py replays it through here)."""
        runner = self.runner
        if staged.overflow_writes is not None:
            runner.write_pages(*staged.overflow_writes)
        runner.sink.draft_chain(staged, rooms)
        args = (runner._weight_args, runner.kv_caches, runner.page_table.array, staged.ints,
                staged.floats, rooms)
        program = self._programs.get(staged.shape)
        if program is not None:
            drafts, runner.kv_caches, runner.page_table.array = program(*args)
        else:
            before = self._chain._cache_size()
            drafts, runner.kv_caches, runner.page_table.array = self._chain(
                *args, layout=staged.layout[0])
            if self._precompiled and self._chain._cache_size() > before:
                warn_compiled_while_serving(staged.shape, SAMPLING_WIDTHS, "draft head")
        runner.page_table.rows.commit(staged.page_updates)
        return runner.sink.local(drafts)

    def chain_shapes(self, max_rows: int) -> list[tuple[int, int, int]]:
        """The bucket shapes a proposal of 1..max_rows requests takes."""
        pages = self.buckets.pages[-1]
        return sorted({self.buckets.shape_for(n, n, pages) for n in range(1, max_rows + 1)})

    def precompile(self, max_rows: int) -> None:
        """The chain program of every shape a proposal can take, compiled before serving; over
        several processes, an idle chain of each run by all (as ModelRunner.precompile's steps)."""
        runner = self.runner
        for shape in self.chain_shapes(max_rows):
            staged = runner.stage(*idle_step(*shape, runner.sample_rows(shape)))
            if runner.sink.replays:
                self._run(staged, np.zeros(shape[1], np.int32))
                continue
            self._programs[shape] = self._chain.lower(
                runner._weight_args, runner.kv_specs, runner.page_table.array, staged.ints,
                staged.floats, np.zeros(shape[1], np.int32), layout=staged.layout[0]).compile()
        self._precompiled = True
        logger.info("Draft head: %d %s programs of %d steps compiled", len(self._programs),
                    f"tree (top {self.topk})" if self.topk > 1 else "chain", self.steps)

    def compile_count(self) -> int:
        return len(self._programs) + self._chain._cache_size()



def make_chain(graphdef, state_treedef, weight_layout, kernels, mesh, kv_sharding,
               num_layers: int, steps: int):
    """The jitted drafting: the first draft from each slot's state, then the head's steps
    (`num_layers`: the pool's arrays before the head's, kv_pool.layer_pool_arrays):

        chain(weights, kv_caches, page_table, ints, floats, rooms, *, layout)
            -> (drafts i32[S, steps + 1], kv_caches, page_table)

    over a staged batch of one token per row at each request's next position (its last token's,
    which the target has not run yet), `rooms` i32[S] the drafts each row wants, descending.
    Draft 0 is the slot's state's (the head's output at the last token, which the serving step
    left); draft j + 1 comes from step j."""
    replicated = NamedSharding(mesh, P())

    def chain(weights, kv_caches, page_table, ints, floats, rooms, layout):
        batch, slots, model, page_table, pages = chain_inputs(
            graphdef, state_treedef, weight_layout, weights, page_table, ints, floats, layout)
        head = model.draft_head
        head_kv, states = kv_caches[num_layers:]
        tokens, seqs = batch.input_ids.shape[0], slots.shape[0]
        token_slots = jnp.zeros(tokens, jnp.int32).at[:seqs].set(slots)  # tokens >= seqs
        x_state = states[token_slots]
        ids = head.draft_of_carry(x_state, kernels, model)
        drafts = [ids[:seqs]]
        seq_index = jnp.arange(seqs + 1, dtype=jnp.int32)
        for j in range(steps):
            live = jnp.minimum(jnp.sum(rooms > j + 1), batch.num_seqs[0]).astype(jnp.int32)
            metadata = AttentionMetadata(batch.kv_lens + j, pages,
                                         jnp.minimum(seq_index, live), live[None])
            x, head_kv = head(model.embedding[...], ids, x_state, batch.positions + j, head_kv,
                              metadata, kernels)
            ids, x_state = head.draft(x, kernels, model), head.carry(x)
            drafts.append(ids[:seqs])
        kv_caches = list(kv_caches[:num_layers]) + [head_kv, states]
        return jnp.stack(drafts, axis=1), kv_caches, page_table

    return jax.jit(chain, static_argnames=("layout",), donate_argnums=(1, 2),
                   out_shardings=(replicated, kv_sharding, replicated))
