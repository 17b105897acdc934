"""python -m xlaserve.launch_server [--model-path ...] [--port 30000]: the OpenAI-compatible server.

Start-up, as in SGLang: the arguments, the weights, the KV cache and the precompiled programs are
logged; uvicorn starts listening; one warm-up generation runs; then /health answers 200 and the
log says the server is ready, then where the seconds went ("Start-up: load_model ..., total").
Until then /health answers 503. Batches left unfinished under --file-storage-path (a crash, a
stop) resume once the warm-up has passed. SIGTERM or SIGINT drains the server, for at most
--graceful-shutdown-timeout seconds, then it exits with status 0 (http/shutdown.py).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import time

from xlaserve.server_args import ServerArgs, configure_logging, platform_defaults

_LAUNCHED = time.perf_counter()  # `python -m` imports this module first: the start-up clock
logger = logging.getLogger("xlaserve")

READY_MESSAGE = "The server is fired up and ready to roll!"


def make_context(args: ServerArgs):
    """Loads the engine (weights, KV cache, precompile) and everything the routes need."""
    from xlaserve.http.parsing.chat_template import load_chat_template
    from xlaserve.http.parsing.harmony import chat_format
    from xlaserve.http.observability import Metrics
    from xlaserve.http.parsing.reasoning import PARSERS
    from xlaserve.http.request_fields import RequestFields
    from xlaserve.http.serving import ServingContext
    from xlaserve.http.observability import request_tracing
    from xlaserve.offline import Engine

    template = load_chat_template(args.chat_template)  # before loading: fail fast on a bad flag
    tracing = request_tracing(args)  # likewise
    if args.reasoning_parser is not None and args.reasoning_parser not in PARSERS:
        raise ValueError(f"unknown --reasoning-parser {args.reasoning_parser!r}")
    fields = {k: v for k, v in dataclasses.asdict(args).items() if k != "model_path"}
    engine = Engine(args.model_path, **fields)
    loaded = engine.core.loaded
    # loaded.name: a local model's directory or file name, a hub id as given, never its path.
    name = args.served_model_name or loaded.name
    tokenizer = engine.tokenizer
    metrics = Metrics(name, engine.core.stats, args.metrics_name_style,
                      args.bucket_time_to_first_token, args.bucket_inter_token_latency,
                      args.bucket_e2e_request_latency) if args.enable_metrics else None
    harmony, stop_ids = chat_format(loaded.config.architecture, tokenizer, template)
    return ServingContext(
        engine=engine, served_model_name=name, model_name=loaded.name,
        chat_template=template, template_stop_ids=stop_ids,
        reasoning_parser=args.reasoning_parser, stream_interval=max(1, args.stream_interval),
        metrics=metrics, tool_call_parser=args.tool_call_parser, harmony=harmony,
        request_fields=RequestFields(strict=args.strict_request_fields), tracing=tracing)


async def warm_up(ctx) -> None:
    """One short generation (an embedding server: one embedding) through the whole path;
    /health turns 200 only after it passed."""
    from xlaserve.runtime.sampling.params import SamplingParams
    from xlaserve.http.serving import Generation

    started = time.perf_counter()
    prompt = ctx.tokenizer.encode("The capital of France is") if ctx.tokenizer is not None else [1, 2, 3]
    if ctx.core.features.pooling is not None:  # an embedding server: one embedding
        await Generation(ctx, [prompt], SamplingParams(), 1, embed=True,
                         operation="warm_up").collect()
    else:
        await Generation(ctx, [prompt], SamplingParams(max_new_tokens=4, temperature=0.0),
                         1, operation="warm_up").collect()
    ctx.ready = True
    logger.info(READY_MESSAGE)
    log_startup(ctx.core, time.perf_counter() - started)


def log_startup(core, warmup_seconds: float | None) -> None:
    """One line: where the seconds from launch to ready went (each replica's phases summed)."""
    phases: dict[str, float] = {}
    for replica in getattr(core, "replicas", [core]):
        for phase, seconds in getattr(replica, "startup_timings", {}).items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    if warmup_seconds is not None:
        phases["warm-up"] = warmup_seconds
    total = time.perf_counter() - _LAUNCHED
    parts = [f"{phase} {seconds:.1f} s" for phase, seconds in phases.items()]
    if "precompile" in phases:  # every replica's programs (data parallel: _Runners sums them)
        parts[list(phases).index("precompile")] += f" ({core.runner.compile_count()} programs)"
    parts.append(f"other {total - sum(phases.values()):.1f} s (imports, HTTP server)")
    logger.info("Start-up: %s, total %.1f s", ", ".join(parts), total)


def open_storage(args: ServerArgs):
    """The files and batches folder, locked for this process (before the model loads: a folder
    another server uses is refused at once): --file-storage-path, or by default this port's
    own under xlaserve_storage/."""
    from xlaserve.http.batches.storage import DEFAULT_ROOT, Storage, default_folder

    if args.file_storage_path is not None:
        return Storage(args.file_storage_path)
    if os.path.exists(os.path.join(DEFAULT_ROOT, "metadata.db")):
        logger.warning("%s/ holds the files and batches of a server before the folder per port; "
                       "this one keeps its own in %s (--file-storage-path %s serves those)",
                       DEFAULT_ROOT, default_folder(args.port), DEFAULT_ROOT)
    return Storage(default_folder(args.port))


def build_app(args: ServerArgs, ctx, storage=None):
    """The app, with a lifespan that warms up after uvicorn listens and stops the engine at exit;
    unfinished batches resume once the warm-up has passed."""
    from xlaserve.http.app import create_app
    from xlaserve.http.batches.runner import BatchRunner, default_concurrency

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if args.skip_server_warmup:
            ctx.ready = True
            logger.info(READY_MESSAGE)
            log_startup(ctx.core, None)
        else:
            task = asyncio.get_running_loop().create_task(warm_up(ctx))
            task.add_done_callback(_log_failed_warm_up)
        yield
        ctx.engine.shutdown()
        if ctx.tracing is not None:
            ctx.tracing.shutdown()  # the spans still batched go out

    runner = BatchRunner(
        ctx, storage if storage is not None else open_storage(args), max_file_size=args.max_file_size,
        max_lines=args.batch_max_lines,
        concurrency=args.batch_concurrency or default_concurrency(
            # The engine's: the platform's default where the flag was not given.
            args.max_running_requests or ctx.core.args.max_running_requests))
    return create_app(ctx, api_key=args.api_key, max_payload_size=args.max_payload_size,
                      log_requests=args.log_requests, lifespan=lifespan, batch_runner=runner,
                      host=args.host, allowed_origins=(args.allowed_origins or "").split(","))


def _log_failed_warm_up(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("warm-up generation failed; /health stays 503: %r", task.exception())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlaserve.launch_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    try:
        args = ServerArgs.from_cli_args(parser.parse_args(argv))
    except ValueError as error:  # a flag value that cannot run (--kv-cache-dtype fp8, ...)
        parser.error(str(error))
    configure_logging(args.log_level)
    logger.info("server_args=%s", args.redacted())  # the paths as typed, the secrets hidden

    platform_defaults.prepare_gpu_memory()  # before JAX starts a GPU client
    try:
        if args.nnodes > 1:  # jax.distributed first; ranks > 0 replay rank 0's steps, no HTTP
            from xlaserve.runtime.distributed import follower, setup

            setup.initialize(args)
            if args.node_rank > 0:
                return follower.follow(args)
        storage = open_storage(args)
        ctx = make_context(args)
    except (ValueError, FileNotFoundError, TimeoutError, ConnectionError) as error:
        logger.error("%s", error)  # ConnectionError: a multi-host group broke while starting
        return 2
    app = build_app(args, ctx, storage)
    from xlaserve.http.shutdown import serve

    return serve(app, ctx, app.state.batch_runner, args)  # SIGTERM / SIGINT: drains, then 0


if __name__ == "__main__":
    sys.exit(main())
