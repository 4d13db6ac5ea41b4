"""A generation's trace in the worker (what both sides share: wire/tracing.py).

The worker continues the trace its request carries (``GenerationRequest.traceparent``,
the API call's span in the gateway). For a recorded trace it adds, under that span:

    tokenspout.queue         the gateway's enqueue -> this worker's take
    tokenspout.generation    the take -> the end of its run here; events: takeover (a run
                             continued from another worker), claimed, cancel, preempted,
                             handed_over; its outcome and tokens as attributes
      tokenspout.prepare     the chat template and tokenizer
      tokenspout.prefill     the engine's start -> the first token
      tokenspout.decode      the first token -> the last
      llm_request            vLLM's own span (vLLM's tracing, on with the worker's)

vLLM joins the trace through the ``trace_headers`` the worker hands its ``generate``: the
generation span's ``traceparent`` (a request its caller does not record passes its own,
unsampled, so vLLM records nothing of it either). A request that carries no traceparent,
or an unrecorded one, makes no span here; its log lines still carry its trace id.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from engine.backends.base import Backend, Prepared
from wire import GenerationRequest
from wire.tracing import (
    LOG_TRACE_ID,
    remote_parent,
    sampled,
    trace_id_of,
    traceparent_of,
    valid_traceparent,
)

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.util.types import AttributeValue


class JobTrace:
    """The spans of one run of a generation in this worker."""

    __slots__ = ("context", "first_token_ns", "prepared_ns", "span", "trace_id", "tracer")

    def __init__(self, tracer: Tracer, span: Span) -> None:
        from opentelemetry.trace import set_span_in_context

        self.tracer = tracer
        self.span = span
        self.trace_id = f"{span.get_span_context().trace_id:032x}"
        self.context: Context = set_span_in_context(span)
        self.prepared_ns = 0
        self.first_token_ns = 0

    def headers(self) -> dict[str, str]:
        """vLLM's ``trace_headers``: its request span goes under the generation's."""
        return {"traceparent": traceparent_of(self.span.get_span_context())}

    def _child(self, name: str, start_ns: int, end_ns: int) -> None:
        self.tracer.start_span(name, context=self.context, start_time=start_ns).end(end_ns)

    def prepared(self, seconds: float) -> None:
        """The prompt was prepared, in ``seconds`` up to now; the engine starts now."""
        self.prepared_ns = time.time_ns()
        self._child("tokenspout.prepare", self.prepared_ns - int(seconds * 1e9), self.prepared_ns)

    def first_token(self) -> None:
        self.first_token_ns = now = time.time_ns()
        if self.prepared_ns:
            self._child("tokenspout.prefill", self.prepared_ns, now)

    def event(self, name: str, attributes: dict[str, AttributeValue] | None = None) -> None:
        self.span.add_event(name, attributes)

    def ended(self, state: str, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Its final event went out."""
        self.span.set_attributes(
            {
                "tokenspout.outcome": state,
                "tokenspout.reason": reason,
                "gen_ai.usage.input_tokens": prompt_tokens,
                "gen_ai.usage.output_tokens": completion_tokens,
            }
        )

    def end(self, state: str) -> None:
        """Its run here is over (``state``: ended, handed over, dropped ...)."""
        now = time.time_ns()
        if self.first_token_ns:
            self._child("tokenspout.decode", self.first_token_ns, now)
        self.span.set_attribute("tokenspout.run", state)
        self.span.end(now)


class WorkerTracing:
    """The worker's tracer, and how each request's trace goes on here."""

    def __init__(self, tracer: Tracer, worker_id: str, model: str, engine_traced: bool) -> None:
        self.tracer = tracer
        self.attributes: dict[str, AttributeValue] = {
            "tokenspout.worker_id": worker_id,
            "gen_ai.request.model": model,
        }
        self.engine_traced = engine_traced
        """vLLM exports its own spans (it was started with the OTLP endpoint)."""

    @classmethod
    def of(cls, tracer: Tracer | None, worker_id: str, backend: Backend) -> WorkerTracing | None:
        """A worker's part of the traces (None: tracing is off, ``tracer`` None)."""
        return None if tracer is None else cls(tracer, worker_id, backend.model, backend.traced)

    def begin(self, request: GenerationRequest, taken_ns: int) -> JobTrace | None:
        """The spans of a run taken at ``taken_ns``: its wait in the queue (ended), and its
        generation's (begun); None unless its caller records its trace (a valid
        ``traceparent``, sampled)."""
        parent = request.traceparent
        if not valid_traceparent(parent) or not sampled(parent):
            return None
        from opentelemetry.trace import SpanKind

        context = remote_parent(parent)
        ids = {
            "tokenspout.generation_id": request.generation_id,
            "tokenspout.session_id": request.session_id,
        }
        queued_ns = int(request.enqueued_at * 1e9)
        if 0 < queued_ns < taken_ns:
            queue = self.tracer.start_span("tokenspout.queue", context, start_time=queued_ns)
            queue.set_attributes(ids)
            queue.end(taken_ns)
        span = self.tracer.start_span(
            "tokenspout.generation",
            context,
            kind=SpanKind.CONSUMER,
            attributes={**self.attributes, **ids, "tokenspout.tenant": request.tenant},
            start_time=taken_ns,
        )
        trace = JobTrace(self.tracer, span)
        resume = request.resume
        if resume is not None:
            trace.event(
                "takeover",
                {
                    "tokenspout.takeover": resume.takeover,
                    "tokenspout.from_worker": resume.from_worker,
                    "tokenspout.streamed_tokens": resume.completion_tokens,
                },
            )
        return trace

    def prepared(
        self, prepared: Prepared, request: GenerationRequest, trace: JobTrace | None, seconds: float
    ) -> Prepared:
        """A run's prompt was prepared in ``seconds``: its span, and the engine input with
        the trace vLLM's own spans join (all of it where vLLM traces; for a run not recorded,
        the request's own unsampled parent, so vLLM records nothing of it either)."""
        if trace is not None:
            trace.prepared(seconds)
        if not self.engine_traced or not request.traceparent:
            return prepared
        headers = trace.headers() if trace is not None else {"traceparent": request.traceparent}
        return dataclasses.replace(prepared, trace_headers=headers)


def follow(
    request: GenerationRequest, taken_at: float, tracing: WorkerTracing | None
) -> JobTrace | None:
    """A run, taken at ``taken_at`` (``time.monotonic``), of a request that carries a
    trace: the log lines of its task carry the trace's id, and with tracing on here its
    spans begin (None: not recorded, or tracing off)."""
    trace = None
    if tracing is not None:
        trace = tracing.begin(request, time.time_ns() - int((time.monotonic() - taken_at) * 1e9))
    if valid_traceparent(request.traceparent):
        LOG_TRACE_ID.set(trace_id_of(request.traceparent))
    return trace


def exemplar(trace: JobTrace | None) -> str:
    """The trace id a histogram keeps as its exemplar ("" when the run is not recorded)."""
    return trace.trace_id if trace is not None else ""
