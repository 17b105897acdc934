"""A generation server's step, in three calls the engine loop makes (core.py, EngineCore._loop):
`stage` (the step's inputs on the device, but the grammar masks), `send` (the masks, then the
dispatch) and `read` (the tokens, into the scheduler). An embedding server's are
pooled_steps.PooledSteps; start-up (startup.py) builds one or the other.

A feature that acts around a step is a hook, built at start-up only where the feature is on and
called here in this order (none on a plain server; each hook defines only the calls it needs):

    before_stage(batch)                       the prefix cache's host-tier copies
                                              (executor/host_kv_pool.HostTierCopies), the
                                              adapters of admitted requests (lora_adapters.py)
    forward_batch(fb, batch) -> fb            images' rows (image_prompts.ImagePrompts)
    after_stage(staged, fb, sampling, slots)  a draft model stages the same batch
    after_run(staged)                         and catches up (executor/drafts/draft_model.py)
    between_steps()                           each loop turn: an adapter's unload ends once its
                                              requests have (lora_adapters.py)
"""
from __future__ import annotations

import dataclasses
import operator

import numpy as np

from xlaserve.runtime.engine.hidden_states import NOT_ENABLED, HiddenStatesRefused
from xlaserve.runtime.engine.messages import StepResult
from xlaserve.runtime.engine.pooled_outputs import (GENERATES, IMAGES_NEED_A_VISION_MODEL,
                                                    WrongKindOfServer)
from xlaserve.runtime.executor.forward_batch import forward_batch_for
from xlaserve.runtime.executor.step_program import StepOutput
from xlaserve.runtime.executor.step_inputs import SAMPLING_WIDTHS
from xlaserve.runtime.sampling.params import build_sampling_metadata
from xlaserve.runtime.scheduler.request import SampledRow
from xlaserve.runtime.scheduler.speculation import row_depths

HOOK_CALLS = ("before_stage", "forward_batch", "after_stage", "after_run", "between_steps")


class NoHiddenStates:
    """--enable-return-hidden-states off (hidden_states.HiddenStates on): a request that asks
    is refused, in SGLang's words; a step reads nothing."""

    def check_rows(self, rows: int) -> None:
        raise HiddenStatesRefused(NOT_ENABLED)

    def rows_for(self, prompt_len: int, max_new_tokens: int, asked: bool) -> None:
        if asked:
            raise HiddenStatesRefused(NOT_ENABLED)
        return None

    def read(self, batch, out, collecting) -> None:
        return None


NO_HIDDEN_STATES = NoHiddenStates()


