"""Prometheus metrics (`--enable-metrics`), named like SGLang's with the `xlaserve:` prefix.

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


class _SchedulerGauges:
    """running / queued requests and KV usage; with --dp-size > 1 one series per replica,
    labelled `dp_rank` as SGLang does (`sum(...)` in PromQL gives the server's total)."""

    def __init__(self, stats: Callable[[], dict], model_name: str):
        self._stats = stats
        self._model_name = model_name

    def collect(self):
        stats = self._stats()
        replicas = stats.get("replicas")
        for name, doc in (("num_running_reqs", "requests running (decoding or prefilling)"),
                          ("num_queue_reqs", "requests waiting to be scheduled"),
                          ("token_usage", "fraction of the KV cache pool in use")):
            if replicas is None:
                gauge = GaugeMetricFamily(f"xlaserve:{name}", doc, labels=["model_name"])
                gauge.add_metric([self._model_name], float(stats[name]))
            else:
                gauge = GaugeMetricFamily(f"xlaserve:{name}", doc + ", per data parallel replica",
                                          labels=["model_name", "dp_rank"])
                for replica in replicas:
                    gauge.add_metric([self._model_name, str(replica["dp_rank"])],
                                     float(replica[name]))
            yield gauge


class Metrics:
    def __init__(self, model_name: str, stats: Callable[[], dict]):
        disable_created_metrics()  # the `*_created` timestamp series only add noise
        self.registry = CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self.prompt_tokens = Counter("xlaserve:prompt_tokens", "prompt tokens processed", **labels)
        self.generation_tokens = Counter("xlaserve:generation_tokens", "tokens generated", **labels)
        self.requests = Counter("xlaserve:num_requests", "requests finished, by finish reason",
                                labelnames=["model_name", "finish_reason"], registry=self.registry)
        self.http_requests = Counter("xlaserve:http_requests", "HTTP requests by route and status",
                                     labelnames=["model_name", "route", "status"],
                                     registry=self.registry)
        histogram = dict(labels, buckets=_LATENCY_BUCKETS)
        self._ttft = Histogram("xlaserve:time_to_first_token_seconds", "time to first token", **histogram)
        self._itl = Histogram("xlaserve:inter_token_latency_seconds", "time between tokens", **histogram)
        self._e2e = Histogram("xlaserve:e2e_request_latency_seconds", "request latency", **histogram)
        self.registry.register(_SchedulerGauges(stats, model_name))
        self.model_name = model_name
        self.time_to_first_token = self._ttft.labels(model_name)
        self.inter_token_latency = self._itl.labels(model_name)

    def request_started(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)

    def request_finished(self, finish_reason: str, completion_tokens: int, latency_s: float) -> None:
        self.generation_tokens.labels(self.model_name).inc(completion_tokens)
        self.requests.labels(self.model_name, finish_reason).inc()
        self._e2e.labels(self.model_name).observe(latency_s)

    def http_request(self, route: str, status: int) -> None:
        """`route`: a route's path template or "unmatched" (app.RecordRequests), never a raw
        path: one series per URL a client makes up would grow without bound."""
        self.http_requests.labels(self.model_name, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
