"""Multi-host serving: one model over the devices of several processes (--nnodes N).

    # on host 0 (serves HTTP), then the same command on host 1 with --node-rank 1:
    python -m xlaserve.launch_server --model-path M --tp-size 8 \\
        --nnodes 2 --node-rank 0 --dist-init-addr 10.0.0.1:5000

`initialize` runs `jax.distributed.initialize` first thing: `jax.devices()` is then every
process's devices, and the tensor parallel mesh spans them (on CPU the collectives are gloo's).
JAX's multi-controller runtime needs every process to make the same jitted calls with the same
shapes in the same order, so the server replicates its scheduled steps, not its requests:

- rank 0, the leader, is the whole server (HTTP, tokenizer, scheduler, prefix cache, seeds). Its
  ModelRunner's command sink (`_Sink`) sends each device call (slot assignments; steps: the
  packed int32/float32 host vectors, bucket shape, table widths and grammar masks) to the
  followers before making it, over the step channel (runtime/step_channel.py: TCP on the
  coordinator's port + 1, every message HMAC-authenticated, never unpickled).
- ranks > 0, the followers (`follow`), load the same model, build the same ModelRunner (with the
  leader's KV pool size, which the leader sends first: free memory differs between hosts) and
  replay the commands in order. They have no scheduler, no clock and no random state: the seeds
  are in the leader's arrays. Outputs are replicated; only the leader reads them.

Failure: a follower that loses the leader exits with status 1 and says so. A leader that loses a
follower (its connection closes, a send fails, a step fails) is broken for good: `core.failure`
is set, so /health and new requests answer 503, and readers of running requests get the error
at their next liveness poll (1 s) even where the engine thread is stuck in a collective that
will never complete (with gloo a lost peer fails the collective at once, and the engine thread
fails its requests itself). The other followers are disconnected, so they exit too. JAX's
coordination service then ends the leader's process once the lost process has missed its
heartbeats (100 s): restart every process.

Not done: a step hash check across hosts (a debug aid the issue mentions). Divergence in what
the followers replay is ruled out by construction (one ordered, sequence-numbered log), and the
leader checks once per bucket shape that a follower rebuilds the same packing layout.
"""
from __future__ import annotations

import logging
import os
import sys
import threading

import jax
import numpy as np

from xlaserve.runtime.step_channel import (SECRET_KEY, TO_FOLLOWER, ChannelClosed, ChannelError,
                                           Listener, channel_port, connect, encode, new_secret,
                                           split_address)

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 600  # followers reach the leader's step channel (the model loads meanwhile)
_listener: Listener | None = None  # the leader's, from `initialize` until `lead`


class PeerLost(RuntimeError):
    """The multi-host group is broken: a follower is gone, or a step failed."""


def initialize(args) -> None:
    """`jax.distributed.initialize` for --nnodes > 1 (a no-op with one node; done once), the
    device count check, and on rank 0 the step channel's listener, which followers reach while
    the model loads. Call it before anything touches a JAX backend."""
    global _listener
    if args.nnodes <= 1:
        return
    if not args.dist_init_addr:
        raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT, the address of rank 0 "
                         "that every process can reach")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} is not in [0, --nnodes {args.nnodes})")
    if args.dp_size != 1:
        raise ValueError("--dp-size > 1 runs replicas inside one process; across hosts, run one "
                         "server per replica group and put a router (sglang_router) in front")
    _, port = split_address(args.dist_init_addr)
    if not jax.distributed.is_initialized():
        # Cross-process collectives on CPU (tests, development); TPU and GPU have their own.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        logger.info("Node rank %d of %d: joining jax.distributed at %s (this waits until every "
                    "process has started)", args.node_rank, args.nnodes, args.dist_init_addr)
        jax.distributed.initialize(coordinator_address=args.dist_init_addr,
                                   num_processes=args.nnodes, process_id=args.node_rank)
    _check_devices(args)
    if args.node_rank == 0 and _listener is None:
        secret = new_secret()
        _listener = Listener(port + 1, secret, args.nnodes - 1)
        _client().key_value_set(SECRET_KEY, secret.hex())
        logger.info("Step channel listening on port %d for %d follower(s)", port + 1,
                    args.nnodes - 1)


