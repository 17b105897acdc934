"""Rank 0's side of multi-host serving (setup.py has the whole design): the command log sent to the
followers before each device call, their liveness, and the step hash check."""
from __future__ import annotations

import hashlib
import logging
import threading

import jax
import numpy as np

from xlaserve.runtime.distributed import setup
from xlaserve.runtime.distributed.channel import TO_FOLLOWER, ChannelClosed, ChannelError, encode
from xlaserve.runtime.distributed.setup import CONNECT_TIMEOUT_S, PeerLost
from xlaserve.runtime.executor.step_inputs import layout_for

logger = logging.getLogger(__name__)


def lead(args, runner) -> "Leader":
    """Rank 0, once its ModelRunner is built (runtime/engine/startup.py): waits for the followers, sends
    them the runner's configuration and puts the command sink on the runner. The Leader's
    `failure` says why the group broke, once it has (the EngineCore reports it)."""
    listener = setup.listener()
    if listener is None:
        raise RuntimeError("--nnodes > 1: call distributed.setup.initialize(args) before the engine")
    connections = listener.wait(CONNECT_TIMEOUT_S)
    leader = Leader(connections, listener.secret, args.debug_step_hash_interval)
    leader.broadcast("runner", {
        "num_pages": int(runner.num_pages), "page_size": int(runner.page_size),
        "max_running_requests": int(args.max_running_requests),
        "context_length": int(runner.context_length),
        "attention_backend": args.attention_backend, "matmul_backend": args.matmul_backend,
        "mla_expanded_prefill_tokens": args.mla_expanded_prefill_tokens,
        "verify_tokens": int(runner.verify_tokens), "max_seqs": int(runner.max_seqs),
        "kv_cache_dtype": args.kv_cache_dtype,
        # A draft head's tree (--speculative-eagle-topk > 1): its chain program's shape.
        "draft_topk": int(args.speculative_eagle_topk or 1),
        "draft_tree_steps": int(args.speculative_num_steps or 0)})
    runner.sink = _Sink(leader, runner)
    if leader.hash_interval:
        logger.info("Step hash check on: every %d-th step's sampled outputs are compared with "
                    "the followers'", leader.hash_interval)
    return leader


