"""Prometheus metrics (`--enable-metrics`), named like SGLang's with the `xlaserve:` prefix, or
(`--metrics-name-style`) exactly as SGLang or vLLM name them, so that their Grafana dashboards
read an xlaserve server: one family at a time, since a dashboard reads one and three families
would triple the series a scrape stores.

Each app gets its own registry (tests start several servers in one process); the scheduler
gauges are read when /metrics is scraped, so the engine loop never pays for them.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)

# Each metric's name by style (prometheus_client adds `_total` to a counter's), and the label
# of a finished request's reason. vLLM: its V1 engine's names (docs.vllm.ai, "Production Metrics").
_NAMES = {
    "xlaserve": dict(prompt_tokens="xlaserve:prompt_tokens",
                     generation_tokens="xlaserve:generation_tokens",
                     requests="xlaserve:num_requests", http_requests="xlaserve:http_requests",
                     ttft="xlaserve:time_to_first_token_seconds",
                     itl="xlaserve:inter_token_latency_seconds",
                     e2e="xlaserve:e2e_request_latency_seconds",
                     num_running_reqs="xlaserve:num_running_reqs",
                     num_queue_reqs="xlaserve:num_queue_reqs", token_usage="xlaserve:token_usage",
                     spec_accept_length="xlaserve:spec_accept_length",
                     finish_reason="finish_reason"),
}
_NAMES["sglang"] = {k: v.replace("xlaserve:", "sglang:") for k, v in _NAMES["xlaserve"].items()}
_NAMES["vllm"] = {k: v.replace("xlaserve:", "vllm:") for k, v in _NAMES["xlaserve"].items()}
_NAMES["vllm"].update(requests="vllm:request_success", num_running_reqs="vllm:num_requests_running",
                      num_queue_reqs="vllm:num_requests_waiting",
                      token_usage="vllm:kv_cache_usage_perc", finish_reason="finished_reason")
NAME_STYLES = tuple(_NAMES)


class _SchedulerGauges:
    """running / queued requests and KV usage; with --dp-size > 1 one series per replica,
    labelled `dp_rank` as SGLang does (`sum(...)` in PromQL gives the server's total)."""

    def __init__(self, stats: Callable[[], dict], model_name: str, names: dict):
        self._stats = stats
        self._model_name = model_name
        self._names = names

    def collect(self):
        stats = self._stats()
        replicas = stats.get("replicas")
        for name, doc in (("num_running_reqs", "requests running (decoding or prefilling)"),
                          ("num_queue_reqs", "requests waiting to be scheduled"),
                          ("token_usage", "fraction of the KV cache pool in use"),
                          ("spec_accept_length", "tokens a speculative verified row kept on "
                                                 "average since start (0 before the first)")):
            if name not in (stats if replicas is None else replicas[0]):
                continue  # speculative decoding's, only with --speculative-algorithm
            if replicas is None:
                gauge = GaugeMetricFamily(self._names[name], doc, labels=["model_name"])
                gauge.add_metric([self._model_name], float(stats[name]))
            else:
                gauge = GaugeMetricFamily(self._names[name], doc + ", per data parallel replica",
                                          labels=["model_name", "dp_rank"])
                for replica in replicas:
                    gauge.add_metric([self._model_name, str(replica["dp_rank"])],
                                     float(replica[name]))
            yield gauge


class Metrics:
    def __init__(self, model_name: str, stats: Callable[[], dict], name_style: str = "xlaserve",
                 ttft_buckets=None, itl_buckets=None, e2e_buckets=None):
        """`name_style`: one of NAME_STYLES. The buckets (seconds) default to _LATENCY_BUCKETS,
        as SGLang's --bucket-* flags do."""
        disable_created_metrics()  # the `*_created` timestamp series only add noise
        names = _NAMES[name_style]
        self.registry = CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self.prompt_tokens = Counter(names["prompt_tokens"], "prompt tokens processed", **labels)
        self.generation_tokens = Counter(names["generation_tokens"], "tokens generated", **labels)
        self.requests = Counter(names["requests"], "requests finished, by finish reason",
                                labelnames=["model_name", names["finish_reason"]],
                                registry=self.registry)
        self.http_requests = Counter(names["http_requests"], "HTTP requests by route and status",
                                     labelnames=["model_name", "route", "status"],
                                     registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(names[name], doc, buckets=tuple(buckets or _LATENCY_BUCKETS), **labels)

        self._ttft = histogram("ttft", "time to first token", ttft_buckets)
        self._itl = histogram("itl", "time between tokens", itl_buckets)
        self._e2e = histogram("e2e", "request latency", e2e_buckets)
        self.registry.register(_SchedulerGauges(stats, model_name, names))
        self.model_name = model_name
        self.time_to_first_token = self._ttft.labels(model_name)
        self.inter_token_latency = self._itl.labels(model_name)

    def request_started(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)

    def request_finished(self, finish_reason: str, completion_tokens: int, latency_s: float) -> None:
        self.generation_tokens.labels(self.model_name).inc(completion_tokens)
        self.requests.labels(self.model_name, finish_reason).inc()
        self._e2e.labels(self.model_name).observe(latency_s)

    def observe(self, last_token_at: dict, index: int, output, elapsed_s: float) -> None:
        """One output of a request's choice `index`, `elapsed_s` after the request started;
        `last_token_at`: the request's record of each choice's last token (elapsed seconds)."""
        if output.token_id is not None:
            last = last_token_at.get(index)
            if last is None:
                self.time_to_first_token.observe(elapsed_s)
            else:
                self.inter_token_latency.observe(elapsed_s - last)
            last_token_at[index] = elapsed_s
        if output.finished:
            self.request_finished(output.finish.reason, output.finish.completion_tokens, elapsed_s)

    def http_request(self, route: str, status: int) -> None:
        """`route`: a route's path template or "unmatched" (app.RecordRequests), never a raw
        path: one series per URL a client makes up would grow without bound."""
        self.http_requests.labels(self.model_name, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
