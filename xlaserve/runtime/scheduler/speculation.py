"""Speculative decoding's host side: the scheduler's Speculator, which holds which tokens a request
drafts (`Speculator.drafts`), which of them the step that verified them accepts
(`Speculator.take_verified`), and its counts. Standard library only (the scheduler's contract).

A decoding request that speculates runs one *verified row*: its last token and up to
`num_draft_tokens - 1` drafted ones, `[t, d1, ..., dk]`, one multi-token row of the ragged
batch (the attention kernels take it like a prompt chunk). The step samples a token after each
of the row's tokens, each with the request's own parameters and the key `(seed, output
position)` a plain decode step would use there (runtime/sampling/sampler.py). `accepted` then
keeps the sampled tokens up to and including the first that differs from the draft it stands
beside: every kept token was sampled from the model's distribution given the tokens before it,
which are the request's real tokens. So greedy output equals plain decoding's, and a sampled
request keeps the model's distribution exactly (and, being keyed by output position, draws what
plain decoding would draw with the same seed). For a drafter that proposes one token (no draft
distribution), this is rejection sampling with a one-hot draft: a draft is accepted with the
model's probability of it, and on rejection the token comes from the model's distribution
without it.

The drafter here is NGRAM (SGLang's `--speculative-algorithm NGRAM`, vLLM's prompt lookup): the
longest run of the request's last tokens (`min_match`..`max_match` long) that occurred earlier
in its prompt or output proposes the tokens that followed it there. A constrained request's
drafts are cut where its grammar stops taking them, and each sample row of its verified row is
masked by the grammar as it would be after the drafts before it (Grammar.states_after); its
matcher then consumes the accepted tokens alone. Penalties count the drafts before each sample
row's token, and the step keeps (counts, and writes as the slot's last token) the accepted
prefix by this same rule (runtime/executor/verified_rows.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol, Sequence

from xlaserve.runtime.scheduler.page_allocator import pages_for_tokens
from xlaserve.runtime.scheduler.request import Request, SampledRow, SeqChunk

# Occurrences of a window's first token looked at per draft, the latest first: a common token
# (a space, a comma) occurs thousands of times in a long prompt.
MAX_CANDIDATES = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """The server's --speculative-* flags, as the scheduler uses them."""

    num_draft_tokens: int  # tokens of a verified row at most: the last token and the drafts
    min_match: int = 1
    max_match: int = 12
    max_batch: int | None = None  # speculate only while at most this many requests run

    @property
    def max_drafts(self) -> int:
        return self.num_draft_tokens - 1

    @classmethod
    def from_server_args(cls, args) -> "SpeculativeConfig | None":
        if not args.speculative_algorithm:
            return None
        return cls(args.speculative_num_draft_tokens,
                   args.speculative_ngram_min_match_window_size,
                   args.speculative_ngram_max_match_window_size,
                   args.speculative_disable_by_batch_size)


