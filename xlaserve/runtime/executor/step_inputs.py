"""A step's inputs: packed on the host into one int32 and one float32 vector (`step_vectors`,
`concat_leaves`; the jitted step slices them back out, `split_leaves`), RoPE's cos/sin by position
(`RopeTable`), a bucket's all-padding inputs (`idle_step`), a step's inputs once staged
(`StagedStep`, what ModelRunner.stage returns and `run` takes), the device inputs a runner keeps
between steps (`RepeatedInputs`), and who replays a runner's device calls. The step itself, which
takes them: step_program.py.

One host-to-device transfer per dtype for a step's inputs: a step's inputs are ~20 small numpy
arrays (the batch, the sampling parameters, the slots). Sent one by one, `jax.device_put` and the
jit call spent ~3 ms per step on them on a 2-core CPU, a tenth of a single stream's 1-token step.
Here every leaf goes into one int32 or one float32 vector on the host (bool and uint32 leaves as
int32), and the jitted step slices them back out with static offsets: two transfers, and the
layout is part of the program's static arguments, so each bucket still compiles once.

Structured outputs: `token_bitmask i32[sample rows, ceil(V/32)]` holds the tokens each row's
grammar allows (runtime/sampling/grammar.py), a fixed-shape argument so a constrained request
never compiles a program. A step without a constrained row sends a bitmask of all ones that stays
on the device (one per sequence bucket), and the sampler skips the mask.

Multi-host (--nnodes > 1, runtime/distributed/leader.py): the mesh spans every process's devices,
and every process must make the same device calls in the same order. The leader's runner has a
command sink: `assign_slots` and each step (its int32/float32 host vectors, bucket shape, table
widths, needs and grammar masks) and the page-table writes of `write_pages` go to the followers
before the leader makes the call, and a follower's runner replays them (`assign_slots`,
`write_pages`, `run(staged_from_host(...))`). Outputs are replicated; the leader reads its own
copy. In one process the sink is NoFollowers, which does nothing.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.model.rope import rope_cos_sin
from xlaserve.runtime.executor.forward_batch import ForwardBatch
from xlaserve.runtime.executor.page_table import PageWrites
from xlaserve.runtime.executor.state_pool import StateCopies
from xlaserve.runtime.sampling.params import MAX_LOGIT_BIAS, MAX_SUPPRESSED_IDS, RowSamplingParams
from xlaserve.runtime.sampling.prompt_logprobs import NO_TARGET
from xlaserve.runtime.sampling.params import SamplingMetadata, build_sampling_metadata
from xlaserve.runtime.sampling.step_needs import RUN_TIME, StepNeeds

# --- a step's inputs as one int32 and one float32 vector ------------------------------------

_INT, _FLOAT = "int32", "float32"
# dtype -> (buffer, name); a dict lookup, where `dtype.name` costs ~5 us per leaf per step.
_PLACES = {np.dtype(np.float32): (_FLOAT, "float32"), np.dtype(np.int32): (_INT, "int32"),
           np.dtype(np.uint32): (_INT, "uint32"), np.dtype(np.bool_): (_INT, "bool")}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a pytree lives in the two vectors (hashable: a static argument)."""

    treedef: Any
    leaves: tuple[tuple[str, int, tuple[int, ...], str], ...]  # (buffer, offset, shape, dtype)


