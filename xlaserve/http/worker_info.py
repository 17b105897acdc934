"""What a router learns of this server, in SGLang's shapes, so that SGLang's model gateway
(`sglang-router`, `smg`) serves it as an SGLang worker: `/server_info` and `/model_info` (and
their older names `/get_server_info`, `/get_model_info`), and the load, `/get_load` and
`/v1/loads`.

The gateway (read from its source, 2026) registers a worker with `GET /health`, then
`/server_info` and `/model_info`; the newer one decides the runtime from `/v1/models`' `owned_by`
("xlaserve": not one it knows), then from which of `/version` (vLLM's: not served here) and
`/server_info` (SGLang's) answers. It reads load from `/v1/loads` (its `token_usage` per rank),
the older one from `/get_load` (the sum of `num_tokens`). The figures are the schedulers'
(EngineCore.stats), one entry per data-parallel replica. SGLang's measured rates
(`gen_throughput`, `cache_hit_rate`, `utilization`) and its memory, speculative, LoRA and
disaggregation sections are left out: the gateway reads absent ones as 0, and nothing here
measures them per rank.
"""
from __future__ import annotations

import dataclasses
import datetime

from fastapi import APIRouter, Request

import xlaserve
from xlaserve.http.errors import bad_request
from xlaserve.http.serving import ServingContext
from xlaserve.server_args import public_name

router = APIRouter()
# /v1/loads' `include` sections (SGLang's names); only `core` has figures here.
_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request):
    ctx = _ctx(request)
    tokenizer_path = public_name(ctx.engine.server_args.tokenizer_path)  # names, not paths
    config = ctx.core.loaded.config
    return {"model_path": ctx.model_name, "tokenizer_path": tokenizer_path or ctx.model_name,
            "is_generation": ctx.core.features.pooling is None, "preferred_sampling_params": None,
            "served_model_name": ctx.served_model_name, "context_length": ctx.context_length,
            "vocab_size": ctx.vocab_size, "architectures": [config.architecture],
            "has_image_understanding": ctx.images is not None,
            "has_audio_understanding": False,
            "weight_version": getattr(getattr(ctx.core, "weights", None), "version",
                                      ctx.engine.server_args.weight_version)}


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request):
    ctx = _ctx(request)
    core = ctx.core
    # The API key as "***", each path flag by its last component only.
    args = dataclasses.asdict(ctx.engine.server_args.served())
    return {**args, "version": xlaserve.__version__, "served_model_name": ctx.served_model_name,
            "is_embedding": core.features.pooling is not None,
            "context_length": ctx.context_length,
            "max_total_num_tokens": core.max_total_num_tokens,
            "max_request_tokens": core.max_request_tokens, **core.stats()}


def rank_loads(ctx: ServingContext) -> list[dict]:
    """Each data-parallel replica's load (one entry without --dp-size), SGLang's fields."""
    stats = ctx.core.stats()
    per_rank = stats.get("replicas") or [{"dp_rank": 0, **stats,
                                          "max_total_num_tokens": ctx.core.max_total_num_tokens}]
    loads = []
    for rank in per_rank:
        capacity = rank["max_total_num_tokens"]
        running, waiting = rank["num_running_reqs"], rank["num_queue_reqs"]
        loads.append({"dp_rank": rank["dp_rank"], "num_running_reqs": running,
                      "num_waiting_reqs": waiting, "num_total_reqs": running + waiting,
                      "num_used_tokens": round(rank["token_usage"] * capacity),
                      "max_total_num_tokens": capacity, "token_usage": rank["token_usage"],
                      "max_running_requests": ctx.engine.server_args.max_running_requests})
    return loads


@router.get("/v1/loads")
async def loads(request: Request, include: str = "all", dp_rank: int | None = None,
                format: str = "json"):
    """SGLang's /v1/loads (JSON): the load of each rank (or of `dp_rank`)."""
    if format != "json":
        raise bad_request("format: only json (the Prometheus form is /metrics, "
                          "with --enable-metrics)", "format")
    unknown = set(include.split(",")) - set(_SECTIONS)
    if unknown:
        raise bad_request(f"include: {sorted(unknown)[0][:40]!r} is not one of "
                          f"{', '.join(_SECTIONS)}", "include")
    ctx = _ctx(request)
    per_rank = rank_loads(ctx)
    ranks = len(per_rank)
    if dp_rank is not None:
        if not 0 <= dp_rank < len(per_rank):
            raise bad_request(f"dp_rank must be in [0, {len(per_rank)})", "dp_rank")
        per_rank = [per_rank[dp_rank]]
    return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "version": xlaserve.__version__, "dp_rank_count": ranks, "loads": per_rank,
            "aggregate": {
                "total_running_reqs": sum(r["num_running_reqs"] for r in per_rank),
                "total_waiting_reqs": sum(r["num_waiting_reqs"] for r in per_rank),
                "total_reqs": sum(r["num_total_reqs"] for r in per_rank),
                "avg_token_usage": sum(r["token_usage"] for r in per_rank) / len(per_rank)}}


@router.get("/get_load")
async def get_load(request: Request):
    """SGLang's older /get_load: a list per rank; `num_tokens` the tokens the rank holds."""
    return [{"dp_rank": r["dp_rank"], "num_reqs": r["num_total_reqs"],
             "num_waiting_reqs": r["num_waiting_reqs"], "num_tokens": r["num_used_tokens"]}
            for r in rank_loads(_ctx(request))]
