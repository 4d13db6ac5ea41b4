"""OpenTelemetry traces: what the gateway and the worker share.

A request's trace begins at its API call in the gateway (gateway/core/tracing.py), crosses
Redis as the W3C ``traceparent`` its queued request carries (``GenerationRequest.
traceparent``), and goes on in the worker that runs it (engine/tracing.py) and in vLLM's
own tracing there. Each process exports its spans itself, over OTLP.

Off unless an OTLP endpoint is set; configured by OpenTelemetry's own variables:

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``http://collector:4318``; the traces go to its
  ``/v1/traces``) or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the whole URL);
- ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or ``..._TRACES_PROTOCOL``): ``http/protobuf`` (the
  default) or ``grpc`` (then the endpoint is ``host:4317``);
- ``OTEL_SERVICE_NAME`` (default ``tokenspout-gateway`` / ``tokenspout-engine``);
- ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG``: the SDK's sampler
  (``parentbased_traceidratio`` with ``0.01`` keeps one trace in a hundred, and follows a
  caller's decision);
- ``OTEL_BSP_*``: the batch exporter; ``OTEL_SDK_DISABLED=true`` or
  ``OTEL_TRACES_EXPORTER=none``: off whatever else is set.

The SDK is imported only when tracing is on: a process with it off holds no tracer, makes
no span and reads no trace context (each instrumented site checks one value).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import SpanContext, Tracer

log = logging.getLogger("tokenspout.tracing")

LOG_TRACE_ID: ContextVar[str] = ContextVar("tokenspout_log_trace_id", default="")
"""The trace id of the request whose code runs in this context: the log lines written
there carry it (wire/logs.py). Set only where a request has a trace."""

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
"""W3C trace context, version 00 (the only one this side writes or continues)."""
_INVALID_TRACE_ID = "0" * 32
_INVALID_SPAN_ID = "0" * 16

ENVIRONMENT: dict[str, str] = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": "Where traces go over OTLP (`http://collector:4318`; their "
    "path `/v1/traces` is added). Unset (the default): tracing is off.",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "The whole traces URL, in place of the one above.",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "`http/protobuf` (the default) or `grpc` (then the "
    "endpoint is `host:4317`).",
    "OTEL_SERVICE_NAME": "The service the spans are of (default `tokenspout-gateway`, "
    "`tokenspout-engine`; vLLM's spans in a worker take the worker's).",
    "OTEL_TRACES_SAMPLER": "Which requests are recorded: `parentbased_traceidratio` follows "
    "a caller's `traceparent` and keeps the ratio below of the rest (default "
    "`parentbased_always_on`: every one).",
    "OTEL_TRACES_SAMPLER_ARG": "The sampler's ratio (`0.01`: one trace in a hundred).",
    "OTEL_BSP_SCHEDULE_DELAY": "Milliseconds between two exports of the spans (default `5000`).",
    "OTEL_SDK_DISABLED": "`true`: tracing off, whatever else is set.",
}
"""What a gateway and a worker read to trace (docs/configuration.md lists them)."""


@dataclass(frozen=True)
class TraceExport:
    """Where a process's spans go."""

    endpoint: str
    """The traces URL (``http/protobuf``) or ``host:port`` (``grpc``)."""
    protocol: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> TraceExport | None:
        """The export OpenTelemetry's variables ask for; None: tracing is off."""
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
            return None
        protocol = (
            env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        ).strip()
        if protocol not in ("http/protobuf", "grpc"):
            raise ValueError(
                f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: tokenspout exports traces over "
                "'http/protobuf' or 'grpc'"
            )
        traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        if traces:
            return cls(traces, protocol)
        if not base:
            return None
        if protocol == "http/protobuf":
            return cls(base.rstrip("/") + "/v1/traces", protocol)
        return cls(base, protocol)


_provider: TracerProvider | None = None


def start_tracer(default_service: str, env: Mapping[str, str] = os.environ) -> Tracer | None:
    """This process's tracer, exporting as the environment says; None when tracing is off.

    Its provider is the process's own, not OpenTelemetry's global one: in a worker, vLLM
    sets the global provider for its own spans (``otlp_traces_endpoint``)."""
    global _provider
    export = TraceExport.from_env(env)
    if export is None:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    service = env.get("OTEL_SERVICE_NAME") or default_service
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    provider.add_span_processor(BatchSpanProcessor(_exporter(export)))
    _provider = provider
    log.info(
        "tracing on",
        extra={"endpoint": export.endpoint, "protocol": export.protocol, "service": service},
    )
    return provider.get_tracer("tokenspout")


def _exporter(export: TraceExport) -> SpanExporter:
    if export.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=export.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=export.endpoint)


def stop_tracer() -> None:
    """Export what is left and stop (at the process's end)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


# --- the trace context on the wire ---------------------------------------------------------


def traceparent_of(context: SpanContext) -> str:
    """A span's context as the W3C ``traceparent`` a child continues."""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def valid_traceparent(value: str) -> bool:
    """A ``traceparent`` this side continues: version 00, non-zero ids."""
    found = TRACEPARENT.match(value)
    return found is not None and found[1] != _INVALID_TRACE_ID and found[2] != _INVALID_SPAN_ID


def trace_id_of(traceparent: str) -> str:
    """The trace id (32 hex digits) of a valid ``traceparent``."""
    return traceparent[3:35]


def sampled(traceparent: str) -> bool:
    """Whether the caller records this trace (the ``sampled`` flag)."""
    return bool(int(traceparent[53:55], 16) & 1)


def remote_parent(traceparent: str) -> Context:
    """The OpenTelemetry context whose parent is the remote span ``traceparent`` names
    (a valid one)."""
    from opentelemetry.trace import (
        NonRecordingSpan,
        SpanContext,
        TraceFlags,
        set_span_in_context,
    )

    parent = SpanContext(
        int(traceparent[3:35], 16),
        int(traceparent[36:52], 16),
        is_remote=True,
        trace_flags=TraceFlags(int(traceparent[53:55], 16)),
    )
    return set_span_in_context(NonRecordingSpan(parent))
