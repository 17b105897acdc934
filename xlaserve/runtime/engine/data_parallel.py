"""Data parallel replicas (`--dp-size N`): N engines in one process, each on its own slice of
`--tp-size` devices with its own scheduler, KV pool and loop thread, behind one facade with the
EngineCore surface the HTTP layer, the offline `Engine` and `AsyncRequestGroup` use.

    core = make_engine_core(args)   # an EngineCore, or with --dp-size > 1 a DataParallelEngineCore

Replica r holds devices [r * tp, (r + 1) * tp). Each request goes to one replica, picked by
`--load-balance-method`, as SGLang's data parallel controller does:
- `round_robin`: the replicas in turn, one request (one choice of an n > 1 request) at a time;
- `shortest_queue`: the replica with the fewest unfinished requests routed to it (running,
  waiting, or still in its inbox: the count the facade keeps, so a burst submitted faster than
  the loops take requests in is spread, where the schedulers' own figures would lag), ties to
  the lowest rank.

The facade draws the seeds of requests that have none from one generator (--random-seed), so
the replicas, built from the same arguments, do not hand two requests the same seed; replicas
share the tokenizer and the grammar backend (its compiled-grammar cache and token table).
`max_total_tokens`, `max_running_requests` and the memory fraction are per replica, as in SGLang.
Across hosts, data parallelism is separate servers behind a router (SGLang's `sglang_router`).
"""
from __future__ import annotations

import dataclasses
import logging
import random
import threading
import uuid
from typing import Callable

from xlaserve.weights.loader import check_replica_devices
from xlaserve.runtime.engine.core import EngineCore
from xlaserve.runtime.engine.messages import OutputDelta
from xlaserve.runtime.sampling.params import SamplingParams
from xlaserve.server_args import Mode, ServerArgs, refuse_conflicts

logger = logging.getLogger(__name__)

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")


def make_engine_core(args: ServerArgs):
    """The engine for `args`: one EngineCore, or a DataParallelEngineCore with --dp-size > 1."""
    if args.dp_size < 1:
        raise ValueError(f"--dp-size must be at least 1 (got {args.dp_size})")
    if args.dp_size > 1:
        return DataParallelEngineCore(args)
    return EngineCore(args)


class _Runners:
    """The replicas' model runners seen as one: `compile_count()` sums them; anything else
    (`page_size`, `kernels`, `config`, ...) is replica 0's, the same on every replica."""

    def __init__(self, runners):
        self.replicas = runners

    def compile_count(self) -> int:
        return sum(r.compile_count() for r in self.replicas)

    def __getattr__(self, name):
        return getattr(self.replicas[0], name)


