"""Prometheus metrics of one gateway process, served at ``/metrics``.

Each process has its own ``CollectorRegistry`` (no module-level state). Most numbers come
from hooks that cost a dict look-up per event:

- ``RelayHub`` reports every live event once per process (not once per reader), when the
  last reader of a session in this process leaves, and when a slow reader's feed overflows;
- the ``Submitter`` (gateway/core/store/submitter.py) reports each queued generation (with
  its ``queued`` event id, whose first part is Redis' clock in milliseconds) and each
  cancel it sends;
- ``RequestMetrics`` (gateway/server/middleware.py) counts requests by route and status.

Time to first token is measured from the ``queued`` event's Redis timestamp to the moment
this process receives the first token, so it covers queueing, prefill and the relay; it
assumes the gateway's clock and Redis' agree (one host, or NTP). It is observed for
generations this process queued or saw queued. Inter-token latency is the gap between two
tokens of one generation arriving here; the queue wait, from the ``queued`` event to the
``started`` one. The three are per model and per key (bounded: the directory's labels), and
carry the trace id of a recorded request as an exemplar (OpenMetrics scrapes only). Queue
depths, live workers per model and whether Redis answers are read at scrape time.

At a generation's end this process writes one line for it (``generation ended``: its ids,
trace, key, model, tokens, time to first token, duration, state and reason).
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar

import wire
from gateway.core import tracing
from gateway.core.relay.feed import RelayEvent
from gateway.server.federation import MetricsPeers, openmetrics_exposition
from wire import TERMINAL_EVENTS, Started

log = logging.getLogger("tokenspout.generations")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
MAX_TRACKED = 50_000
"""Generations followed at once; past it the oldest are forgotten (never unbounded)."""


class Gaps:
    """One label set's counts of a ``PlainHistogram``: plain numbers, no lock."""

    __slots__ = ("bounds", "counts", "exemplars", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.exemplars: list[Exemplar | None] = [None] * (len(bounds) + 1)

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def observe_traced(self, amount: float, trace_id: str) -> None:
        """``observe``, the request's trace kept as its bucket's exemplar."""
        bucket = bisect_left(self.bounds, amount)
        self.counts[bucket] += 1
        self.sum += amount
        self.exemplars[bucket] = Exemplar({"trace_id": trace_id}, amount, time.time())


class PlainHistogram(Collector):
    """A histogram observed once per token, per model and key: plain counters, no lock,
    turned into the Prometheus histogram at scrape. ``Histogram.observe`` takes a lock per
    bucket count and per sum (the gateway observes from its event loop thread only): with
    the GC passes it triggers, 17 % of the gateway's busy samples at 500 streams. A
    generation looks its label set's ``Gaps`` up once, at its first token."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = buckets
        self.children: dict[tuple[str, str], Gaps] = {}

    def labels(self, model: str, tenant: str) -> Gaps:
        child = self.children.get((model, tenant))
        if child is None:
            child = self.children[model, tenant] = Gaps(self.bounds)
        return child

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model", "tenant"])
        bounds = [*(repr(float(bound)) for bound in self.bounds), "+Inf"]
        for labels, child in self.children.items():
            cumulative, buckets = 0, []
            for bound, count, exemplar in zip(bounds, child.counts, child.exemplars, strict=True):
                cumulative += count
                bucket = (bound, cumulative) if exemplar is None else (bound, cumulative, exemplar)
                buckets.append(bucket)
            family.add_metric(list(labels), buckets, child.sum)
        yield family


UNKNOWN = "unknown"
"""The model or key of a generation this process did not queue (until its ``started``)."""


@dataclass(slots=True)
class _Live:
    session_id: str
    queued_ms: int | None = None
    started: bool = False
    last_token_at: float | None = None
    cancel_began: float | None = None
    model: str = UNKNOWN
    tenant: str = UNKNOWN
    trace_id: str = ""
    """Its trace's id (the end's log line), "" when it has none."""
    exemplar: str = ""
    """Its trace's id when that trace is recorded: its histograms' exemplar."""
    first_token_s: float | None = None
    gaps: Gaps | None = None


def _per_model_and_key(name: str, documentation: str, registry: CollectorRegistry) -> Histogram:
    """A latency histogram by model and key; a recorded request's trace id its exemplar."""
    labels = ["model", "tenant"]
    return Histogram(name, documentation, labels, buckets=_LATENCY_BUCKETS, registry=registry)


