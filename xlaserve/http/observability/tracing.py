"""Request traces (`--otlp-traces-endpoint`, or SGLang's `--enable-trace`): a span per API call
exported with OpenTelemetry over OTLP/HTTP, named `{operation} {model}` with the gen_ai
semantic conventions' attributes (operation, model, request settings, response id, input and
output tokens, finish reasons) and the request's times: `xlaserve.queue_time_s` (waiting to be
scheduled, the engine's), `xlaserve.prefill_time_s` (then to its first token),
`xlaserve.decode_time_s` (then to its end), with a `first_token` event. A generation cut short
(its client left) ends its span with an error status.

Off (ServingContext.tracing None), a Generation calls nothing here and the OpenTelemetry
packages are not imported, as with metrics off. On, the spans go to the collector in batches from
OpenTelemetry's own thread.
"""
from __future__ import annotations

DEFAULT_ENDPOINT = "http://localhost:4318/v1/traces"  # a local collector's OTLP/HTTP port


def request_tracing(args) -> "OtlpTracing | None":
    """The server's tracing from its flags: None (off), or spans to the OTLP/HTTP collector."""
    endpoint = args.otlp_traces_endpoint or (DEFAULT_ENDPOINT if args.enable_trace else None)
    if endpoint is None:
        return None
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"--otlp-traces-endpoint {endpoint[:100]}: give the collector's OTLP/HTTP "
                         f"URL ({DEFAULT_ENDPOINT}); OTLP over gRPC is not supported")
    return OtlpTracing(endpoint)


class OtlpTracing:
    def __init__(self, endpoint: str):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: pip install "
                             "'xlaserve[trace]'") from None

        self.endpoint = endpoint
        self.provider = TracerProvider(resource=Resource.create({"service.name": "xlaserve"}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("xlaserve")

    def start(self, operation, model, prompts, params, choices, response_id) -> "RequestTrace":
        from opentelemetry.trace import SpanKind

        attributes = {"gen_ai.operation.name": operation, "gen_ai.request.model": model,
                      "gen_ai.response.model": model, "gen_ai.response.id": response_id,
                      "gen_ai.usage.input_tokens": sum(len(p) for p in prompts),
                      "gen_ai.request.choice.count": choices,
                      "gen_ai.request.max_tokens": params.max_new_tokens,
                      "gen_ai.request.temperature": params.temperature,
                      "gen_ai.request.top_p": params.top_p}
        if params.top_k > 0:
            attributes["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        span = self.tracer.start_span(f"{operation} {model}", kind=SpanKind.SERVER,
                                      attributes=attributes)
        return RequestTrace(span, choices)

    def shutdown(self) -> None:
        self.provider.shutdown()  # what is still batched goes out first


class RequestTrace:
    """One API call's span: its choices' outputs, until the last one ends."""

    def __init__(self, span, choices: int):
        self.span, self.open_choices = span, choices
        self.first_token_s: float | None = None
        self.output_tokens, self.queued_s, self.reasons = 0, 0.0, []

    def observe(self, index: int, output, elapsed_s: float) -> None:
        if output.token_id is not None and self.first_token_s is None:
            self.first_token_s = elapsed_s
            self.span.add_event("first_token")
        if output.finished and self.open_choices:
            finish = output.finish
            self.output_tokens += finish.completion_tokens
            self.queued_s = max(self.queued_s, finish.queued_s)
            self.reasons.append(finish.reason)
            self.open_choices -= 1
            if not self.open_choices:
                self._close(elapsed_s)

    def end(self) -> None:
        """The generation stopped reading (ended, or its client left): a span still open
        ends as an error."""
        if self.open_choices:
            from opentelemetry.trace import Status, StatusCode

            self.open_choices = 0
            self.span.set_status(Status(StatusCode.ERROR, "the request was aborted"))
            self._close(None)

    def _close(self, elapsed_s: float | None) -> None:
        first = self.first_token_s
        attributes = {"gen_ai.usage.output_tokens": self.output_tokens,
                      "gen_ai.response.finish_reasons": self.reasons,
                      "xlaserve.queue_time_s": self.queued_s}
        if first is not None:
            attributes["xlaserve.prefill_time_s"] = max(first - self.queued_s, 0.0)
            if elapsed_s is not None:
                attributes["xlaserve.decode_time_s"] = elapsed_s - first
        self.span.set_attributes(attributes)
        self.span.end()
