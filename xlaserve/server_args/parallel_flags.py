"""The flags that spread the model over devices and hosts: tensor, expert and data parallel
sizes, the hosts of a multi-host server (--nnodes), and the checks on a running group (the
watchdog, the step hashes). What they do not combine with: conflicts.py."""
from __future__ import annotations

import dataclasses
from typing import Optional

from xlaserve.server_args.flag import flag


@dataclasses.dataclass
class ParallelFlags:
    """Devices, replicas and hosts."""

    tp_size: int = flag(1, "tensor parallel size: devices that split each layer's heads (across "
                           "every process's devices with --nnodes)",
                        aliases=("--tensor-parallel-size",))
    ep_size: int = flag(
        1, "expert parallel size: a mixture-of-experts layer's experts are split into this many "
           "groups over the --tp-size devices, which it must divide (attention stays split over "
           "all of them); within a group, each expert's width is split over tp/ep devices",
        aliases=("--expert-parallel-size",))
    dp_size: int = flag(
        1, "data parallel size: replicas of the model on disjoint slices of --tp-size devices, "
           "each with its own scheduler and KV cache, requests spread by --load-balance-method",
        aliases=("--data-parallel-size",))
    load_balance_method: str = flag(
        "round_robin", "how --dp-size replicas share requests: round_robin, or shortest_queue "
                       "(the replica with the fewest running + waiting requests)",
        choices=["round_robin", "shortest_queue"])
    nnodes: int = flag(1, "processes (hosts) the model spans; each runs this same command with "
                          "its --node-rank; rank 0 serves HTTP, the others follow its steps")
    node_rank: int = flag(0, "this process's rank among --nnodes (0: the leader)")
    dist_init_addr: Optional[str] = flag(
        None, "HOST:PORT of rank 0 for jax.distributed's coordinator (with --nnodes > 1); the "
              "leader's step channel listens on PORT + 1")
    watchdog_timeout: float = flag(
        300.0, "seconds the engine loop may spend in one step before the server declares it hung "
               "and answers 503 (a hung device, or a multi-host peer that stopped responding); "
               "0 = never")
    debug_step_hash_interval: int = flag(
        0, "debug (--nnodes > 1, set on rank 0): every N-th step each follower hashes the tokens "
           "and logprobs it sampled and the leader compares them with its own; a mismatch stops "
           "the group (503s naming the step and rank). Costs followers a device sync per checked "
           "step; 0 = off")