def _check_devices(args) -> None:
    devices = jax.devices()
    if jax.process_count() != args.nnodes:
        raise ValueError(f"--nnodes {args.nnodes}, but jax.distributed counts "
                         f"{jax.process_count()} processes")
    if args.tp_size * args.dp_size != len(devices):
        per_process = {}
        for device in devices:
            per_process[device.process_index] = per_process.get(device.process_index, 0) + 1
        counts = ", ".join(f"rank {p}: {n}" for p, n in sorted(per_process.items()))
        raise ValueError(
            f"--tp-size {args.tp_size} x --dp-size {args.dp_size} must equal the devices of all "
            f"{args.nnodes} processes together: found {len(devices)} {jax.default_backend()} "
            f"devices ({counts})")


def _client():
    from jax._src.distributed import global_state

    return global_state.client


# --- the leader --------------------------------------------------------------------------------


def lead(core) -> "Leader":
    """Rank 0, once its ModelRunner is built: waits for the followers, sends them the runner's
    configuration and puts the command sink on the runner. `core`: the EngineCore; its `failure`
    is set when the group breaks."""
    if _listener is None:
        raise RuntimeError("--nnodes > 1: call distributed.initialize(args) before the engine")
    connections = _listener.wait(CONNECT_TIMEOUT_S)
    leader = Leader(core, connections, _listener.secret)
    runner, args = core.runner, core.args
    leader.broadcast("runner", {
        "num_pages": int(runner.num_pages), "page_size": int(runner.page_size),
        "max_running_requests": int(args.max_running_requests),
        "attention_backend": args.attention_backend, "matmul_backend": args.matmul_backend})
    runner.sink = _Sink(leader, runner)
    return leader


class Leader:
    def __init__(self, core, connections: dict, secret: bytes):
        self.core = core
        self.nnodes = len(connections) + 1
        self._connections = connections  # rank -> step_channel.Connection
        self._secret = secret
        self._sent = 0
        self._lock = threading.Lock()
        self._closing = False
        self._failed = threading.Event()
        for rank, connection in connections.items():
            threading.Thread(target=self._monitor, args=(rank, connection), daemon=True,
                             name=f"xlaserve-follower-{rank}").start()

    def broadcast(self, kind: str, meta: dict | None = None, **arrays: np.ndarray) -> None:
        """One command to every follower, in order; raises PeerLost once the group is broken."""
        with self._lock:
            if self._failed.is_set():
                raise PeerLost(self.core.failure)
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
        raise PeerLost(self.core.failure)

    def fail(self, reason: str) -> None:
        """Marks the group broken (once) and disconnects every follower, which then exit."""
        with self._lock:
            if self._failed.is_set():
                return
            self.core.failure = (f"multi-host serving stopped: {reason}; restart every process "
                                 f"(--nnodes {self.nnodes})")
            self._failed.set()
        logger.error("%s", self.core.failure)
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

    def _monitor(self, rank: int, connection) -> None:
        """Followers send nothing but a last word when they fail: any end of their stream
        breaks the group."""
        try:
            kind, meta, _ = connection.receive()
            reason = (f"follower rank {rank} failed: {meta.get('message')}" if kind == "error"
                      else f"follower rank {rank} sent an unexpected {kind!r}")
        except (ChannelClosed, ChannelError) as error:
            reason = f"lost follower rank {rank}: {error}"
        if not self._closing:
            self.fail(reason)


class _Sink:
    """ModelRunner's command sink on the leader (model_runner.py calls it before each device
    call)."""

    def __init__(self, leader: Leader, runner):
        self._leader = leader
        self._runner = runner
        self._checked: set = set()

    def assign_slot(self, slot: int, prompt_ids, output_ids) -> None:
        self._leader.broadcast("assign_slot", {"slot": int(slot)},
                               prompt_ids=np.asarray(prompt_ids, np.int32),
                               output_ids=np.asarray(output_ids, np.int32))

    def step(self, packed, token_bitmask: np.ndarray | None) -> None:
        shape = tuple(int(n) for n in packed.shape)
        widths = tuple(int(n) for n in packed.widths)
        if (shape, widths) not in self._checked:  # once per bucket: followers rebuild the layout
            if self._runner.layout_for(shape, widths) != packed.layout:
                raise RuntimeError(f"the packing layout of a step of shape {shape}, widths {widths} "
                                   "is not a function of its shape: followers cannot unpack it")
            self._checked.add((shape, widths))
        arrays = {"ints": packed.host[0], "floats": packed.host[1]}
        if token_bitmask is not None:
            arrays["bitmask"] = token_bitmask
        self._leader.broadcast("step", {"shape": shape, "widths": widths}, **arrays)


