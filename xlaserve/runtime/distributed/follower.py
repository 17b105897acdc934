"""A follower (--nnodes > 1, a rank > 0): no HTTP, no scheduler, no clock, no random state; it
loads the model, builds the ModelRunner the leader describes and replays the leader's device
calls in order (runtime/distributed/leader.py says how the group works). With the leader's
--debug-step-hash-interval it sends back a digest of the outputs of every checked step.
"""
from __future__ import annotations

import logging
import os
import sys

import jax
import numpy as np

from xlaserve.runtime.distributed.leader import STAGED_VECTORS, step_digest
from xlaserve.runtime.executor.step_inputs import staged_from_host
from xlaserve.runtime.distributed.setup import CONNECT_TIMEOUT_S, client
from xlaserve.runtime.distributed.channel import (SECRET_KEY, ChannelClosed, ChannelError, channel_port,
                                           connect)

logger = logging.getLogger(__name__)


def follow(args) -> int:
    """A rank > 0: loads the model, then replays the leader's commands until the leader shuts
    down (returns 0). Losing the leader, or any failure, ends the process with status 1 (os._exit:
    JAX's exit handler would wait for the lost leader at a shutdown barrier)."""
    from xlaserve.weights.loader import load_model, server_load_options, tensor_parallel_mesh
    from xlaserve.runtime.host import malloc_tuning
    from xlaserve.runtime.compile.persistent_cache import enable_persistent_cache

    host, port = channel_port(args.dist_init_addr)
    secret = bytes.fromhex(client().blocking_key_value_get(SECRET_KEY, CONNECT_TIMEOUT_S * 1000))
    connection = connect(host, port, secret, args.node_rank, CONNECT_TIMEOUT_S)
    logger.info("Node rank %d follows rank 0 (step channel %s:%d)", args.node_rank, host, port)
    try:
        malloc_tuning.limit_arenas()
        enable_persistent_cache(args.compilation_cache_dir)
        loaded = load_model(**server_load_options(args), skip_tokenizer_init=True,
                            mesh=tensor_parallel_mesh(args.tp_size, ep_size=args.ep_size))
        if args.speculative_algorithm in ("EAGLE3", "NEXTN"):  # the leader's model has it too
            from xlaserve.weights.draft_head import load_server_draft_head

            loaded.model.draft_head = load_server_draft_head(args, loaded)
        draft_loaded = None
        if args.speculative_algorithm == "STANDALONE":  # its runner replays the leader's too
            draft_loaded = load_model(
                **{**server_load_options(args), "model_path": args.speculative_draft_model_path},
                skip_tokenizer_init=True,
                mesh=tensor_parallel_mesh(args.tp_size, ep_size=args.ep_size))
        logger.info("Load weight end. type=%s, from %s; waiting for the leader's runner",
                    loaded.config.architecture, loaded.name)  # the path: DEBUG only
        logger.debug("Weights of %s read from %s", loaded.name, loaded.source)
        replay(connection, loaded, draft_loaded)
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


def replay(connection, loaded, draft_loaded=None) -> None:
    """The leader's commands, in order, until it says shutdown: first the runner's configuration
    (a ModelRunner is built over `loaded`, the model, and one with the same configuration over
    `draft_loaded`, a STANDALONE draft model, whose commands come as "draft_model_<kind>"), then
    slot assignments and steps. Each step is dispatched before the previous one is waited for,
    as on the leader; waiting at all surfaces a failed collective here and keeps this process at
    most a step behind."""
    from xlaserve.runtime.executor.model_runner import ModelRunner

    kind, meta, _ = connection.receive()
    if kind != "runner":
        raise ChannelError(f"expected the runner's configuration first, got {kind!r}")
    config = dict(num_pages=meta["num_pages"], page_size=meta["page_size"],
                  max_running_requests=meta["max_running_requests"],
                  attention_backend=meta["attention_backend"],
                  matmul_backend=meta["matmul_backend"], context_length=meta["context_length"],
                  verify_tokens=meta["verify_tokens"], kv_cache_dtype=meta["kv_cache_dtype"])
    runner = ModelRunner(loaded, **config,
                         mla_expanded_prefill_tokens=meta["mla_expanded_prefill_tokens"])
    runner.max_seqs = meta["max_seqs"]  # the leader's buckets' (its sample rows)
    runners = {"": runner}
    if draft_loaded is not None:  # as startup._draft_model builds the leader's
        runners["draft_model_"] = ModelRunner(draft_loaded, **config)
        runners["draft_model_"].max_seqs = meta["max_seqs"]
    draft_head = None
    if runner.draft_head_pool is not None:  # EAGLE3 / NEXTN: the chains replay through it
        from xlaserve.runtime.executor.drafts.draft_head import DraftHead

        draft_head = DraftHead(runner, None, meta["verify_tokens"] - 1, meta["draft_topk"],
                               meta["draft_tree_steps"])
    logger.info("Following rank 0's steps")
    pending = None
    while True:
        kind, meta, arrays = connection.receive()
        runner = runners[""]
        if kind.startswith("draft_model_") and "draft_model_" in runners:
            kind, runner = kind[len("draft_model_"):], runners["draft_model_"]
        if kind == "step":
            staged = staged_from_host(runner, [arrays[k] for k in STAGED_VECTORS],
                                      meta["shape"], meta["widths"], meta["needs"],
                                      int(meta.get("tree_width", 0)))
            bitmask = arrays.get("bitmask")
            if bitmask is not None and bitmask.dtype != np.int32:
                raise ChannelError(f"a grammar bitmask of {bitmask.dtype}, not int32")
            out = runner.run(staged, bitmask)
            if meta.get("hash"):  # --debug-step-hash-interval: a sync, this step's outputs
                connection.send("step_hash", {"step": meta["step"],
                                              "digest": step_digest(out.sample)})
            if pending is not None:
                pending.block_until_ready()
            pending = out.sample.tokens
        elif kind == "draft_chain":
            if draft_head is None:
                raise ChannelError("a draft chain, but this process's model has no draft head")
            staged = staged_from_host(runner, [arrays[k] for k in STAGED_VECTORS],
                                      meta["shape"], meta["widths"])
            draft_head._run(staged, arrays["rooms"])
        elif kind == "assign_slots":
            prompts = np.split(arrays["prompt_ids"], np.cumsum(arrays["prompt_lens"])[:-1])
            outputs = np.split(arrays["output_ids"], np.cumsum(arrays["output_lens"])[:-1])
            runner.assign_slots(list(zip(meta["slots"], prompts, outputs, strict=True)))
        elif kind == "write_pages":
            positions, pages = arrays["positions"], arrays["pages"]
            if (positions.dtype, pages.dtype) != (np.int32, np.int32) or \
                    positions.shape != pages.shape or positions.ndim != 1:
                raise ChannelError("page-table writes must be two int32 vectors of one length")
            runner.write_pages(positions, pages)
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
