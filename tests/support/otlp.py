"""An OTLP receiver for tests: what a collector's ``/v1/traces`` gets, decoded.

The processes under test export their spans over OTLP/HTTP (protobuf), as they would to
an OpenTelemetry Collector; this server takes each ``ExportTraceServiceRequest``, decodes
it with the protocol's own messages (``opentelemetry-proto``) and keeps its spans, so a
test can look at one request's trace: which spans, which process made each, their parents
and events.

    with OtlpReceiver() as receiver:
        env = receiver.env("tokenspout-gateway")   # OTEL_EXPORTER_OTLP_ENDPOINT=... for a process
        ...
        spans = receiver.wait_for_trace(trace_id, lambda spans: ..., timeout_s=30)
        print(render_tree(spans))
"""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    kind: int = 0
    status_code: int = 0

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    def event_names(self) -> list[str]:
        return [name for name, _ in self.events]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return {item.key: _value(item.value) for item in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one OTLP export request."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        service=service,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        events=[
                            (e.name, {a.key: _value(a.value) for a in e.attributes})
                            for e in span.events
                        ],
                        kind=span.kind,
                        status_code=span.status.code,
                    )
                )
    return spans


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on loopback, in a thread of the test's process."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                received = decode(body)
                with receiver._lock:
                    receiver.spans.extend(received)
                    receiver.exports += 1
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the test's output stays the test's

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()

    def env(self, service: str, sampler_ratio: float = 1.0) -> dict[str, str]:
        """What a process exports here with: the standard variables, a short batch delay."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_SERVICE_NAME": service,
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": str(sampler_ratio),
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def wait_for_trace(
        self,
        trace_id: str,
        complete: Callable[[list[ReceivedSpan]], bool],
        timeout_s: float = 30,
    ) -> list[ReceivedSpan]:
        """The trace's spans once ``complete`` says they are all in; AssertionError with
        what came when they are not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.of_trace(trace_id)
            if complete(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"trace {trace_id} incomplete after {timeout_s} s:\n{render_tree(spans)}"
                )
            time.sleep(0.05)


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return sorted(
        (span for span in spans if span.parent_span_id == parent.span_id),
        key=lambda span: span.start_ns,
    )


def _walk(spans: list[ReceivedSpan], span: ReceivedSpan, depth: int, origin: int) -> Iterator[str]:
    events = "".join(f" [{name}]" for name in span.event_names())
    at = (span.start_ns - origin) / 1e6
    yield (
        f"{'  ' * depth}{span.name}  ({span.service})  +{at:.1f} ms  "
        f"{span.duration_ms:.1f} ms{events}"
    )
    for child in children(spans, span):
        yield from _walk(spans, child, depth + 1, origin)


def render_tree(spans: list[ReceivedSpan]) -> str:
    """The trace as an indented tree: each span's name, process, start (from the trace's
    first span) and duration, its events in brackets; spans whose parent is not among
    them are roots."""
    if not spans:
        return "(no spans)"
    ids = {span.span_id for span in spans}
    origin = min(span.start_ns for span in spans)
    roots = sorted(
        (span for span in spans if span.parent_span_id not in ids), key=lambda s: s.start_ns
    )
    return "\n".join(line for root in roots for line in _walk(spans, root, 0, origin))
