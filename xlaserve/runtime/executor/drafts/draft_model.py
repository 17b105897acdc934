"""STANDALONE speculative decoding (`--speculative-draft-model-path`): a small model with the
target's vocabulary drafts each request's next tokens, which the target verifies in one step
(runtime/scheduler/speculation.py).

The draft model has its own ModelRunner: its own weights, KV pool and compiled steps, the same
buckets, page size, pages and slots as the target's. Its KV pool mirrors the target's page for
page: page `p` of a request holds the same tokens in both pools, so the scheduler's page lists,
the prefix cache and retraction serve both, and nothing is allocated twice. It stays in step by
its step hooks (`after_stage`, `after_run`): every target step's inputs (prompt chunks, decodes, verified rows) run through the
draft model too, right after the target's step, so its cache holds every token the target
computed. `propose` then drafts: up to `k` decode steps of the draft model, greedy, the first on
each request's last token (from the host) and each next one on the token the last step sampled
in the request's slot (on the device), read back once at the end. Greedy drafts keep every
output exact: the target samples each token of a verified row from its own distribution and
keeps those up to the first that differs from its draft (a sampled request then accepts a draft
with the target's probability of it, where rejection sampling against the draft's distribution
would accept with sum(min(p, q)); the text is what plain decoding gives with the same seed).
"""
from __future__ import annotations

import numpy as np

from xlaserve.runtime.executor.forward_batch import Buckets, make_forward_batch
from xlaserve.runtime.executor.step_inputs import greedy_sampling
from xlaserve.runtime.scheduler.request import SeqChunk


class DraftModel:
    def __init__(self, runner, buckets: Buckets):
        """`runner`: the draft model's ModelRunner, built with the target's pages, page size,
        slots and verified-row size; `buckets`: the target's."""
        self.runner = runner
        self.buckets = buckets

    # The engine's step hooks (runtime/engine/steps.py): every target step runs here too.

    def after_stage(self, staged, batch, sampling, slots) -> None:
        """Stages the target step's batch, sampling and slots on the draft model's runner."""
        staged.draft = self.runner.stage(batch, sampling, slots)

    def after_run(self, staged) -> None:
        """Dispatches the draft model's step right after the target's (its samples are not
        read): its cache then holds every token the target computed."""
        self.runner.run(staged.draft)

    def propose(self, requests: list, rooms: list[int]) -> list[list[int]]:
        """Up to `rooms[i]` greedy draft tokens for each request (running, decoding, its pages
        grown to hold `num_computed + 1 + rooms[i]` tokens): `max(rooms)` draft decode steps, a
        request in the first `rooms[i]` of them."""
        page_size = self.runner.page_size
        steps = []
        for j in range(max(rooms)):
            rows = [i for i, room in enumerate(rooms) if room > j]
            # Page lists copied: the device page table skips a row whose list is the one it
            # last wrote (page_table.py), and the scheduler extends a request's in place.
            chunks = [SeqChunk([requests[i].output_ids[-1]] if j == 0 else [0],
                               requests[i].num_computed + j, list(requests[i].page_ids), True,
                               input_slot=-1 if j == 0 else requests[i].slot) for i in rows]
            batch = make_forward_batch(chunks, self.buckets, page_size)
            slots = np.zeros(batch.shape[1], np.int32)
            slots[:len(rows)] = [requests[i].slot for i in rows]
            out = self.runner.run(self.runner.stage(batch, greedy_sampling(batch.num_sample_rows),
                                                    slots))
            steps.append((rows, out.sample.tokens))
        drafts: list[list[int]] = [[] for _ in requests]
        for rows, tokens in steps:  # one wait, after every step was dispatched
            for i, token in zip(rows, np.asarray(tokens)[:len(rows)].tolist()):
                drafts[i].append(token)
        return drafts