def concat_leaves(tree) -> tuple[np.ndarray, np.ndarray, Layout]:
    """(int32 vector, float32 vector, layout) holding every numpy leaf of `tree`."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = {_INT: [], _FLOAT: []}
    sizes = {_INT: 0, _FLOAT: 0}
    placed = []
    for leaf in leaves:
        leaf = np.asarray(leaf)
        if leaf.dtype not in _PLACES:
            raise TypeError(f"cannot transfer a {leaf.dtype} leaf")
        buffer, dtype_name = _PLACES[leaf.dtype]
        flat = leaf.reshape(-1)
        if dtype_name == "uint32":
            flat = flat.view(np.int32)
        elif dtype_name == "bool":
            flat = flat.astype(np.int32)
        placed.append((buffer, sizes[buffer], leaf.shape, dtype_name))
        parts[buffer].append(flat)
        sizes[buffer] += flat.size
    ints = np.concatenate(parts[_INT]) if parts[_INT] else np.zeros(0, np.int32)
    floats = np.concatenate(parts[_FLOAT]) if parts[_FLOAT] else np.zeros(0, np.float32)
    return ints, floats, Layout(treedef, tuple(placed))


def split_leaves(ints: jax.Array, floats: jax.Array, layout: Layout):
    """The pytree `concat_leaves` concatenated, inside a jitted function (static slices)."""
    leaves = []
    for buffer, offset, shape, dtype in layout.leaves:
        source = ints if buffer == _INT else floats
        size = int(np.prod(shape, dtype=np.int64))
        leaf = source[offset:offset + size].reshape(shape)
        if dtype == "bool":
            leaf = leaf != 0
        elif dtype == "uint32":
            leaf = jax.lax.bitcast_convert_type(leaf, jnp.uint32)
        leaves.append(leaf)
    return jax.tree.unflatten(layout.treedef, leaves)


# The sampling tables' widths the step is compiled for; the slot of padding rows.
SAMPLING_WIDTHS = (MAX_LOGIT_BIAS, MAX_SUPPRESSED_IDS)
NULL_SLOT = 0


class RopeTable:
    """RoPE's (cos, sin) by position, computed once per position (`rope_cos_sin`'s values) and
    looked up per step: computing them cost ~0.12 ms of host time a 256-row decode step at
    head_dim 64 (twice that at 128), the lookup ~10 us. Grows (doubling) to the largest
    position asked for: 512 bytes a position at head_dim 128, 4 MB at 8K positions."""

    def __init__(self, inv_freq: np.ndarray, attention_factor: float = 1.0,
                 mrope_section: tuple[int, ...] = (), mrope_interleaved: bool = False):
        self.inv_freq, self.attention_factor = inv_freq, attention_factor
        half = len(inv_freq)
        self._cos = self._sin = np.zeros((0, half), np.float32)
        # Multimodal RoPE (RopeConfig.mrope_section): which of a row's three positions each
        # rotation pair takes (transformers' recomposition: the sections in turn, or
        # interleaved). The sections cover the rotated pairs; those past them (partial RoPE:
        # frequency 0) take the temporal one, which turns them no more than any other.
        self._axis = None
        if mrope_section:
            self._axis = np.zeros(half, np.int64)
            if mrope_interleaved:
                pairs = np.arange(half)
                for axis in (1, 2):
                    self._axis[(pairs % 3 == axis) & (pairs < 3 * mrope_section[axis])] = axis
            else:
                self._axis[:sum(mrope_section)] = np.repeat(np.arange(len(mrope_section)) % 3,
                                                            mrope_section)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 (cos, sin) [T, head_dim / 2] of the rows at `positions` (>= 0): i32[T], or
        i32[3, T] (temporal, height, width) for multimodal RoPE."""
        if positions.ndim == 2:
            cos, sin = self.cos_sin(positions.reshape(-1))
            tokens, pairs = positions.shape[1], np.arange(len(self.inv_freq))
            cos, sin = cos.reshape(3, tokens, -1), sin.reshape(3, tokens, -1)
            return cos[self._axis, :, pairs].T, sin[self._axis, :, pairs].T
        needed = int(positions.max(initial=0)) + 1
        if needed > len(self._cos):
            size = max(needed, 2 * len(self._cos), 1024)
            cos, sin = rope_cos_sin(self.inv_freq, np.arange(len(self._cos), size, dtype=np.int32),
                                    self.attention_factor)
            self._cos = np.concatenate([self._cos, cos])
            self._sin = np.concatenate([self._sin, sin])
        return self._cos[positions], self._sin[positions]


def step_vectors(rope: RopeTable, batch: ForwardBatch, sampling: SamplingMetadata, slots,
                 writes: PageWrites, copies: StateCopies):
    """The step's host arrays but the sampling tables (`table_arrays`, sent apart), with the
    page table's writes, a hybrid model's state copies (state_pool.StateCopies; empty arrays
    for other models) and the rows' RoPE cos/sin (`rope`: the config's frequencies and `rope.attention_factor`), as one
    int32 and one float32 vector (above) and their layout (which the values do not
    change). RoPE stays on the host: computed in the step, XLA's CPU fusion recomputes cos/sin
    in each layer's RoPE fusion (an optimization barrier does not stop it: the CPU compiler
    removes barriers before fusion; 64 cos fusions in the 32-layer step)."""
    rest = dataclasses.replace(sampling, logit_bias_ids=None, logit_bias_values=None,
                               suppressed_ids=None)
    positions = batch.positions if batch.rope_positions is None else batch.rope_positions
    return concat_leaves((batch, rest, np.asarray(slots, np.int32), rope.cos_sin(positions),
                          writes, copies))