class DataParallelEngineCore:
    def __init__(self, server_args: ServerArgs, replicas: list | None = None):
        """Builds `--dp-size` EngineCores, one after the other (`replicas`: ready ones, for
        tests of the dispatching)."""
        args = server_args
        if args.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"unknown --load-balance-method {args.load_balance_method!r}; choose "
                             f"{' or '.join(LOAD_BALANCE_METHODS)}")
        if args.nnodes > 1:
            refuse_conflicts(args, Mode.MULTI_HOST)
        if replicas is None:
            check_replica_devices(args.tp_size, args.dp_size)
            replicas = []
            try:
                for rank in range(args.dp_size):
                    replicas.append(EngineCore(args, dp_rank=rank,
                                               share_with=replicas[0] if rank else None))
            except BaseException:
                for replica in replicas:
                    replica.shutdown()
                raise
        self.replicas: list[EngineCore] = replicas
        first = self.replicas[0]
        self.args = first.args  # with the page size resolved
        self.loaded = first.loaded  # its mesh is replica 0's
        self.tokenizer = first.tokenizer
        self.grammar_backend = first.grammar_backend
        self.context_length = first.context_length
        self.eos_token_ids = first.eos_token_ids
        # The same on every replica; a vision model's images are prepared by replica 0's tower
        # (host rows any replica's step takes). No adapters: --enable-lora runs one replica.
        self.features = first.features
        self.runner = _Runners([r.runner for r in self.replicas])
        self.load_balance_method = args.load_balance_method
        self._seeds = random.Random(args.random_seed)
        self._lock = threading.Lock()
        self._next = 0  # round robin
        self._where: dict[str, int] = {}  # rid -> replica, until its final chunk
        self._unfinished = [0] * len(self.replicas)  # requests routed to a replica, not finished
        self.dispatched = [0] * len(self.replicas)  # requests ever routed to each replica
        logger.info("Data parallel: %d replicas of %d device(s) each, %s", len(self.replicas),
                    args.tp_size, self.load_balance_method)

    # --- called from any thread -----------------------------------------------------------

    def compile_grammar(self, params: SamplingParams) -> None:
        self.replicas[0].compile_grammar(params)  # the backend (and its cache) is shared

    def check_request(self, prompt_len: int, params: SamplingParams, top_logprobs_num: int = 0,
                      **options) -> None:
        """EngineCore.check_request against the replica that holds the least per request (the
        pools' sizes may differ), so what passes here fits whichever replica it goes to."""
        smallest = min(self.replicas, key=lambda r: r.max_request_tokens)
        smallest.check_request(prompt_len, params, top_logprobs_num, **options)

    def check_embedding_input(self, prompt_len: int) -> None:
        """EngineCore.check_embedding_input against the replica that holds the least."""
        min(self.replicas, key=lambda r: r.max_request_tokens).check_embedding_input(prompt_len)

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               emit: Callable[[OutputDelta], None], rid: str | None = None, **options) -> str:
        """EngineCore.submit on the replica the load-balance method picks."""
        rid = rid or uuid.uuid4().hex
        with self._lock:
            if params.seed is None:  # one stream of seeds for all replicas
                params = dataclasses.replace(params, seed=self._seeds.getrandbits(32))
            owner = rid not in self._where
            # A duplicate id goes where its namesake is, which refuses it as one engine would.
            index = self._pick() if owner else self._where[rid]
            if owner:
                self._where[rid] = index
                self._unfinished[index] += 1
                self.dispatched[index] += 1
        try:
            return self.replicas[index].submit(prompt_ids, params,
                                               self._tracking(rid, index, emit) if owner else emit,
                                               rid=rid, **options)
        except BaseException:
            if owner:
                self._forget(rid, index)
            raise

    def _pick(self) -> int:
        if self.load_balance_method == "shortest_queue":
            return min(range(len(self.replicas)), key=lambda i: (self._unfinished[i], i))
        index = self._next % len(self.replicas)
        self._next += 1
        return index

    def _tracking(self, rid: str, index: int,
                  emit: Callable[[OutputDelta], None]) -> Callable[[OutputDelta], None]:
        """`emit` that forgets the request's replica with its final chunk (or when `emit`
        raises: the engine then drops the request)."""

        def tracked(chunk: OutputDelta) -> None:
            if chunk.finished:
                self._forget(rid, index)
            try:
                emit(chunk)
            except BaseException:
                self._forget(rid, index)
                raise

        return tracked

    def _forget(self, rid: str, index: int) -> None:
        with self._lock:
            if self._where.get(rid) == index:
                del self._where[rid]
                self._unfinished[index] -= 1

    def replica_of(self, rid: str) -> int | None:
        """The rank of the replica running `rid` (None once it finished)."""
        return self._where.get(rid)

    def abort(self, rid: str, message: str | None = None) -> None:
        index = self._where.get(rid)
        if index is not None:
            self.replicas[index].abort(rid, message)

    def abort_all(self, message: str) -> None:
        for replica in self.replicas:
            replica.abort_all(message)

    def flush_cache(self) -> int:
        """Empties every replica's prefix cache; returns the pages freed in all."""
        return sum(r.flush_cache() for r in self.replicas)

    @property
    def max_request_tokens(self) -> int:
        return min(r.max_request_tokens for r in self.replicas)

    @property
    def limits(self):
        """What one request may ask (the same for every replica, built from one ServerArgs)."""
        return self.replicas[0].limits

    @property
    def max_total_num_tokens(self) -> int:
        """One replica's KV pool (a request runs on one), as SGLang reports it with --dp-size."""
        return min(r.max_total_num_tokens for r in self.replicas)

    def stats(self) -> dict:
        """The schedulers' figures summed (token usage: the mean of the replicas' equal-sized
        pools), and each replica's under `replicas`, with its `dp_rank`."""
        per_replica = [{"dp_rank": i, **r.stats(), "max_total_num_tokens": r.max_total_num_tokens,
                        "num_dispatched_reqs": self.dispatched[i]}
                       for i, r in enumerate(self.replicas)]
        return {"num_running_reqs": sum(s["num_running_reqs"] for s in per_replica),
                "num_queue_reqs": sum(s["num_queue_reqs"] for s in per_replica),
                "token_usage": sum(s["token_usage"] for s in per_replica) / len(per_replica),
                "replicas": per_replica}

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    def is_alive(self) -> bool:
        """All replicas run: a dead one fails /health (its requests could never finish)."""
        return all(r.is_alive() for r in self.replicas)

    def stopped_reason(self) -> str:
        """Why the first replica that takes no work stopped, with its rank."""
        return next((f"[DP{i}] {r.stopped_reason()}" for i, r in enumerate(self.replicas)
                     if not r.is_alive()), "the engine loop is not running")
