"""EAGLE3 and NEXTN speculative decoding: a draft head (model/draft_heads.py) on the target's
own runner drafts each request's next tokens, which the target verifies in one step
(runtime/scheduler/speculation.py).

The head lives on the target model (`model.draft_head`) and in its programs: every serving step
runs it over the step's rows once the target has sampled (draft_head_step.catch_up_head), so
its one-layer cache holds every token the target computed, in the target's pages (the
scheduler's page lists, the prefix cache and retraction serve both), and each request's slot
holds the head's first draft for its next step. `propose` runs the rest, one program
(`draft_head_step.make_chain`) of `num_draft_tokens - 2` single-token head steps, and reads the
drafts back once. Drafts are greedy; the target samples each token of a verified row from its
own distribution and keeps those up to the first that differs from its draft, so every output
is what plain decoding gives with the same seed (a sampled request accepts a draft with the
target's probability of it).
"""
from __future__ import annotations

import logging

import numpy as np

from xlaserve.runtime.executor.draft_head_step import make_chain
from xlaserve.runtime.executor.forward_batch import Buckets, make_forward_batch
from xlaserve.runtime.executor.precompile import warn_compiled_while_serving
from xlaserve.runtime.executor.step_program import SAMPLING_WIDTHS, idle_step
from xlaserve.runtime.sampling.params import RowSamplingParams
from xlaserve.runtime.sampling.sampler import build_sampling_metadata
from xlaserve.runtime.scheduler.request import SeqChunk

logger = logging.getLogger(__name__)
_GREEDY = RowSamplingParams(temperature=0.0, seed=0)


class DraftHead:
    def __init__(self, runner, buckets: Buckets, max_drafts: int):
        """`runner`: the target's ModelRunner, its model carrying the head; `max_drafts`: the
        drafts of a verified row at most (`--speculative-num-draft-tokens` - 1)."""
        self.runner, self.buckets = runner, buckets
        self.steps = max_drafts - 1  # the first draft comes from the serving step
        graphdef, state_treedef, weight_layout, kv_sharding = runner.program_parts
        self._chain = make_chain(graphdef, state_treedef, weight_layout, runner.kernels,
                                 runner.mesh, kv_sharding, runner.config.num_layers, self.steps)
        self._programs: dict[tuple, object] = {}  # shape -> compiled chain
        self._greedy: dict[int, object] = {}
        self._precompiled = False

    def propose(self, requests: list, rooms: list[int]) -> list[list[int]]:
        """Up to `rooms[i]` greedy draft tokens for each request (running, decoding, its pages
        grown to hold `num_computed + 1 + rooms[i]` tokens)."""
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
        staged = self.runner.stage(batch, self._metadata(self.runner.sample_rows(batch.shape)),
                                   slots)
        drafts = np.asarray(self._run(staged, sorted_rooms))
        out: list[list[int]] = [[] for _ in requests]
        for row, i in enumerate(order):
            out[i] = drafts[row, :rooms[i]].tolist()
        return out

    def _run(self, staged, rooms: np.ndarray):
        runner = self.runner
        if staged.overflow_writes is not None:
            runner.write_pages(*staged.overflow_writes)
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
        return drafts

    def chain_shapes(self, max_rows: int) -> list[tuple[int, int, int]]:
        """The bucket shapes a proposal of 1..max_rows requests takes."""
        pages = self.buckets.pages[-1]
        return sorted({self.buckets.shape_for(n, n, pages) for n in range(1, max_rows + 1)})

    def precompile(self, max_rows: int) -> None:
        """The chain program of every shape a proposal can take, compiled before serving."""
        runner = self.runner
        for shape in self.chain_shapes(max_rows):
            staged = runner.stage(*idle_step(*shape, runner.sample_rows(shape)))
            self._programs[shape] = self._chain.lower(
                runner._weight_args, runner._kv_specs, runner.page_table.array, staged.ints,
                staged.floats, np.zeros(shape[1], np.int32), layout=staged.layout[0]).compile()
        self._precompiled = True
        logger.info("Draft head: %d chain programs of %d steps compiled",
                    len(self._programs), self.steps)

    def compile_count(self) -> int:
        return len(self._programs) + self._chain._cache_size()

    def _metadata(self, rows: int):
        if rows not in self._greedy:
            self._greedy[rows] = build_sampling_metadata([_GREEDY], rows, SAMPLING_WIDTHS)
        return self._greedy[rows]