def table_arrays(sampling: SamplingMetadata) -> tuple:
    """The sampling tables the step takes as vectors of their own (ModelRunner._tables)."""
    return sampling.logit_bias_ids, sampling.logit_bias_values, sampling.suppressed_ids


def idle_vectors(rope: RopeTable, writes: PageWrites, copies: StateCopies, tokens: int,
                 seqs: int, pages: int, rows: int, tree_width: int = 0,
                 widths: tuple[int, int] = SAMPLING_WIDTHS):
    """((ints, floats, table ints, table floats), (layout, table layout)) of an idle step of the
    bucket shape with `rows` sample rows (of the tree program: `tree_width`) and sampling tables
    `widths` wide: the one place an idle step's inputs are made, for a runner's precompile
    (ModelRunner._lowering_args), a compile-only target's (runtime/executor/aot.py) and a
    follower's layouts (`layout_for`). `writes`: the page table's idle writes (`empty_writes`
    where there is no page table); `copies`: no state copies (state_pool.no_copies)."""
    batch, sampling, slots = idle_step(tokens, seqs, pages, rows, tree_width, widths)
    ints, floats, layout = step_vectors(rope, batch, sampling, slots, writes, copies)
    table_ints, table_floats, table_layout = concat_leaves(table_arrays(sampling))
    return (ints, floats, table_ints, table_floats), (layout, table_layout)


def idle_step(tokens: int, seqs: int, pages: int, rows: int | None = None, tree_width: int = 0,
              widths: tuple[int, int] = SAMPLING_WIDTHS):
    """(batch, sampling, slots) of a step of the given bucket shape (and `rows` sample rows,
    default `seqs`; `tree_width`: of the tree program; sampling tables `widths` wide) with every
    row padding: nothing is written to a live page (padding tokens write to no page at all)."""
    rows = seqs if rows is None else rows
    return (empty_batch(tokens, seqs, pages, rows, tree_width), greedy_sampling(rows, widths),
            np.full(seqs, NULL_SLOT, np.int32))


@functools.lru_cache(maxsize=None)
def greedy_sampling(rows: int, widths: tuple[int, int] = SAMPLING_WIDTHS) -> SamplingMetadata:
    """The sampling metadata of `rows` greedy sample rows (idle steps, a drafter's greedy
    drafts) with tables `widths` wide, made once per row count and shared: its arrays are read,
    never changed."""
    return build_sampling_metadata([RowSamplingParams(temperature=0.0, seed=0)], rows, widths)


def empty_batch(tokens: int, seqs: int, pages: int, rows: int | None = None,
                tree_width: int = 0) -> ForwardBatch:
    """A batch of the given bucket shape (and `rows` sample rows, default `seqs`; `tree_width`:
    of the tree program) with no live sequence."""
    rows = seqs if rows is None else rows
    return ForwardBatch(input_ids=np.zeros(tokens, np.int32), positions=np.zeros(tokens, np.int32),
                        kv_lens=np.zeros(seqs, np.int32), cu_q_lens=np.zeros(seqs + 1, np.int32),
                        num_seqs=np.zeros(1, np.int32), logits_indices=np.zeros(rows, np.int32),
                        sample_rows=np.zeros(rows, np.bool_),
                        sample_seqs=np.full(rows, -1, np.int32),
                        target_ids=np.full(tokens, NO_TARGET, np.int32),
                        input_slots=np.full(tokens, -1, np.int32),
                        next_ids=np.full(seqs, -1, np.int32),
                        tree_masks=np.zeros(tokens, np.int32), pages=pages,
                        tree_width=tree_width)


def step_args(state: tuple, vectors: tuple, token_bitmask, input_embeds: tuple = ()) -> tuple:
    """The step's positional arguments in step_program.make_step's order, for each caller: a run
    (ModelRunner.run), a compile here (ModelRunner._lowering_args) and one for another target
    (aot.StepProgram.lowering_args). `state`: the weights, KV caches, output counts, last
    tokens, page table and prompt masks; `vectors`: the step's ints and floats and the sampling
    tables' ints and floats; `input_embeds`: a vision model's image rows, or ()."""
    if len(state) != 6 or len(vectors) != 4 or len(input_embeds) > 1:
        raise ValueError(f"a step takes 6 state arrays, 4 vectors and at most one image input, "
                         f"not {len(state)}, {len(vectors)} and {len(input_embeds)}")
    return (*state, *vectors, token_bitmask, *input_embeds)