def step_digest(sample) -> str:
    """SHA-256 of this process's copy of a step's sampled outputs (a SampleOutput): equal on every
    process while they compute the same thing. Reads them to the host (a sync)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(sample):
        local = np.asarray(leaf.addressable_data(0))
        digest.update(f"{local.dtype}{local.shape}".encode())
        digest.update(local.tobytes())
    return digest.hexdigest()


class OneProcess:
    """The Leader's do-nothing form, a server in one process (start-up builds a Leader with
    --nnodes > 1): no follower, no command sent; it keeps why the engine stopped."""

    sent = 0

    def __init__(self):
        self.failure: str | None = None

    def fail(self, reason: str) -> None:
        self.failure = reason

    def step_failed(self, error: Exception) -> None:
        """Never called: no command is ever sent (EngineCore._step_failed)."""

    def close(self) -> None:
        pass


class Leader:
    def __init__(self, connections: dict, secret: bytes, hash_interval: int = 0):
        self.failure: str | None = None  # why the group broke; then no more commands go out
        self.hash_interval = hash_interval
        self.steps_checked = 0  # steps every follower's digest agreed on
        self._hashed: dict[int, list] = {}  # step -> [own sample, own digest or None, reports]
        self._hash_lock = threading.Lock()
        self.nnodes = len(connections) + 1
        self._connections = connections  # rank -> channel.Connection
        self._secret = secret
        self._sent = 0
        self._lock = threading.Lock()
        self._closing = False
        self._failed = threading.Event()
        for rank, connection in connections.items():
            threading.Thread(target=self._monitor, args=(rank, connection), daemon=True,
                             name=f"xlaserve-follower-{rank}").start()

    @property
    def sent(self) -> int:
        """Commands sent so far (the engine loop compares it around a step that failed)."""
        return self._sent

    def follow_runner(self, runner, prefix: str) -> None:
        """The followers replay `runner`'s calls too (a STANDALONE draft model's runner, which
        they build beside the model's): its commands go out with `prefix` on their kind."""
        runner.sink = _Sink(self, runner, prefix)

    def broadcast(self, kind: str, meta: dict | None = None, **arrays: np.ndarray) -> None:
        """One command to every follower, in order; raises PeerLost once the group is broken."""
        with self._lock:
            if self._failed.is_set():
                raise PeerLost(self.failure)
            message = encode(self._secret, TO_FOLLOWER, self._sent, kind, meta, arrays)
            self._sent += 1
            for rank, connection in self._connections.items():
                try:
                    connection.send_bytes(message)
                except ChannelClosed as error:
                    lost = f"lost follower rank {rank}: {error}"
                    break
            else:
                return
        self.fail(lost)
        raise PeerLost(self.failure)

    def fail(self, reason: str) -> None:
        """Marks the group broken (once) and disconnects every follower, which then exit."""
        with self._lock:
            if self._failed.is_set():
                return
            self.failure = (f"multi-host serving stopped: {reason}; restart every process "
                                 f"(--nnodes {self.nnodes})")
            self._failed.set()
        logger.error("%s", self.failure)
        for connection in self._connections.values():
            connection.close()

    def step_failed(self, error: Exception) -> None:
        """The engine loop failed while the group ran: the followers may have made a call the
        leader did not, so the group is broken. A lost follower is the likely cause; its monitor
        says so within a moment, or the error itself is the reason."""
        if not self._failed.wait(2.0):
            self.fail(f"a step failed on the leader ({type(error).__name__}: {error})")

    def close(self) -> None:
        """A clean stop: the followers end their loops and exit with status 0. Then
        jax.distributed shuts down here and on the followers together (a barrier): the
        coordinator, in this process, must not go before them, or they abort."""
        self._closing = True
        stopped = False
        if not self._failed.is_set():
            try:
                self.broadcast("shutdown")
                stopped = True
            except PeerLost:
                pass
        for connection in self._connections.values():
            connection.close()
        if stopped:
            logger.info("Waiting for the followers to shut down")
            jax.distributed.shutdown()

    def expect(self, step: int) -> None:
        """A step whose digest the followers will send: before the step goes to them."""
        with self._hash_lock:
            self._hashed[step] = _Check()

    def record(self, step: int, sample) -> None:
        """The leader's own outputs of that step, once its call is made."""
        with self._hash_lock:
            check = self._hashed.get(step)
        if check is not None:
            check.sample = sample
            check.made.set()

    def _monitor(self, rank: int, connection) -> None:
        """Followers send step digests (with --debug-step-hash-interval) and a last word when
        they fail: anything else, or any end of their stream, breaks the group."""
        try:
            while True:
                kind, meta, _ = connection.receive()
                if kind == "step_hash":
                    if (reason := self._compare(rank, meta)) is None:
                        continue
                elif kind == "error":
                    reason = f"follower rank {rank} failed: {meta.get('message')}"
                else:
                    reason = f"follower rank {rank} sent an unexpected {kind!r}"
                break
        except (ChannelClosed, ChannelError) as error:
            reason = f"lost follower rank {rank}: {error}"
        if not self._closing:
            self.fail(reason)

    def _compare(self, rank: int, meta: dict) -> str | None:
        """A follower's digest of a step against the leader's own: None when they agree, else
        why the group breaks."""
        step, theirs = meta.get("step"), meta.get("digest")
        with self._hash_lock:
            check = self._hashed.get(step)
        if check is None:
            return f"follower rank {rank} sent a digest of step {step!r}, which was not checked"
        while not check.made.wait(1.0):  # a follower may run the step before the leader has
            if self._failed.is_set():
                return self.failure
        with self._hash_lock:
            if check.digest is None:
                check.digest, check.sample = step_digest(check.sample), None
            check.reports += 1
            checked = 0
            if check.reports == len(self._connections):
                del self._hashed[step]
                self.steps_checked += 1
                checked = self.steps_checked
        if theirs != check.digest:
            return (f"step {step} diverged: follower rank {rank} sampled other outputs than the "
                    f"leader (digest {str(theirs)[:16]} vs {check.digest[:16]}); the processes no "
                    "longer compute the same model (a different jax/XLA build, model files or "
                    "flags on one host, or a faulty device)")
        if checked == 1 or (checked and checked % 1000 == 0):
            logger.info("Step hash check: %d step(s) agree on every follower", checked)
        return None


