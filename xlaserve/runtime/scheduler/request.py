"""What the scheduler keeps per request and hands the executor per step: a `Request` (its ids,
parameters and KV state), the `SeqChunk` of it one step runs, and the `ScheduledBatch` of them;
`RequestTooLong`, the refusal of a request that could never fit. Standard library only (the
scheduler's contract in pyproject.toml)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from xlaserve.runtime.scheduler.page_allocator import pages_for_tokens

if TYPE_CHECKING:
    from xlaserve.runtime.scheduler.prefix_cache import TreeNode
    from xlaserve.runtime.sampling.params import RowSamplingParams


@dataclass
class SeqChunk:
    """The part of one sequence that a step runs."""

    token_ids: list[int]  # new tokens, at least one
    num_cached: int  # tokens of this sequence already in the KV cache (= first new position)
    page_ids: list[int]  # the sequence's page table; covers num_cached + len(token_ids)
    sample: bool = True  # False for a prefill chunk that does not reach the prompt's end
    # Per new token, the id whose logprob the step computes at that row (prompt logprobs: the
    # next prompt token), -1 for none; None: no row of this chunk has a target.
    target_ids: list[int] | None = None
    # >= 0: the one new token is the one the previous step sampled in this slot, still on the
    # device (a step dispatched before that one was read; `token_ids` holds a placeholder).
    input_slot: int = -1
    # > 0: a speculative verified row (speculation.py): `token_ids` is the last sampled token
    # and this many drafted ones, and the step samples after each of them.
    num_drafts: int = 0
    # A prompt chunk that ends before the prompt does: the prompt's next token (-1: none), which
    # a speculative draft head reads at the chunk's last position.
    next_token: int = -1
    # A verified row that is a tree (--speculative-eagle-topk > 1): each token's parent in the
    # row (-1 for the first, the root), each after its parent, siblings' tokens distinct; None:
    # a chain (token j's parent is j - 1).
    tree_parents: list[int] | None = None
    # A hybrid model's state copies (scheduler/state_reuse.py), (source slot, destination slot):
    # a cached prefix's snapshot into the request's slot before the chunk runs, and the request's
    # state into a snapshot slot after.
    restore: tuple[int, int] | None = None
    snapshot: tuple[int, int] | None = None


FinishReason = tuple[Literal["length", "stop", "abort"], "int | str | None"]


class RequestTooLong(ValueError):
    """A prompt plus max_new_tokens that no state of the engine could ever hold
    (`Scheduler.check_fits`): more than `limit`, the tokens one request may hold (the context
    length, or the whole KV pool's tokens + 1 if that is less), which `where` names
    ("context length" or "KV cache capacity"). The HTTP layer answers OpenAI's
    `context_length_exceeded` from these fields."""

    def __init__(self, message: str, prompt_tokens: int, max_new_tokens: int, limit: int,
                 where: Literal["context length", "KV cache capacity"]):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.limit = limit
        self.where = where

    @classmethod
    def check(cls, prompt_tokens: int, max_new_tokens: int, pooled: bool, context_length: int,
              pool_pages: int, page_size: int) -> None:
        """Scheduler.check_fits: raises RequestTooLong (a ValueError) for a prompt plus
        max_new_tokens over the tokens one request may hold (the context length, or the whole
        pool's tokens + 1: the last sampled token needs no KV), ValueError for an empty prompt
        or no tokens. `pooled`: an embedding request (no tokens; its whole prompt, every token's
        KV, goes into the cache until its last chunk)."""
        fewest_new = 0 if pooled else 1  # an embedding input samples nothing
        limit = cls.token_limit(context_length, pool_pages, page_size, pooled)
        if prompt_tokens < 1:
            raise ValueError("the prompt is empty")
        if max_new_tokens < fewest_new:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if prompt_tokens + max_new_tokens > limit:
            raise cls.over(prompt_tokens, max_new_tokens, limit, context_length, pool_pages,
                           page_size, pooled)

    @staticmethod
    def token_limit(context_length: int, pool_pages: int, page_size: int,
                    pooled: bool = False) -> int:
        """The tokens one request may hold: the context length, or the whole pool's tokens (+ 1
        for a generation: its last sampled token needs no KV) if that is less."""
        return min(context_length, pool_pages * page_size + (0 if pooled else 1))

    @classmethod
    def over(cls, prompt_tokens: int, max_new_tokens: int, limit: int, context_length: int,
             pool_pages: int, page_size: int, pooled: bool) -> "RequestTooLong":
        """The refusal of a request over `limit` (Scheduler.check_fits), saying which bound:
        the context length, or the KV pool's `pool_pages` (an embedding input, `pooled`, keeps
        every token's KV; a generation's last sampled token never enters the cache)."""
        total = prompt_tokens + max_new_tokens
        pool = f"the whole pool has {pool_pages} pages ({pool_pages * page_size} tokens)"
        if total > context_length:
            message = (f"the prompt ({prompt_tokens} tokens) plus max_new_tokens "
                       f"({max_new_tokens}) is {total} tokens, more than the context length "
                       f"({context_length})")
        elif pooled:
            message = (f"the input ({prompt_tokens} tokens) needs "
                       f"{pages_for_tokens(total, page_size)} KV pages but {pool}")
        else:  # the KV peaks at total - 1 tokens
            message = (f"the request needs {pages_for_tokens(total - 1, page_size)} KV pages "
                       f"({total - 1} tokens) but {pool}")
        where = "context length" if limit == context_length else "KV cache capacity"
        return cls(message, prompt_tokens, max_new_tokens, limit, where)


@dataclass(frozen=True)
class Pooled:
    """An embedding request: it samples nothing and ends when the last chunk of its prompt has run
    (`scheduler/pooled.py`); its max_new_tokens is 0. `second_segment`: a BERT cross-encoder's
    (query, document) pair, its tokens from this position on of token type 1 (the document's);
    0: one segment."""

    second_segment: int = 0


@dataclass(frozen=True)
class AdapterRef:
    """A request's LoRA adapter: its load's key (0: none, the base model), which is also its
    namespace in the prefix cache (prefix_cache.py). Its device slot is bound at admission
    (runtime/engine/adapter_slots.py), and may differ each time it is admitted."""

    key: int = 0


BASE_MODEL = AdapterRef()


@dataclass
class SpeculationState:
    """Speculative decoding's state of one request (speculation.py): the drafter's index of its
    ids, the verified rows it ran and the drafts they accepted (SGLang's meta_info
    `spec_verify_ct`); the drafting policy's (speculation.next_drafts): the output length from
    which it drafts again, how many drafts at most, and its verified rows in a row that kept
    none."""

    ngram: Any = None
    verify_ct: int = 0
    accepted_drafts: int = 0
    next_try: int = 0
    draft_limit: int | None = None
    misses: int = 0


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: RowSamplingParams  # the engine fills the seed once, so a retracted request resamples alike
    stop_token_ids: frozenset[int] = frozenset()  # EOS ids + user stop ids, merged by the engine
    min_new_tokens: int = 0  # stop ids cannot finish the request before this many tokens
    priority: int = 0  # larger = more urgent; FCFS within equal priority
    # Compute the whole prompt, reusing no cached prefix: prompt logprobs and hidden states
    # (runtime/engine/hidden_states.py) need every prompt row.
    no_prefix_reuse: bool = False
    # A request's features, each grouped (None or a do-nothing value when unused):
    pooled: Pooled | None = None  # an embedding request (an embedding server's)
    adapter: AdapterRef = BASE_MODEL  # its LoRA adapter
    # A vision model's prompt with images (runtime/executor/image_rows.PromptImages):
    # the images' embedding rows and multimodal RoPE positions the executor reads, and the
    # prompt's prefix-cache key (`cache_ids`). None: text only.
    prompt_images: Any = None
    # Structured outputs: the request's grammar state (runtime/sampling/grammar.Grammar), advanced by
    # every sampled token here; it survives retraction, having consumed exactly output_ids.
    grammar: Any = None
    arrival_time: float = field(default_factory=time.monotonic)
    admitted_time: float | None = None  # when first scheduled (its queue time: a trace's)
    # --- state, managed by the scheduler ---
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens of all_ids() whose KV is in the cache
    page_ids: list[int] = field(default_factory=list)
    slot: int | None = None  # row of the device penalty state, 1..max_running_requests
    status: Literal["waiting", "running", "finished"] = "waiting"
    finish_reason: FinishReason | None = None
    error: str | None = None  # why the scheduler ended it as failed (its final chunk's error)
    num_cached_prompt_tokens: int = 0  # prompt tokens the prefix cache served at first admission
    cache_node: TreeNode | None = None  # the prefix-cache path this running request locks
    retracted_count: int = 0
    weight_version: str = "default"  # of the weights that sampled its last token
    speculation: SpeculationState = field(default_factory=SpeculationState)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def cache_ids(self) -> list[int]:
        """The ids the prefix cache keys this request's KV by: `all_ids()`, but an image's
        placeholder tokens are its own key (PromptImages.cache_key: an image's hash), so
        that prompts alike but for their images share no KV."""
        if self.prompt_images is None:
            return self.prompt_ids + self.output_ids
        return self.prompt_images.cache_key + self.output_ids

    def whole_span_end(self, start: int, end: int) -> int:
        """`end`, or the start of the whole span it falls inside (Gemma 3's images, whose tokens
        attend to one another: PromptImages.whole_spans), but not before `start`: where a
        step's run of tokens from `start`, or a cached prefix from 0, may end."""
        if self.prompt_images is None:
            return end
        for first, last in self.prompt_images.whole_spans:
            if first < end < last:
                return max(first, start)
        return end

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_decoding(self) -> bool:
        return bool(self.output_ids) and self.num_computed == self.num_tokens - 1


class SampledRow(NamedTuple):
    """The token a running request sampled in one row of a step (Scheduler.process_results). One
    is made per row per step: a NamedTuple costs ~0.15 us each, ~32 us more than a bare tuple per
    256 rows (timeit, best of 5, 2-core Zen 5); a dataclass's __init__ cost ~0.1 ms."""

    request: Request  # its `status` says whether this token finished it: the scheduler decides
    token: int
    row: int  # the row's index in the step's arrays
    num_output: int  # the request's output tokens with this one


@dataclass
class ScheduledBatch:
    requests: list[Request]
    chunks: list[SeqChunk]  # chunks[i] is what requests[i] runs this step
    slots: list[int]  # slots[i] is requests[i].slot
    kind: Literal["prefill", "decode", "mixed"]
    # Requests that got their slot this step: the engine resets that slot's penalty state.
    admitted: list[Request] = field(default_factory=list)
    # A continuation whose every row decodes (no prompt beside them): its rows as columns, which
    # the next continuation and the step's inputs are built from without a SeqChunk per row;
    # `chunks` is then a DecodeChunks view of them.
    decode: DecodeRows | None = None
    # Tokens each row that takes its input from a slot (`SeqChunk.input_slot >= 0`) has sampled
    # in steps not yet processed (1 for a continuation): the row samples output token number
    # len(output_ids) + ahead. Other rows (a prompt admitted beside them) have none ahead.
    ahead: int = 0

    # Whether a row has a grammar, or asks for logprobs: None until asked (`any_grammar`,
    # `any_logprobs`, read several times a step); a decode continuation of a batch with none
    # has none either.
    has_grammar: bool | None = None
    has_logprobs: bool | None = None

    def any_grammar(self) -> bool:
        if self.has_grammar is None:
            self.has_grammar = any(r.grammar is not None for r in self.requests)
        return self.has_grammar

    def any_logprobs(self) -> bool:
        if self.has_logprobs is None:
            self.has_logprobs = any(r.sampling.return_logprob for r in self.requests)
        return self.has_logprobs

    def row_ahead(self) -> list[int]:
        """`ahead` per row: 0 for the rows that do not read their input from a slot."""
        return [self.ahead if c.input_slot >= 0 else 0 for c in self.chunks]


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """The rows of a continuation in which every request decodes one token read from its slot
    (`SeqChunk.input_slot`), as columns: per row, the tokens already in its KV cache, its slot,
    its output length when scheduled, and its page table. Built once from SeqChunks and then
    from the previous step's DecodeRows: `kept` is the rows of `parent` still here (None for
    all). Page lists are snapshots, shared by steps whose row did not change (a new list where
    the row got a page or the prefix cache may have swapped some), which the device page
    table's writes skip by identity (runtime/executor/page_table.py)."""

    num_cached: list[int]
    slots: list[int]
    output_lens: list[int]  # len(output_ids) when scheduled: the row samples token + 1 (ahead)
    page_ids: list[list[int]]
    parent: DecodeRows | None = None
    kept: list[int] | None = None
    # {row: (its slot, a snapshot slot)}: a hybrid model's state copies after the step
    # (scheduler/state_reuse.py's decode snapshots); empty for every other model.
    snapshots: dict = field(default_factory=dict)


class DecodeChunks(Sequence):
    """`ScheduledBatch.chunks` of a batch with DecodeRows: each row's SeqChunk, made on access
    (the engine's per-step paths read the columns instead)."""

    __slots__ = ("rows",)

    def __init__(self, rows: DecodeRows):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows.num_cached)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        rows = self.rows
        return SeqChunk([0], rows.num_cached[index], list(rows.page_ids[index]), True,
                        input_slot=rows.slots[index], snapshot=rows.snapshots.get(index))