def _key_counters(registry: CollectorRegistry) -> tuple[Counter, Counter]:
    """Requests admitted, and refused, by API key (gateway/core/store/admission.py)."""
    admitted = Counter(
        "tokenspout_gateway_key_requests",
        "Requests admitted, by API key (its name: the first 100 keys by name, then "
        "'other'; a key of TOKENSPOUT_API_KEYS: its id; no key: 'anonymous').",
        ["key"],
        registry=registry,
    )
    refused = Counter(
        "tokenspout_gateway_key_refusals",
        "Requests refused by a key's limits, by key (as key_requests) and limit "
        "(concurrent, requests_per_minute, tokens_per_minute, tokens_per_day, models).",
        ["key", "limit"],
        registry=registry,
    )
    return admitted, refused


class GatewayMetrics:
    """The registry, its metrics, and the hooks that feed them."""

    def __init__(self, peers_dir: Path | None = None, process_index: int = 0) -> None:
        self.tenant_label: Callable[[str], str] = lambda tenant_id: tenant_id or "anonymous"
        """A tenant id's label (the key directory's: bounded); set once the directory is."""
        self.registry = r = CollectorRegistry()
        self._count_requests_and_generations(r)
        self._time_generations(r)
        self._count_troubles(r)
        self._gauge_the_queues(r)
        self.key_requests, self.key_refusals = _key_counters(r)
        from_redis = (
            self.queued,
            self.running,
            self.model_queued,
            self.model_running,
            self.model_workers,
            self.redis_up,
        )
        shared = frozenset(family.name for gauge in from_redis for family in gauge.describe())
        self.peers = (
            None if peers_dir is None else MetricsPeers(peers_dir, process_index, r, shared)
        )
        """The sibling processes of ``python -m gateway --workers N``
        (gateway/server/federation.py); ``shared``: the gauges read from Redis at
        scrape, the same in every process."""
        self._live: dict[str, _Live] = {}
        self._by_session: dict[str, set[str]] = {}

    def _count_requests_and_generations(self, r: CollectorRegistry) -> None:
        self.active_streams = Gauge(
            "tokenspout_gateway_active_streams",
            "Open event feeds in this process (SSE streams, WebSocket subscriptions, "
            "API requests waiting on a generation).",
            registry=r,
        )
        self.requests = Counter(
            "tokenspout_gateway_requests",
            "HTTP requests and WebSocket connections, by method, route and status.",
            ["method", "route", "status"],
            registry=r,
        )
        self.generations_submitted = Counter(
            "tokenspout_gateway_generations_submitted",
            "Generations this process queued.",
            registry=r,
        )
        self.generations_ended = Counter(
            "tokenspout_gateway_generations_ended",
            "Final events relayed by this process, by event type.",
            ["type"],
            registry=r,
        )
        self.model_submitted = Counter(
            "tokenspout_gateway_model_generations_submitted",
            "Generations this process queued, by model.",
            ["model"],
            registry=r,
        )

    def _time_generations(self, r: CollectorRegistry) -> None:
        self.time_to_first_token = _per_model_and_key(
            "tokenspout_gateway_time_to_first_token_seconds",
            "From a generation's queued event to its first token reaching this process, by "
            "model and key (the first 100 keys by name, then 'other').",
            r,
        )
        self.queue_wait = _per_model_and_key(
            "tokenspout_gateway_queue_wait_seconds",
            "From a generation's queued event to its started event reaching this process "
            "(waiting for a worker), by model and key.",
            r,
        )
        self.inter_token = PlainHistogram(
            "tokenspout_gateway_inter_token_seconds",
            "Gap between consecutive tokens of one generation reaching this process, by "
            "model and key.",
            _TOKEN_GAP_BUCKETS,
        )
        r.register(self.inter_token)
        self.cancel_to_stop = Histogram(
            "tokenspout_gateway_cancel_to_stop_seconds",
            "From a cancel request to the generation's final event reaching this process.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _count_troubles(self, r: CollectorRegistry) -> None:
        self.abandoned = Counter(
            "tokenspout_gateway_abandoned_generations",
            "Running generations whose last reader in this process left before the final "
            "event (the engine aborts them after the abandon grace unless a reader returns).",
            registry=r,
        )
        self.redis_errors = Counter(
            "tokenspout_gateway_redis_errors",
            "Redis failures, by where they happened.",
            ["where"],
            registry=r,
        )
        self.fell_behind_feeds = Counter(
            "tokenspout_gateway_relay_fell_behind",
            "Times a feed's buffer (TOKENSPOUT_STREAM_BUFFER_EVENTS) overflowed because its "
            "reader was slow: the buffer is dropped and the feed re-reads Redis.",
            registry=r,
        )

    def _gauge_the_queues(self, r: CollectorRegistry) -> None:
        self.queued = Gauge(
            "tokenspout_gateway_generations_queued",
            "Generations waiting for a worker, all workers (read from Redis at scrape).",
            registry=r,
        )
        self.running = Gauge(
            "tokenspout_gateway_generations_running",
            "Generations a worker has taken and not finished, all workers (at scrape).",
            registry=r,
        )
        self.model_queued = Gauge(
            "tokenspout_gateway_model_generations_queued",
            "Generations waiting for a worker, by model (read from Redis at scrape).",
            ["model"],
            registry=r,
        )
        self.model_running = Gauge(
            "tokenspout_gateway_model_generations_running",
            "Generations a worker of the model has taken and not finished (at scrape).",
            ["model"],
            registry=r,
        )
        self.model_workers = Gauge(
            "tokenspout_gateway_model_workers",
            "Live engine workers of each model a worker ever registered (0: none serves it "
            "now; read at scrape).",
            ["model"],
            registry=r,
        )
        self.redis_up = Gauge(
            "tokenspout_gateway_redis_up",
            "1 when this scrape's reads from Redis answered, 0 when they failed.",
            registry=r,
        )

    # --- bookkeeping ---------------------------------------------------------------------

    def _track(self, session_id: str, generation_id: str) -> _Live:
        live = self._live.get(generation_id)
        if live is None:
            while len(self._live) >= MAX_TRACKED:
                self._forget(next(iter(self._live)))
            live = self._live[generation_id] = _Live(session_id)
            self._by_session.setdefault(session_id, set()).add(generation_id)
        return live

    def _forget(self, generation_id: str) -> _Live | None:
        live = self._live.pop(generation_id, None)
        if live is not None:
            gids = self._by_session.get(live.session_id)
            if gids is not None:
                gids.discard(generation_id)
                if not gids:
                    del self._by_session[live.session_id]
        return live

    # --- the submitter's and the admission's hooks -----------------------------------------

    def submitted(
        self, session_id: str, generation_id: str, queued_event_id: str, model: str, tenant: str
    ) -> None:
        self.generations_submitted.inc()
        self.model_submitted.labels(model).inc()
        live = self._track(session_id, generation_id)
        live.queued_ms = wire.entry_ms(queued_event_id)
        live.model, live.tenant = model, self.tenant_label(tenant)
        ids = {"session_id": session_id, "generation_id": generation_id}
        trace = tracing.current()
        if trace is not None:
            live.trace_id = trace.trace_id
            if trace.recording:
                live.exemplar = trace.trace_id
                tracing.annotate({f"tokenspout.{key}": value for key, value in ids.items()})
        # At INFO a generation is one line, at its end (``_log_end``), as in the worker.
        log.debug("generation queued", extra={**ids, "model": model})

    async def exposition(self, openmetrics: bool = False) -> bytes:
        """What ``/metrics`` answers: this process's registry, or with sibling processes
        every one's; in OpenMetrics (with exemplars) or Prometheus' text format."""
        if self.peers is not None:
            return await self.peers.exposition(openmetrics)
        if openmetrics:
            return openmetrics_exposition(self.registry)
        return generate_latest(self.registry)

    def queue_depths(self, counts: dict[str, tuple[int, int]]) -> None:
        """Set the queue gauges from ``GatewayService.queue_counts``."""
        self.queued.set(sum(queued for queued, _ in counts.values()))
        self.running.set(sum(running for _, running in counts.values()))
        for model, (queued, running) in counts.items():
            self.model_queued.labels(model).set(queued)
            self.model_running.labels(model).set(running)

    def workers(self, by_model: dict[str, int]) -> None:
        """Set ``model_workers`` from the live workers per model."""
        for model, count in by_model.items():
            self.model_workers.labels(model).set(count)

    def cancel_sent(self, session_id: str, generation_id: str, began: float) -> None:
        self._track(session_id, generation_id).cancel_began = began
        tracing.event("cancel", {"tokenspout.generation_id": generation_id})
        log.info(
            "cancel sent",
            extra={"session_id": session_id, "generation_id": generation_id},
        )

    def cancel_stopped(self, generation_id: str, seconds: float) -> None:
        self.cancel_to_stop.observe(seconds)
        self._forget(generation_id)

    # --- RelayHub hooks ------------------------------------------------------------------

    def event(self, session_id: str, event: RelayEvent) -> None:
        kind = event.type
        if kind in TERMINAL_EVENTS:
            self.generations_ended.labels(kind).inc()
            live = self._forget(event.generation_id)
            if live is not None and live.cancel_began is not None:
                self.cancel_to_stop.observe(time.monotonic() - live.cancel_began)
            if log.isEnabledFor(logging.INFO):
                self._log_end(session_id, event, live)
            return
        live = self._track(session_id, event.generation_id)
        if kind == "token":
            now = time.monotonic()
            gaps = live.gaps
            if gaps is not None and live.last_token_at is not None:
                if live.exemplar:
                    gaps.observe_traced(now - live.last_token_at, live.exemplar)
                else:
                    gaps.observe(now - live.last_token_at)
            else:
                self._first_token(live)
            live.last_token_at = now
            live.started = True
        elif kind == "queued":
            live.queued_ms = wire.entry_ms(event.id)
        elif kind == "started":
            self._started(live, event)

    def _exemplar(self, live: _Live) -> dict[str, str] | None:
        return {"trace_id": live.exemplar} if live.exemplar else None

    def _started(self, live: _Live, event: RelayEvent) -> None:
        live.started = True
        if live.model == UNKNOWN:  # queued elsewhere: its model is in the event
            started = wire.decode_event(event.data)
            if isinstance(started, Started):
                live.model = started.model
        if live.queued_ms is not None:
            waited = max(0.0, time.time() - live.queued_ms / 1000)
            child = self.queue_wait.labels(live.model, live.tenant)
            child.observe(waited, self._exemplar(live))

    def _first_token(self, live: _Live) -> None:
        live.gaps = self.inter_token.labels(live.model, live.tenant)
        if live.queued_ms is not None:
            live.first_token_s = max(0.0, time.time() - live.queued_ms / 1000)
            child = self.time_to_first_token.labels(live.model, live.tenant)
            child.observe(live.first_token_s, self._exemplar(live))

    def _log_end(self, session_id: str, event: RelayEvent, live: _Live | None) -> None:
        """The generation's one line at its end, for a log store to query."""
        final = wire.decode_final(event.data)
        extra: dict[str, object] = {
            "session_id": session_id,
            "generation_id": event.generation_id,
            "state": wire.final_state(final),
            "reason": wire.final_reason(final),
        }
        if final.usage is not None:
            extra["prompt_tokens"] = final.usage.prompt_tokens
            extra["completion_tokens"] = final.usage.completion_tokens
        if live is not None:
            extra |= {"model": live.model, "tenant": live.tenant}
            if live.trace_id:
                extra["trace_id"] = live.trace_id
            if live.first_token_s is not None:
                extra["ttft_ms"] = round(live.first_token_s * 1000, 1)
            if live.queued_ms is not None:
                extra["duration_ms"] = round(time.time() * 1000 - live.queued_ms, 1)
        log.info("generation ended", extra=extra)

    def unwatched(self, session_id: str) -> None:
        for generation_id in list(self._by_session.get(session_id, ())):
            live = self._forget(generation_id)
            if live is not None and live.started and live.cancel_began is None:
                self.abandoned.inc()
                log.info(
                    "last reader left a running generation",
                    extra={"session_id": session_id, "generation_id": generation_id},
                )

    def admitted(self, key: str) -> None:
        self.key_requests.labels(key).inc()

    def refused(self, key: str, limit: str) -> None:
        self.key_refusals.labels(key, limit).inc()

    def redis_error(self, where: str) -> None:
        self.redis_errors.labels(where).inc()

    def fell_behind(self) -> None:
        self.fell_behind_feeds.inc()