# --- staged on the device ---------------------------------------------------------------------

@dataclasses.dataclass
class StagedStep:
    """A step's inputs but its grammar masks (ModelRunner.stage). The step vectors stay numpy
    arrays in one process, which the step's call transfers (~20 us of host time, where a
    device_put of them cost ~0.15 ms; tests/executor/test_model_runner.py); over several
    processes they are global device arrays, put by each process."""

    ints: jax.Array | np.ndarray
    floats: jax.Array | np.ndarray
    tables: tuple[jax.Array, jax.Array]  # the sampling tables' int32 and float32 vectors
    layout: tuple  # (the step vectors' transfer.Layout, the tables')
    shape: tuple[int, int, int]  # (tokens, seqs, pages)
    widths: tuple[int, int]  # logit-bias and suppressed-id table widths
    # (ints, floats, table ints, table floats): what a multi-host leader sends
    host: tuple[np.ndarray, ...] | None = None
    # What the rows need but the grammar mask (known at `run`); RUN_TIME on the CPU.
    needs: StepNeeds | None = RUN_TIME
    # The page table's rows the step writes, for PageTableRows.commit once it is dispatched.
    page_updates: list = dataclasses.field(default_factory=list)
    # (positions, pages) of writes past the step's own room: `run` sends them first.
    overflow_writes: tuple[np.ndarray, np.ndarray] | None = None
    # The same batch staged on a STANDALONE draft model's runner (executor/drafts/draft_model.py),
    # which the engine runs right after this step.
    draft: "StagedStep | None" = None
    tree_width: int = 0  # > 0: a step with speculative tree rows (ForwardBatch.tree_width)
    # A vision model's step: its rows' image embeddings [levels, T, hidden] on the device
    # (ForwardBatch.input_embeds, or zeros); None on other servers.
    input_embeds: jax.Array | None = None

    @property
    def image_args(self) -> tuple:
        """The step's arguments after the bitmask: a vision model's image rows, else none."""
        return () if self.input_embeds is None else (self.input_embeds,)


class NoFollowers:
    """The command sink of a runner in one process (a multi-host leader's, distributed/leader.py,
    is set at start-up): no follower replays its calls, and its outputs are its own."""

    replays = False

    def assign_slots(self, assignments) -> None:
        pass

    def write_pages(self, positions: np.ndarray, pages: np.ndarray) -> None:
        pass

    def step(self, staged: StagedStep, token_bitmask: np.ndarray | None) -> None:
        pass

    def draft_chain(self, staged: StagedStep, rooms: np.ndarray) -> None:
        pass

    def ran(self, out):
        """A step's outputs as this process reads them."""
        return out

    def local(self, out):
        """A call's outputs as this process reads them."""
        return out