class GenerationSteps:
    """Stages, sends and reads a generation server's steps (the engine loop's alone)."""

    overlaps = True  # a continuation may be dispatched before the last step is read

    def __init__(self, runner, buckets, scheduler, live_requests, grammar_backend, hooks=(),
                 images=None, hidden_states=NO_HIDDEN_STATES):
        """`images`: a vision model's ImagePrompts (image_prompts.py), else None.
        `hidden_states`: what reads the steps' hidden states for the requests that ask
        (hidden_states.py; --enable-return-hidden-states), else a do-nothing one."""
        self.runner = runner
        self.hidden_states = hidden_states
        self.images = images
        self.buckets = buckets
        self.scheduler = scheduler
        self.live_requests = live_requests
        self.grammar_backend = grammar_backend
        # Each hook call: the hooks that define it, in order.
        self.hooks = {call: [getattr(h, call) for h in hooks if hasattr(h, call)]
                      for call in HOOK_CALLS}
        self._last_sampling = None  # (padded seqs, rows, metadata) of the last step prepared
        # (DecodeRows, padded seqs, metadata) of the last step prepared, a decode continuation
        # none of whose rows suppressed stop ids; else None (_step_sampling).
        self._last_decode = None

    def check_kind(self, embed: bool, prompt_images=None, prompt_len: int = 0) -> None:
        """A request this server can take: images only on a vision model, with the prompt their
        placeholders expanded; not an embedding (WrongKindOfServer)."""
        if prompt_images is not None and (self.images is None
                                       or len(prompt_images.embed_rows) != prompt_len):
            raise ValueError(IMAGES_NEED_A_VISION_MODEL)
        if embed:
            raise WrongKindOfServer(GENERATES)

    def between_steps(self) -> None:
        """Each loop turn, with or without a step: the features' (a plain server has none)."""
        for hook in self.hooks["between_steps"]:
            hook()

    def stage(self, batch):
        """The step's inputs, staged on the device: all but the grammar masks."""
        for hook in self.hooks["before_stage"]:
            hook(batch)
        self.runner.assign_slots([(r.slot, r.prompt_ids, r.output_ids) for r in batch.admitted])
        requests = batch.requests  # one per sample row
        if batch.decode is not None:  # decode rows only: no prompt targets, each row ahead
            fb = forward_batch_for(batch, self.buckets, self.runner.page_size)
            ahead = [batch.ahead] * len(batch.requests)
            sample_index = np.add(batch.decode.output_lens, batch.ahead)
        else:
            fb = forward_batch_for(self.live_requests.with_prompt_targets(batch), self.buckets,
                                   self.runner.page_size)
            ahead = batch.row_ahead()
            if any(c.num_drafts for c in batch.chunks):  # a verified row samples per token,
                # each as the output's token after its drafts (a tree node's: after its depth)
                rows = [(r, a + j) for r, c, a in zip(batch.requests, batch.chunks, ahead)
                        for j in row_depths(c)]
                requests, ahead = [r for r, _ in rows], [a for _, a in rows]
            sample_index = [len(r.output_ids) + a for r, a in zip(requests, ahead)]
        for hook in self.hooks["forward_batch"]:
            fb = hook(fb, batch)
        padded_seqs = fb.shape[1]
        sampling = self._step_sampling(batch, requests, ahead, fb.num_sample_rows)
        sampling.sample_index[:len(requests)] = sample_index
        slots = np.zeros(padded_seqs, np.int32)
        slots[:len(batch.slots)] = batch.slots
        staged = self.runner.stage(fb, sampling, slots)
        for hook in self.hooks["after_stage"]:
            hook(staged, fb, sampling, slots)
        return staged

    def _step_sampling(self, batch, requests: list, ahead: list[int], padded_rows: int):
        """The sampling metadata but `sample_index` of the sample rows (`requests`, each
        `ahead`: a verified row has one per token). A decode continuation of the last step
        prepared, over the same rows, none of which suppressed stop ids there (min_new_tokens:
        once a row stops suppressing it does not start again), has the last step's, with no
        pass over the rows (~40 us of a 256-row step)."""
        last, decode = self._last_decode, batch.decode
        if (decode is not None and last is not None and decode.parent is last[0]
                and decode.kept is None and last[1] == padded_rows):
            self._last_decode = (decode, padded_rows, last[2])
            return last[2]
        # Most rows suppress nothing: a copy of their parameters per step would cost more host
        # time than the rest of the packing (a few ms at 128 rows).
        rows = [dataclasses.replace(r.sampling, suppressed_ids=suppressed)
                if r.min_new_tokens and (suppressed := self.scheduler.suppressed_ids(r, a))
                else r.sampling for r, a in zip(requests, ahead)]
        sampling = self._sampling_metadata(rows, padded_rows)
        suppressing = any(row is not r.sampling for row, r in zip(rows, requests))
        self._last_decode = (None if decode is None or suppressing
                             else (decode, padded_rows, sampling))
        return sampling

    def _sampling_metadata(self, rows: list, padded_rows: int):
        """The rows' sampling metadata; that of the previous step when its rows were the same
        parameter objects (a run of decode steps over the same requests: every column but
        `sample_index`, which the caller writes, is a function of the rows alone). Rebuilding
        it cost ~0.4 ms of a 256-row step (benchmarks/bench_host_step.py); the check, ~10 us.
        The metadata is only read into the step's host vectors (`ModelRunner.stage` copies it)
        before the next step is prepared, so reusing the arrays is safe."""
        cached = self._last_sampling
        if (cached is not None and cached[0] == padded_rows and len(cached[1]) == len(rows)
                and all(map(operator.is_, cached[1], rows))):
            return cached[2]
        sampling = build_sampling_metadata(rows, padded_rows, SAMPLING_WIDTHS)
        self._last_sampling = (padded_rows, rows, sampling)
        return sampling

    def send(self, batch, staged) -> StepOutput:
        """Fills the grammar masks of the constrained rows that sample, from their grammars'
        current state, and dispatches the step; returns its (asynchronous) output."""
        constrained = None
        if batch.any_grammar():  # by sample row: a verified row has one per token
            constrained, row = [], 0
            for r, c in zip(batch.requests, batch.chunks):
                if r.grammar is not None and c.sample and r.status == "running":
                    states = r.grammar.states_after(c.token_ids[1:]) if c.num_drafts else [r.grammar]
                    constrained += [(state, row + j) for j, state in enumerate(states)]
                row += 1 + c.num_drafts
        bitmask = None
        if constrained:
            bitmask = self.grammar_backend.empty_bitmask(self.runner.sample_rows(staged.shape))
            self.grammar_backend.fill_masks(constrained, bitmask)
        out = self.runner.run(staged, bitmask)
        for hook in self.hooks["after_run"]:
            hook(staged)
        return out

    def read(self, batch, out: StepOutput) -> StepResult:
        """Waits for the step's tokens and advances the scheduler; returns the rows that sampled
        (with the step's logprobs, when a row asked for them) for `LiveRequests.deliver`."""
        num_rows = len(batch.requests)  # sample rows: one per row, one per verified draft
        if batch.decode is None:
            num_rows += sum(c.num_drafts for c in batch.chunks)
        sampled = out.sample
        tokens = np.asarray(sampled.tokens)[:num_rows]
        logprobs = top_logprobs = top_ids = None
        if batch.any_logprobs():
            logprobs, top_logprobs, top_ids = (np.asarray(a)[:num_rows] for a in (
                sampled.logprobs, sampled.top_logprobs, sampled.top_ids))
        self.live_requests.collect_prompt_logprobs(batch, out)
        hidden = self.hidden_states.read(batch, out, self.live_requests.hidden_state_rows(batch))
        # Requests that ended while the step ran (abort, stop string) have no row to advance.
        rows: list[SampledRow] = []
        self.scheduler.process_results(batch, tokens.tolist(), rows)
        return StepResult(rows, logprobs, top_logprobs, top_ids, hidden)
