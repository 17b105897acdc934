"""Request traces (`--otlp-traces-endpoint`, http/observability/tracing.py) reach an OTLP/HTTP receiver started
here: a span per request with the gen_ai attributes and the request's queue, prefill and decode
times, an error status for a stream its client left; off, nothing is traced."""
import dataclasses
import http.server
import threading
import time

import httpx
import pytest

from tests.http.conftest import AppServer

pytest.importorskip("opentelemetry.sdk")


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP collector: keeps the spans of each POST /v1/traces (protobuf)."""

    def __init__(self):
        self.spans, self.resources = [], []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest)

                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    receiver.resources.append(resource_spans.resource)
                    for scope in resource_spans.scope_spans:
                        receiver.spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server_address[1]}/v1/traces"


def attributes(span) -> dict:
    def value(v):
        kind = v.WhichOneof("value")
        if kind == "array_value":
            return [value(x) for x in v.array_value.values]
        return getattr(v, kind)
    return {a.key: value(a.value) for a in span.attributes}


@pytest.fixture(scope="module")
def traced(server):
    """An app over the test server's engine, tracing to a receiver."""
    from xlaserve.http.app import create_app
    from xlaserve.http.observability import OtlpTracing

    receiver = Receiver()
    ctx = dataclasses.replace(server.ctx, tracing=OtlpTracing(receiver.url))
    running = AppServer(create_app(ctx), ctx)
    yield running, receiver
    running.close()
    ctx.tracing.shutdown()
    receiver.shutdown()


def spans_named(traced, name: str, count: int) -> list:
    running, receiver = traced
    running.ctx.tracing.provider.force_flush()
    deadline = time.monotonic() + 10
    while len([s for s in receiver.spans if s.name == name]) < count:
        assert time.monotonic() < deadline, [s.name for s in receiver.spans]
        time.sleep(0.05)
    return [s for s in receiver.spans if s.name == name]


def test_a_request_is_a_span_with_its_tokens_and_times(traced):
    running, receiver = traced
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "temperature": 0, "logit_bias": {"2": -100, "0": -100}}
    reply = httpx.post(running.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    (span,) = spans_named(traced, "chat tiny", 1)
    got = attributes(span)
    assert got["gen_ai.operation.name"] == "chat" and got["gen_ai.request.model"] == "tiny"
    assert got["gen_ai.response.id"] == reply["id"].removeprefix("chatcmpl-")
    assert (got["gen_ai.usage.input_tokens"], got["gen_ai.usage.output_tokens"]) == \
        (reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"]) and \
        got["gen_ai.usage.output_tokens"] == 5
    assert got["gen_ai.response.finish_reasons"] == ["length"]
    assert (got["gen_ai.request.max_tokens"], got["gen_ai.request.temperature"]) == (5, 0.0)
    times = [got["xlaserve.queue_time_s"], got["xlaserve.prefill_time_s"],
             got["xlaserve.decode_time_s"]]
    assert all(t >= 0 for t in times)
    assert sum(times) <= (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 + 0.01
    assert [e.name for e in span.events] == ["first_token"]
    assert span.status.code != 2  # not an error
    service = {a.key: a.value.string_value for r in receiver.resources for a in r.attributes}
    assert service["service.name"] == "xlaserve"


def test_a_stream_its_client_left_ends_its_span_as_an_error(traced):
    running, _ = traced
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 300, "stream": True,
            "temperature": 0, "logit_bias": {"2": -100, "0": -100}}
    with httpx.stream("POST", running.base_url + "/v1/completions", json=body,
                      timeout=60) as response:
        next(response.iter_lines())  # one chunk, then the client goes
    (span,) = spans_named(traced, "text_completion tiny", 1)
    assert span.status.code == 2 and "aborted" in span.status.message  # STATUS_CODE_ERROR


def test_off_by_default_and_an_endpoint_that_is_not_otlp_http_is_refused():
    from xlaserve.http.observability import request_tracing
    from xlaserve.server_args import ServerArgs

    assert request_tracing(ServerArgs()) is None
    with pytest.raises(ValueError, match="OTLP over gRPC is not supported"):
        request_tracing(ServerArgs(otlp_traces_endpoint="localhost:4317"))
    default = request_tracing(ServerArgs(enable_trace=True))
    assert default.endpoint == "http://localhost:4318/v1/traces"
    default.shutdown()