# --- a follower ----------------------------------------------------------------------------------


def follow(args) -> int:
    """A rank > 0: loads the model, then replays the leader's commands until the leader shuts
    down (returns 0). Losing the leader, or any failure, ends the process with status 1 (os._exit:
    JAX's exit handler would wait for the lost leader at a shutdown barrier)."""
    from xlaserve.model.loader import load_model, tensor_parallel_mesh
    from xlaserve.runtime import malloc_tuning
    from xlaserve.runtime.compilation import enable_persistent_cache
    from xlaserve.runtime.model_runner import ModelRunner

    host, port = channel_port(args.dist_init_addr)
    secret = bytes.fromhex(_client().blocking_key_value_get(SECRET_KEY, CONNECT_TIMEOUT_S * 1000))
    connection = connect(host, port, secret, args.node_rank, CONNECT_TIMEOUT_S)
    logger.info("Node rank %d follows rank 0 (step channel %s:%d)", args.node_rank, host, port)
    try:
        malloc_tuning.limit_arenas()
        enable_persistent_cache(args.compilation_cache_dir)
        loaded = load_model(args.model_path, dtype=args.dtype, skip_tokenizer_init=True,
                            mesh=tensor_parallel_mesh(args.tp_size), load_format=args.load_format,
                            seed=args.random_seed or 0)
        logger.info("Load weight end. type=%s, from %s; waiting for the leader's runner",
                    loaded.config.architecture, loaded.source)
        kind, meta, _ = connection.receive()
        if kind != "runner":
            raise ChannelError(f"expected the runner's configuration first, got {kind!r}")
        runner = ModelRunner(loaded, num_pages=meta["num_pages"], page_size=meta["page_size"],
                             max_running_requests=meta["max_running_requests"],
                             attention_backend=meta["attention_backend"],
                             matmul_backend=meta["matmul_backend"])
        logger.info("Following rank 0's steps")
        _replay(connection, runner)
    except ChannelClosed as error:
        _exit(f"node rank {args.node_rank} lost the leader (rank 0): {error}; exiting")
    except Exception as error:  # noqa: BLE001: anything here ends this follower, loudly
        logger.exception("node rank %d failed", args.node_rank)
        try:
            connection.send("error", {"message": f"{type(error).__name__}: {error}"[:2000]})
        except (ChannelClosed, OSError):
            pass
        _exit(f"node rank {args.node_rank} failed ({type(error).__name__}: {error}); exiting")
    logger.info("The leader shut down; node rank %d exits", args.node_rank)
    connection.close()
    jax.distributed.shutdown()  # with the leader's (a barrier)
    return 0


def _replay(connection, runner) -> None:
    """The leader's commands, in order, until it says shutdown. Each step is dispatched before the
    previous one is waited for, as on the leader; waiting at all surfaces a failed collective
    here and keeps this process at most a step behind."""
    pending = None
    while True:
        kind, meta, arrays = connection.receive()
        if kind == "step":
            packed = runner.packed_from_host(arrays["ints"], arrays["floats"], meta["shape"],
                                             meta["widths"])
            bitmask = arrays.get("bitmask")
            if bitmask is not None and bitmask.dtype != np.int32:
                raise ChannelError(f"a grammar bitmask of {bitmask.dtype}, not int32")
            out = runner.run(packed, bitmask)
            if pending is not None:
                pending.block_until_ready()
            pending = out.sample.tokens
        elif kind == "assign_slot":
            runner.assign_slot(int(meta["slot"]), arrays["prompt_ids"], arrays["output_ids"])
        elif kind == "shutdown":
            if pending is not None:
                pending.block_until_ready()
            return
        else:
            raise ChannelError(f"unknown command {kind!r}")


def _exit(message: str) -> None:
    logger.error("%s", message)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