class _Prefixed:
    """A Leader whose commands' kinds carry a prefix (a draft model runner's sink)."""

    def __init__(self, leader: Leader, prefix: str):
        self._leader, self._prefix = leader, prefix
        self.hash_interval = leader.hash_interval

    def broadcast(self, kind: str, meta: dict | None = None, **arrays: np.ndarray) -> None:
        self._leader.broadcast(self._prefix + kind, meta, **arrays)


class _Check:
    """A step under the hash check: the leader's outputs, their digest, the followers' reports."""

    def __init__(self):
        self.made = threading.Event()
        self.sample = None
        self.digest: str | None = None
        self.reports = 0


class _Sink:
    """ModelRunner's command sink on the leader (model_runner.py calls it before each device
    call). `prefix`: before each command's kind, for another runner of the followers (a
    STANDALONE draft model's, "draft_model_": `Leader.follow_runner`), whose steps the step
    hash check leaves out."""

    replays = True

    def __init__(self, leader: Leader, runner, prefix: str = ""):
        self._leader = _Prefixed(leader, prefix) if prefix else leader
        self._hashed = not prefix
        self._runner = runner
        self._checked: set = set()
        self._steps = 0
        self._recording: int | None = None  # the step whose outputs `ran` keeps for the check

    def assign_slots(self, assignments) -> None:
        """ModelRunner.assign_slots' (slot, prompt_ids, output_ids): the id lists concatenated,
        with their lengths."""
        slots, prompts, outputs = zip(*assignments)
        self._leader.broadcast(
            "assign_slots", {"slots": [int(s) for s in slots]},
            prompt_lens=np.array([len(p) for p in prompts], np.int32),
            prompt_ids=np.concatenate([np.asarray(p, np.int32) for p in prompts]),
            output_lens=np.array([len(o) for o in outputs], np.int32),
            output_ids=np.concatenate([np.asarray(o, np.int32).reshape(-1) for o in outputs]))

    def write_pages(self, positions: np.ndarray, pages: np.ndarray) -> None:
        """ModelRunner.write_pages': page-table writes past a step's own room."""
        self._leader.broadcast("write_pages", None, positions=positions, pages=pages)

    def step(self, staged, token_bitmask: np.ndarray | None) -> None:
        shape, widths, arrays = _staged_message(staged)
        tree = int(staged.tree_width)
        if (shape, widths, tree) not in self._checked:  # once per bucket: followers rebuild it
            if layout_for(self._runner, shape, widths, tree) != staged.layout:
                raise RuntimeError(f"the vector layout of a step of shape {shape}, widths {widths} "
                                   "is not a function of its shape: followers cannot split it")
            self._checked.add((shape, widths, tree))
        if token_bitmask is not None:
            arrays["bitmask"] = token_bitmask
        step, interval = self._steps, self._leader.hash_interval
        self._steps += 1
        # The program variant's needs (runtime/sampling/step_needs.py): None (RUN_TIME) on the CPU.
        meta = {"shape": shape, "widths": widths, "tree_width": tree,
                "needs": None if staged.needs is None else staged.needs.as_list()}
        if interval and step % interval == 0 and self._hashed:
            meta.update(step=step, hash=True)
            self._recording = step
            self._leader.expect(step)
        self._leader.broadcast("step", meta, **arrays)

    def draft_chain(self, staged, rooms: np.ndarray) -> None:
        """A draft head's chain (executor/drafts/draft_head.py): its staged vectors and rooms."""
        shape, widths, arrays = _staged_message(staged)
        self._leader.broadcast("draft_chain", {"shape": shape, "widths": widths},
                               rooms=np.asarray(rooms, np.int32), **arrays)

    def ran(self, out):
        """After the leader made the step's call: its outputs, this process's copy (recorded
        for the step hash check)."""
        out = self.local(out)
        if self._recording is not None:
            self._leader.record(self._recording, out.sample)
            self._recording = None
        return out

    @staticmethod
    def local(out):
        """A call's outputs, replicated over every process: this process's copy."""
        return jax.tree.map(lambda x: x.addressable_data(0), out)


STAGED_VECTORS = ("ints", "floats", "table_ints", "table_floats")  # StagedStep.host, in order


def _staged_message(staged) -> tuple[tuple, tuple, dict]:
    """(bucket shape, table widths, host vectors by name) of a staged step or chain, as the
    followers rebuild it (follower.py, `ModelRunner.staged_from_host`)."""
    return (tuple(int(n) for n in staged.shape), tuple(int(n) for n in staged.widths),
            dict(zip(STAGED_VECTORS, staged.host, strict=True)))
