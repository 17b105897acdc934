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
  int32/float32 host vectors, bucket shape, table widths and grammar masks) to the
  followers before making it, over the step channel (runtime/distributed/channel.py: TCP on the
  coordinator's port + 1, every message HMAC-authenticated, never unpickled).
- ranks > 0, the followers (runtime/distributed/follower.py), load the same model, build the same ModelRunner (with the
  leader's KV pool size, which the leader sends first: free memory differs between hosts) and
  replay the commands in order. They have no scheduler, no clock and no random state: the seeds
  are in the leader's arrays. Outputs are replicated; only the leader reads them.

Failure: a follower that loses the leader exits with status 1 and says so. A leader that loses a
follower (its connection closes, a send fails, a step fails) is broken for good: `Leader.failure`
is set, so /health and new requests answer 503, and readers of running requests get the error
at their next liveness poll (1 s) even where the engine thread is stuck in a collective that
will never complete (with gloo a lost peer fails the collective at once, and the engine thread
fails its requests itself). A follower that is alive but stuck (stopped, swapping) closes
nothing: the leader's step waits in a collective, and its --watchdog-timeout (runtime/engine/watchdog.py)
breaks the group the same way. The other followers are disconnected, so they exit too. JAX's
coordination service then ends the leader's process once the lost process has missed its
heartbeats (100 s): restart every process.

Divergence: what the followers replay is the leader's log by construction (one ordered,
sequence-numbered, authenticated stream), and the leader checks once per bucket shape that a
follower rebuilds the same vector layout. What construction cannot rule out is a process whose
own copy of replicated state drifts (the sampled tokens, the penalty counts: each process computes
its copy itself, so a bug, a different jax/XLA build or a faulty device shows there first and then
feeds garbage into the collectives, silently). `--debug-step-hash-interval N` checks for it: every
N-th step each follower hashes the outputs it sampled (tokens, logprobs, top logprobs) and sends
the digest back; the leader compares it with the digest of its own copy and breaks the group at
the first mismatch, naming the step and the rank.
"""
from __future__ import annotations

import logging

import jax

from xlaserve.runtime.distributed.channel import SECRET_KEY, Listener, new_secret, split_address
from xlaserve.server_args import Mode, refuse_conflicts

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 600  # followers reach the leader's step channel (the model loads meanwhile)
_listener: Listener | None = None  # the leader's, from `initialize` until `lead`


class PeerLost(ConnectionError):
    """The multi-host group is broken: a follower is gone, a step failed, or the processes
    diverged (launch_server reports it like any other start-up error)."""


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
    if args.debug_step_hash_interval < 0:
        raise ValueError(f"--debug-step-hash-interval {args.debug_step_hash_interval} < 0")
    refuse_conflicts(args, Mode.MULTI_HOST)
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
        client().key_value_set(SECRET_KEY, secret.hex())
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


def client():
    from jax._src.distributed import global_state

    return global_state.client


def listener() -> Listener | None:
    """Rank 0's step channel listener once `initialize` has run (None elsewhere)."""
    return _listener
