"""A request's trace in the gateway (what both sides share: wire/tracing.py).

With tracing on, the outermost layer (gateway/server/middleware.py) begins a
``RequestTrace`` for each API call: its span, continuing the caller's ``traceparent`` or
beginning a new trace, recorded or not as the sampler says (one not recorded still has a
trace id: the logs, the ``traceresponse`` header and the worker's logs carry it). The code
below it asks this module, never the SDK:

    with tracing.span("tokenspout.admission", model=name):   # a child span of the API call
        ...
    request = GenerationRequest(..., traceparent=tracing.traceparent())  # the worker's parent
    tracing.event("cancel", reason="user")                   # on the API call's span

and recovery, which runs outside any request, adds to a request's trace from the
``traceparent`` its queued request carries (``detached_span``).

Off (no OTLP endpoint), nothing begins a trace: every site costs one context-variable read
and makes no object.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING

from wire.tracing import LOG_TRACE_ID, remote_parent, sampled, traceparent_of, valid_traceparent

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, SpanKind, Tracer
    from opentelemetry.util.types import AttributeValue

Attributes = Mapping[str, "AttributeValue"]

_CURRENT: ContextVar[RequestTrace | None] = ContextVar("tokenspout_trace", default=None)
_tracer: Tracer | None = None
_server: SpanKind | None = None
"""The API call's span kind (imported with the tracer: OpenTelemetry's API is 60 ms of a
start, which a process with tracing off does not pay)."""


def configure(tracer: Tracer | None) -> None:
    """This process's tracer (wire.tracing.start_tracer); None: tracing off."""
    global _tracer, _server
    _tracer = tracer
    if tracer is not None:
        from opentelemetry.trace import SpanKind

        _server = SpanKind.SERVER


def enabled() -> bool:
    return _tracer is not None


class RequestTrace:
    """One API call's trace: its span, and the ``traceparent`` a queued request carries."""

    __slots__ = ("began_ns", "context", "responded_ns", "span", "trace_id", "traceparent")

    def __init__(self, span: Span) -> None:
        self.span = span
        own = span.get_span_context()
        self.traceparent = traceparent_of(own)
        self.trace_id = self.traceparent[3:35]
        self.context: Context | None = None
        """The parent of its child spans; None: not recorded (no child is made)."""
        if span.is_recording():
            from opentelemetry.trace import set_span_in_context

            self.context = set_span_in_context(span)
        self.began_ns = time.time_ns()
        self.responded_ns = 0
        """When the response began (its head went out); 0: not yet."""

    @property
    def recording(self) -> bool:
        return self.context is not None

    def responded(self) -> None:
        """The response's head goes out now: what follows is the relay to the client."""
        self.responded_ns = time.time_ns()

    def end(self, name: str, failed: bool, attributes: Attributes) -> None:
        """The call ended (``failed``: the server's fault): its span gets its name (the
        route's), the relay to the client (from the response's head to now) and ends."""
        span = self.span
        if self.context is None:
            span.end()
            return
        from opentelemetry.trace import StatusCode

        now = time.time_ns()
        span.update_name(name)
        span.set_attributes(attributes)
        if self.responded_ns and _tracer is not None:
            relay = _tracer.start_span(
                "tokenspout.relay", context=self.context, start_time=self.responded_ns
            )
            relay.end(end_time=now)
        if failed:
            span.set_status(StatusCode.ERROR)
        span.end(end_time=now)


def begin(name: str, incoming: str | None, attributes: Attributes) -> RequestTrace | None:
    """The trace of an API call beginning in this context: the caller's ``traceparent``
    (``incoming``, when valid) continued, else a new trace; None when tracing is off."""
    tracer, kind = _tracer, _server
    if tracer is None or kind is None:
        return None
    parent = remote_parent(incoming) if incoming and valid_traceparent(incoming) else None
    span = tracer.start_span(name, context=parent, kind=kind, attributes=attributes)
    trace = RequestTrace(span)
    _CURRENT.set(trace)
    LOG_TRACE_ID.set(trace.trace_id)
    return trace


def current() -> RequestTrace | None:
    """The trace of the API call being served; None: tracing is off (or no call)."""
    return _CURRENT.get()


def traceparent() -> str:
    """What a request queued now carries to its worker: the API call's ``traceparent``,
    "" when it has no trace."""
    trace = _CURRENT.get()
    return "" if trace is None else trace.traceparent


class _ChildSpan:
    """A child span of the API call, ended when its block ends (an error recorded)."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def __enter__(self) -> Span:
        return self.span

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error is not None:
            from opentelemetry.trace import StatusCode

            self.span.record_exception(error)
            self.span.set_status(StatusCode.ERROR, f"{kind.__name__ if kind else ''}: {error}")
            code = getattr(error, "code", None)
            if isinstance(code, str):
                self.span.set_attribute("tokenspout.error.code", code)
        self.span.end()


NO_SPAN: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
"""What a ``with`` gets where no span is made."""


def recording() -> bool:
    """Whether the API call being served is recorded (its child spans are made)."""
    trace = _CURRENT.get()
    return trace is not None and trace.context is not None


def span(
    name: str, attributes: Attributes | None = None
) -> contextlib.AbstractContextManager[object]:
    """A child span of the API call being served, for a ``with`` block; nothing when the
    call's trace is not recorded."""
    trace = _CURRENT.get()
    if trace is None or trace.context is None or _tracer is None:
        return NO_SPAN
    return _ChildSpan(_tracer.start_span(name, context=trace.context, attributes=attributes))


def event(name: str, attributes: Attributes | None = None) -> None:
    """Something that happened to the API call being served (a cancel), on its span."""
    trace = _CURRENT.get()
    if trace is not None and trace.context is not None:
        trace.span.add_event(name, attributes)


def annotate(attributes: Attributes) -> None:
    """Attributes of the API call being served (the ids of what it queued)."""
    trace = _CURRENT.get()
    if trace is not None and trace.context is not None:
        trace.span.set_attributes(attributes)


def detached_span(traceparent: str, name: str, attributes: Attributes, began_ns: int) -> None:
    """A span of a request's trace made outside its call (recovery: a takeover, from
    ``began_ns`` to now), under the span its ``traceparent`` names; nothing when that
    trace is not recorded."""
    tracer = _tracer
    if tracer is None or not valid_traceparent(traceparent) or not sampled(traceparent):
        return
    parent = remote_parent(traceparent)
    tracer.start_span(name, parent, attributes=attributes, start_time=began_ns).end()
