"""The HTTP server's flags: where it listens, who may call it, request bodies, metrics, logs
and its shutdown."""
from __future__ import annotations

import dataclasses
from typing import Optional

from xlaserve.server_args.flag import flag


@dataclasses.dataclass
class HttpFlags:
    """The HTTP server."""

    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(30000, "port to listen on")
    api_key: Optional[str] = flag(
        None, "require 'Authorization: Bearer <key>' on every route but /health and /metrics; "
              "default: $XLASERVE_API_KEY. Prefer the variable: a key on the command line is "
              "visible to every user of the machine (ps, /proc)",
        env="XLASERVE_API_KEY", secret=True)
    allowed_origins: Optional[str] = flag(
        None, "comma-separated browser origins (scheme://host[:port]) allowed to call the server, "
              "answered with CORS headers; * allows any. A request from any other Origin than "
              "the server's own is refused (403)")
    max_payload_size: int = flag(32 * 1024 * 1024, "largest request body in bytes (413 above)")
    enable_metrics: bool = flag(False, "serve Prometheus metrics at /metrics")
    metrics_name_style: str = flag(
        "xlaserve", "the metrics' names: xlaserve (SGLang's names, xlaserve: prefix), sglang "
                    "(SGLang's exactly: sglang:num_running_reqs...) or vllm (vLLM's: "
                    "vllm:num_requests_running, vllm:kv_cache_usage_perc...), for their dashboards",
        choices=["xlaserve", "sglang", "vllm"])
    bucket_time_to_first_token: Optional[list[float]] = flag(
        None, "time-to-first-token histogram buckets in seconds (default: 0.005 to 160)",
        nargs="+")
    bucket_inter_token_latency: Optional[list[float]] = flag(
        None, "inter-token latency histogram buckets in seconds (default: as above)", nargs="+")
    bucket_e2e_request_latency: Optional[list[float]] = flag(
        None, "request latency histogram buckets in seconds (default: as above)", nargs="+")
    log_requests: bool = flag(False, "log every HTTP request")
    otlp_traces_endpoint: Optional[str] = flag(
        None, "export a trace of each request with OpenTelemetry, over OTLP/HTTP, to this "
              "collector URL (http://localhost:4318/v1/traces): a span per request with the "
              "gen_ai attributes (model, input and output tokens) and its queue, prefill and "
              "decode times; off by default")
    enable_trace: bool = flag(
        False, "SGLang's switch for request traces: to --otlp-traces-endpoint, by default "
               "http://localhost:4318/v1/traces")
    stream_interval: int = flag(1, "tokens per streamed chunk")
    skip_server_warmup: bool = flag(False, "do not run a warm-up generation before ready")
    graceful_shutdown_timeout: float = flag(
        30.0, "seconds that running requests and batch lines may take to finish after SIGTERM or "
              "SIGINT (new ones get 503 meanwhile); the rest are then aborted with an error and "
              "the server exits (status 0; a second signal ends the wait at once)")