class NgramIndex:
    """Where each token of one request's ids occurred (built as the request grows), to find the
    latest earlier occurrence of its last tokens. One list entry per token: ~40 bytes a token,
    where a dict of every n-gram up to 12 would hold 12 tuples a token."""

    def __init__(self, min_match: int, max_match: int):
        self.min_match, self.max_match = min_match, max_match
        self._positions: dict[int, list[int]] = {}  # token -> indices where it occurs
        self._indexed = 0  # ids[:_indexed] are in `_positions`

    def draft(self, ids: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` ids that followed the longest earlier match of the end of `ids`
        (at least `min_match` and at most `max_match` tokens long; the latest of equal ones),
        or none."""
        n = len(ids)
        # Index every token that has a successor: the last one's occurrence is the query.
        for i in range(self._indexed, n - 1):
            self._positions.setdefault(ids[i], []).append(i)
        self._indexed = max(self._indexed, n - 1)
        if max_tokens <= 0 or n < self.min_match + 1:
            return []
        candidates = self._positions.get(ids[-1])
        if not candidates:
            return []
        best_len, best_end = 0, -1
        for end in reversed(candidates[-MAX_CANDIDATES:]):  # ids[end] == ids[-1], end < n - 1
            length = 1
            while (length < self.max_match and end - length >= 0
                   and ids[end - length] == ids[n - 1 - length]):
                length += 1
            if length > best_len:
                best_len, best_end = length, end
                if length == self.max_match:
                    break
        if best_len < self.min_match:
            return []
        return ids[best_end + 1:best_end + 1 + max_tokens]


# A request whose verified row kept no draft waits 2, 4, ... up to this many tokens before it
# drafts again: a rejected draft costs a verified row's extra tokens (on a 2-core CPU a 5-token row
# cost ~1.75x a decode step) and the overlap of host and device work.
MAX_BACKOFF = 32
# A request backing off does not by itself end a run of overlapped steps when its wait is over:
# its try waits for a step read first anyway (an admission, another request's draft), or for this
# many overlapped steps in a row. Every step a request is to draft in is read before the next is
# scheduled, which cost 2-5% of a 16-32 request batch's throughput on text that repeats nothing
# (2-core CPU) when each try ended the overlap.
PROBE_EVERY = 16


def wants_drafts(request, ahead: int = 0) -> bool:
    """Whether the request drafts for the token it samples `ahead` tokens after its output so far:
    it can speculate, its back-off is over and a draft would fit in max_new_tokens."""
    n = len(request.output_ids) + ahead
    return n >= request.speculation.next_try and request.max_new_tokens - n > 1


def after_verified_row(request, num_drafts: int, accepted_drafts: int, max_drafts: int) -> None:
    """The drafting policy, per request, from what its last verified row kept: all its drafts,
    one more draft next time (up to `max_drafts`); some, as many as it kept; none, no draft for
    2, 4, ... MAX_BACKOFF tokens, then one. Plain decoding costs nothing a draft could have
    saved, so a request whose text does not repeat soon decodes (overlapped) as without
    speculation; one that starts copying is back at `max_drafts` a few rows later."""
    state = request.speculation
    if accepted_drafts == 0:
        state.misses += 1
        state.next_try = len(request.output_ids) + min(2 ** state.misses, MAX_BACKOFF)
        state.draft_limit = 1
        return
    state.misses = 0
    grown = num_drafts + 1 if accepted_drafts == num_drafts else accepted_drafts
    state.draft_limit = min(grown, max_drafts)


class Draft(NamedTuple):
    """A decoding request's drafts for its verified row: a chain of tokens (`row_parents` None:
    each after the one before) or a tree's (DraftTree, which has the same two fields)."""

    tokens: Sequence[int]
    row_parents: list[int] | None = None  # SeqChunk.tree_parents of the row


NO_DRAFT = Draft(())  # a plain decode row


@dataclass(frozen=True)
class DraftTree:
    """A tree of drafts (--speculative-eagle-topk > 1, executor/drafts/draft_head.py): each node after its
    parent, `parents[j]` 0 for the request's last token (the verified row's root) or i for the
    i-th node (1-based: the row's token index); siblings' tokens distinct. Its first child of
    each node is the drafter's likeliest."""

    tokens: list[int]
    parents: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def row_parents(self) -> list[int]:
        """SeqChunk.tree_parents of its verified row: -1 for the root (the request's last
        token), then each node's parent."""
        return [-1, *self.parents]

    def cut(self, n: int) -> "DraftTree":
        """Its first `n` nodes (a tree: each parent comes before its children)."""
        return DraftTree(self.tokens[:n], self.parents[:n])

    def first_path(self) -> list[int]:
        """The tokens of the path through each node's first child: the likeliest chain."""
        path, at = [], 0
        for j, parent in enumerate(self.parents):
            if parent == at:
                path.append(self.tokens[j])
                at = j + 1
        return path

    def without(self, drop) -> "DraftTree":
        """The tree without the nodes whose token `drop(token)` is true, and their subtrees."""
        kept = {0: 0}  # old row index -> new
        tokens, parents = [], []
        for j, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if parent in kept and not drop(token):
                tokens.append(token)
                parents.append(kept[parent])
                kept[j + 1] = len(tokens)
        return DraftTree(tokens, parents)


def row_depths(chunk: SeqChunk) -> list[int]:
    """Each token's depth in its verified row: its offset in a chain, its depth in a tree."""
    if chunk.tree_parents is None:
        return list(range(1 + chunk.num_drafts))
    depths: list[int] = []
    for parent in chunk.tree_parents:
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
    return depths


def walk(chunk: SeqChunk, sampled: list[int]) -> list[int]:
    """The row tokens a verified tree row keeps (its root first), by the target's tokens: from
    the root, the child whose token the target sampled after it, until none is."""
    children = {(parent, chunk.token_ids[j]): j for j, parent in enumerate(chunk.tree_parents)
                if j}
    path = [0]
    while (child := children.get((path[-1], int(sampled[path[-1]])))) is not None:
        path.append(child)
    return path


def constrained(request, draft):
    """A tree (DraftTree) without its stop ids' nodes, or, for a request with a grammar, its
    likeliest chain constrained as below (a grammar's masks follow one chain)."""
    if isinstance(draft, DraftTree):
        if request.grammar is None:
            return draft.without(request.stop_token_ids.__contains__)
        draft = draft.first_path()
    return constrained_chain(request, draft)


def constrained_chain(request, draft: list[int]) -> list[int]:
    """`draft` cut before its first stop id and, for a request with a grammar, where the grammar
    stops taking it."""
    for i, token in enumerate(draft):
        if token in request.stop_token_ids:
            draft = draft[:i]
            break
    if request.grammar is not None and draft:
        draft = draft[:request.grammar.valid_prefix(draft)]
    return draft


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many of a verified row's sampled tokens (one per row token: `len(drafts) + 1`) the
    request keeps: those up to and including the first that differs from its draft."""
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return i + 1
    return len(drafts) + 1


# --- the scheduler's speculator -----------------------------------------------------------------

class _Scheduler(Protocol):
    """What a Speculator uses of the scheduler that calls it (not imported here)."""

    running: list[Request]
    waiting: list[Request]
    max_running_requests: int
    page_size: int
    allocator: Any  # page_allocator.PageAllocator
    cache: Any  # prefix_cache.RadixCache
    prefix: Any  # prefix_reuse.PrefixReuse
    log: Any  # scheduler.StepLog

    def new_pages(self, request: Request, kv_len: int) -> int: ...

    def grow(self, request: Request, kv_len: int) -> None: ...

    def take_token(self, request: Request, token: int, finished: list[Request]) -> None: ...


class Speculator:
    """Speculative decoding's state in the scheduler, built at start-up (engine/startup.py) with
    --speculative-algorithm: the flags, the drafter, and the verified rows and kept drafts since
    start (/metrics). The Scheduler calls it unconditionally; without speculation it holds
    scheduler.NoSpeculation, which drafts nothing and keeps no count."""

    verifies = True  # a step's row may give its request several tokens (live_requests.py)

    def __init__(self, config: SpeculativeConfig,
                 drafter: Callable[[list[Request], list[int]], list] | None = None):
        """`drafter`: a draft model's or head's proposals, (requests, rooms) -> drafts
        (runtime/executor/drafts/); None: NGRAM, drafted here. A drafter follows every step, so
        no step is a continuation."""
        self.config = config
        self.drafter = drafter
        self.verified_rows = self.accepted_drafts = 0
        self._continuations = 0  # overlapped steps scheduled in a row (PROBE_EVERY)

    def speculating(self, num_running: int) -> bool:
        """Whether decodes draft now: the batch is small enough (--speculative-disable-by-batch-size)."""
        return self.config.max_batch is None or num_running <= self.config.max_batch

    def stats(self) -> dict:
        """Tokens a verified row kept on average since start (SGLang's `spec_accept_length`;
        0.0 before the first verified row), for /metrics and /get_server_info."""
        if not self.verified_rows:
            return {"spec_accept_length": 0.0}
        return {"spec_accept_length": 1 + self.accepted_drafts / self.verified_rows}

    def drafts(self, scheduler: _Scheduler, decoding: list[Request]) -> list[Draft | DraftTree]:
        """Each decoding request's drafted tokens (a Draft chain or a DraftTree) for a step scheduled
        from the last one's results (which ends a run of continuations): none where the request
        cannot draft now (`wants_drafts`) or nothing matches; none at all when speculation is
        paused (`speculating`), the free pages cannot hold every draft (the plain decodes' pages
        come first) or a prompt may run in the step (a running prompt, or a waiting one with a
        free slot). A step with drafts holds at most `max_running_requests` tokens, so that its
        sample rows fit every bucket's (forward_batch.sample_rows_for) and a prompt step's LM
        head runs on no more rows than without speculation: drafts beyond that are cut, the
        earlier rows first served."""
        self._continuations = 0
        s = scheduler
        if (not decoding or not self.speculating(len(s.running)) or len(decoding) < len(s.running)
                or (s.waiting and len(s.running) < s.max_running_requests)):
            return [NO_DRAFT] * len(decoding)
        spec = self.config
        rooms, room_in_step = [], s.max_running_requests - len(decoding)
        for r in decoding:
            room = 0
            if room_in_step > 0 and wants_drafts(r):
                # The verified row yields its drafts and one more token: within max_new_tokens.
                room = min(r.speculation.draft_limit or spec.max_drafts,
                           r.max_new_tokens - len(r.output_ids) - 1, room_in_step)
                room_in_step -= room
            rooms.append(room)
        needed = sum(s.new_pages(r, r.num_computed + 1 + room) for r, room in zip(decoding, rooms))
        if not any(rooms) or needed > s.cache.available_pages:
            return [NO_DRAFT] * len(decoding)
        if self.drafter is None:
            drafts = [_ngram_draft(spec, r, room) if room else []
                      for r, room in zip(decoding, rooms)]
        else:  # a draft model writes its KV at the drafts' positions: their pages first
            wanting = [(i, r, room) for i, (r, room) in enumerate(zip(decoding, rooms)) if room]
            for _, r, room in wanting:
                s.grow(r, r.num_computed + 1 + room)
            drafts = [[] for _ in decoding]
            proposed = self.drafter([r for _, r, _ in wanting], [room for *_, room in wanting])
            for (i, _, room), draft in zip(wanting, proposed, strict=True):
                drafts[i] = draft.cut(room) if isinstance(draft, DraftTree) else list(draft[:room])
        drafts = [constrained(r, draft) or [] for r, draft in zip(decoding, drafts)]
        for r, draft in zip(decoding, drafts):  # pages past the verified row's go back
            _shrink(s, r, r.num_computed + 1 + len(draft))
        return [draft if isinstance(draft, DraftTree) else Draft(draft) for draft in drafts]

    def reads_first(self, scheduler: _Scheduler, batch) -> bool:
        """Whether the step after `batch` must be scheduled from its results, not as a
        continuation; counts the continuations in a row where it need not."""
        if self._reads_first(scheduler, batch):
            return True
        self._continuations += 1
        return False

    def _reads_first(self, scheduler: _Scheduler, batch) -> bool:
        if self.drafter is not None:
            return True  # the draft model's inputs come from the host (executor/drafts/)
        if batch.decode is None and any(c.num_drafts for c in batch.chunks):
            return True  # which tokens a verified row keeps is the host's to decide
        if not self.speculating(len(scheduler.running)):
            return False
        # The next step drafts from this one's tokens: read them first, for a request whose
        # drafts were kept (or that never drafted); one backing off waits (PROBE_EVERY).
        wanting = [r for r in batch.requests
                   if r.status == "running" and wants_drafts(r, batch.ahead + 1)]
        return bool(wanting) and (self._continuations >= PROBE_EVERY
                                  or any(r.speculation.misses == 0 for r in wanting))

    def take_verified(self, scheduler: _Scheduler, request: Request, chunk: SeqChunk,
                      tokens: list[int], row: int, finished: list[Request],
                      sampled: list[SampledRow]) -> None:
        """A verified row's results: the accepted tokens in order (`accepted`), each taken as a
        plain step's would be, so a stop id, the length or a stop among them ends the request
        there; the KV of the row's tokens up to the last accepted one is kept, and the pages
        past what the request now holds go back (the rejected drafts' KV is never read: the
        next step writes those positions again)."""
        s = scheduler
        path = (list(range(accepted(chunk.token_ids[1:], tokens))) if chunk.tree_parents is None
                else walk(chunk, tokens))
        keep = len(path)
        request.speculation.verify_ct += 1
        request.speculation.accepted_drafts += keep - 1
        self.verified_rows += 1
        self.accepted_drafts += keep - 1
        s.log.verified(keep - 1)
        for j in path:  # the step moved a tree path's KV to its positions (verified_rows.py)
            request.num_computed += 1  # row token j (the last token, then accepted drafts)
            token = int(tokens[j])
            s.take_token(request, token, finished)
            sampled.append(SampledRow(request, token, row + j, len(request.output_ids)))
            if request.status != "running":
                return  # ended (pages released) at this token: the rest are dropped
        most = self.config.max_drafts
        if chunk.tree_parents is not None:  # one path of a tree is kept: whole trees while any is
            after_verified_row(request, most, most if keep > 1 else 0, most)
        else:
            after_verified_row(request, chunk.num_drafts, keep - 1, most)
        s.prefix.share_computed_pages(request)
        _shrink(s, request, request.num_computed + 1)


def _ngram_draft(spec: SpeculativeConfig, r: Request, room: int) -> list[int]:
    if r.speculation.ngram is None:
        r.speculation.ngram = NgramIndex(spec.min_match, spec.max_match)
    return r.speculation.ngram.draft(r.all_ids(), room)


def _shrink(scheduler: _Scheduler, request: Request, kv_len: int) -> None:
    """Gives back the pages past those `kv_len` tokens need (a verified row's unused or rejected
    drafts'): never cached ones, which hold computed tokens only."""
    keep = pages_for_tokens(kv_len, scheduler.page_size)
    if len(request.page_ids) > keep:
        scheduler.allocator.free(request.page_ids[keep:])
        del request.page_ids[keep:]