class RepeatedInputs:
    """The device inputs a runner's steps repeat, kept on the device: the last step's sampling
    tables, the all-allowed grammar bitmask per sample-row count, and a vision model's zero image
    rows per token bucket. `put(arrays, sharding)`: the runner's device_put."""

    def __init__(self, put, replicated, bitmask_words: int, config, dtype):
        """`config`, `dtype`: the model's (a vision model's steps take image rows)."""
        self._put, self._replicated = put, replicated
        self.bitmask_words = bitmask_words
        self._image_rows = None if config.vision is None else (config.vision.levels,
                                                               config.hidden_size, dtype)
        self._all_allowed: dict[int, jax.Array] = {}
        self._no_embeds: dict[int, jax.Array] = {}
        # The last step's tables: (their numpy arrays, host vectors, device vectors, layout).
        self._last_tables = None

    def tables(self, sampling: SamplingMetadata):
        """(arrays, host vectors, device vectors, layout) of the sampling metadata's tables
        (logit bias ids and values, suppressed ids: 300 + 300 + 64 entries a row, 680 KB of a
        256-row step's 960 KB of inputs). Sent again only when they are other arrays than the
        last step's: the engine reuses a run of decode steps' metadata
        (GenerationSteps._sampling_metadata), and packing and sending them cost ~0.3 ms of the
        engine thread per 256-row decode step (benchmarks/bench_host_step.py). The tables'
        arrays are read as immutable (build_sampling_metadata makes new ones)."""
        arrays = table_arrays(sampling)
        last = self._last_tables
        if last is None or any(a is not b for a, b in zip(last[0], arrays, strict=True)):
            *host, layout = concat_leaves(arrays)
            device = tuple(self._put(tuple(host), self._replicated))
            last = self._last_tables = (arrays, tuple(host), device, layout)
        return last

    def bitmask(self, rows: int, token_bitmask: np.ndarray | None) -> jax.Array:
        """The grammar masks of a step with `rows` sample rows, or all ones (none sent)."""
        if token_bitmask is not None:
            if token_bitmask.shape != (rows, self.bitmask_words):
                raise ValueError(f"token_bitmask of shape {token_bitmask.shape}, expected "
                                 f"{(rows, self.bitmask_words)}")
            return self._put(token_bitmask, self._replicated)
        if rows not in self._all_allowed:
            self._all_allowed[rows] = self._put(
                np.full((rows, self.bitmask_words), -1, np.int32), self._replicated)
        return self._all_allowed[rows]

    def idle_image_args(self, tokens: int) -> tuple:
        """An idle step's arguments after the bitmask (StagedStep.image_args): a vision model's
        zero image rows of the `tokens` bucket, else none."""
        rows = self.image_rows(None, tokens)
        return () if rows is None else (rows,)

    def image_rows(self, input_embeds: np.ndarray | None, tokens: int) -> jax.Array | None:
        """A vision model's step's image rows on the device (the batch's `input_embeds`, or the
        `tokens` bucket's zeros); None for other models."""
        if self._image_rows is None:
            return None
        if input_embeds is not None:
            return self._put(input_embeds, self._replicated)
        if tokens not in self._no_embeds:
            levels, hidden, dtype = self._image_rows
            self._no_embeds[tokens] = self._put(np.zeros((levels, tokens, hidden), dtype),
                                                self._replicated)
        return self._no_embeds[tokens]


def layout_for(runner, shape: tuple[int, int, int], widths: tuple[int, int],
               tree_width: int = 0):
    """The layout of every step `runner` stages of this bucket shape, logit-bias / suppressed-id
    widths and tree width: that of an idle step of the same (the leader checks each bucket's
    once; a follower splits the leader's vectors by it)."""
    key = (shape, widths, tree_width)
    if key not in runner.layouts:
        tokens, seqs, pages = shape
        runner.layouts[key] = idle_vectors(runner.rope, runner.page_table.idle_writes(tokens, seqs),
                                           runner.no_copies, tokens, seqs, pages,
                                           runner.sample_rows(shape), tree_width, widths)[1]
    return runner.layouts[key]


def staged_from_host(runner, vectors, shape, widths, needs: list[bool] | None = None,
                     tree_width: int = 0) -> StagedStep:
    """A follower's StagedStep from the leader's host vectors (StagedStep.host: the step's int32
    and float32 vectors, then the sampling tables') and needs (StepNeeds.as_list, or None for
    RUN_TIME): the layouts are a function of the bucket shape, the table widths and the tree
    width alone (`layout_for`)."""
    shape, widths = tuple(shape), tuple(widths)
    layout = layout_for(runner, shape, widths, tree_width)
    for (ints, floats), part_layout in zip((vectors[:2], vectors[2:]), layout, strict=True):
        sizes = {"int32": 0, "float32": 0}
        for buffer, offset, leaf_shape, _ in part_layout.leaves:
            sizes[buffer] = max(sizes[buffer], offset + int(np.prod(leaf_shape, dtype=np.int64)))
        if (ints.dtype, floats.dtype) != (np.int32, np.float32) or \
                (ints.shape, floats.shape) != ((sizes["int32"],), (sizes["float32"],)):
            raise ValueError(
                f"a step of shape {shape}, widths {widths} needs int32[{sizes['int32']}] and "
                f"float32[{sizes['float32']}], got {ints.dtype}{list(ints.shape)} and "
                f"{floats.dtype}{list(floats.shape)}")
    ints, floats, *tables = runner.put_replicated(tuple(vectors))
    return StagedStep(ints, floats, tuple(tables), layout, shape, widths,
                      needs=RUN_TIME if needs is None else StepNeeds(*map(bool, needs)),
                      tree_width=tree_width)
