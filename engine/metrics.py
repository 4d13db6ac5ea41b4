"""Prometheus metrics of an engine worker (served at ``/metrics`` by ``engine.__main__``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ENGINE_BUCKETS = (0.001, 0.0025, *_LATENCY_BUCKETS)


class PlainCounter(Collector):
    """A counter added to once per engine step and request: a plain int, no lock (the
    worker counts from its event loop's thread only). ``Counter.inc`` takes a lock each
    time: 4.5 % of the worker's busy samples at 500 streams."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.value = 0
        registry.register(self)

    def inc(self, amount: int) -> None:
        self.value += amount

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, value=self.value)


class PrefillCounts(Protocol):
    """What an engine counts of its prefills (``engine.backends.base.PrefillCounts``)."""

    prompt_tokens: int
    cached_tokens: int


class PrefillCollector(Collector):
    """The engine's own count of the prompt tokens it prefilled and of those its prefix cache
    held, by model, read from the backend at each scrape (``Backend.prefilled``)."""

    def __init__(self, model: str, counts: PrefillCounts, registry: CollectorRegistry) -> None:
        self.model = model
        self.counts = counts
        registry.register(self)

    def collect(self) -> Iterator[CounterMetricFamily]:
        prompt = CounterMetricFamily(
            "tokenspout_engine_prompt_tokens",
            "Prompt tokens of the requests the engine prefilled, in its own count.",
            labels=["model"],
        )
        prompt.add_metric([self.model], self.counts.prompt_tokens)
        cached = CounterMetricFamily(
            "tokenspout_engine_prompt_cached_tokens",
            "Of those prompt tokens, the ones the engine's prefix cache held (not computed"
            " again; vLLM's num_cached_tokens).",
            labels=["model"],
        )
        cached.add_metric([self.model], self.counts.cached_tokens)
        yield prompt
        yield cached


TENANT_LABELS = 100
"""Tenants with a label of their own in ``tenant_tokens``; the rest count as ``other``."""


class TenantLabels:
    """A tenant's label: its id for the first ``TENANT_LABELS`` tenants this worker bills,
    ``other`` after them, so the metric's series stay bounded however many keys there are."""

    def __init__(self, limit: int = TENANT_LABELS) -> None:
        self.limit = limit
        self.seen: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self.seen:
            return tenant
        if len(self.seen) >= self.limit:
            return "other"
        self.seen.add(tenant)
        return tenant


def _tenant_tokens(registry: CollectorRegistry) -> Counter:
    return Counter(
        "tokenspout_engine_tenant_tokens",
        "Tokens billed to a tenant by the generations this worker ended (kind: prompt or"
        " completion; tenant: its id, the first 100 tenants, then 'other').",
        ["tenant", "kind"],
        registry=registry,
    )


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._count_generations(self.registry)
        self._time_generations(self.registry)
        self._gauge_the_worker(self.registry)

    def _count_generations(self, r: CollectorRegistry) -> None:
        self.tokens = PlainCounter("tokenspout_engine_tokens", "Tokens published.", r)
        self.generations = Counter(
            "tokenspout_engine_generations",
            "Generations ended, by final state.",
            ["state"],
            registry=r,
        )
        self.cancels = Counter(
            "tokenspout_engine_cancels",
            "Generations cancelled, by reason.",
            ["reason"],
            registry=r,
        )
        self.tokens_after_cancel = Counter(
            "tokenspout_engine_tokens_after_cancel",
            "Tokens the engine produced after a cancel was received (never delivered).",
            registry=r,
        )
        self.tokens_joined = Counter(
            "tokenspout_engine_tokens_joined",
            "Tokens written in the event of the token before them: Redis was a step or more "
            "behind (engine/publisher.py).",
            registry=r,
        )
        self.takeovers = Counter(
            "tokenspout_engine_takeovers",
            "Generations this worker continued after another worker was lost or stopped.",
            registry=r,
        )
        self.affinity = Counter(
            "tokenspout_engine_affinity",
            "Requests taken that named a prefix a worker with a free slot held (docs/"
            "affinity.md), by outcome: hit (this worker held it), miss (taken here after "
            "the wait for affinity).",
            ["outcome"],
            registry=r,
        )
        self.affinity_wait = Histogram(
            "tokenspout_engine_affinity_wait_seconds",
            "How long a request taken by its prefix (docs/affinity.md) was queued, by "
            "outcome: hit (it waited for this worker, its holder), miss (its holders never "
            "came within its wait).",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.handovers = Counter(
            "tokenspout_engine_handovers",
            "Running generations this worker handed to the others on SIGTERM.",
            registry=r,
        )
        self.preemptions = Counter(
            "tokenspout_engine_preemptions",
            "Replies this worker stopped, to go on at the next free slot, for a tenant "
            "served less (--preempt).",
            registry=r,
        )

    def _time_generations(self, r: CollectorRegistry) -> None:
        labels = ["model", "tenant"]
        self.queue_wait = Histogram(
            "tokenspout_engine_queue_wait_seconds",
            "Time from enqueue to start, by model and tenant (the first 100, then 'other'); "
            "a recorded request's trace id as exemplar.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "tokenspout_engine_time_to_first_token_seconds",
            "Time from enqueue to the first token published, by model and tenant; a recorded "
            "request's trace id as exemplar.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_first_token = Histogram(
            "tokenspout_engine_own_time_to_first_token_seconds",
            "The engine's own part of the first token: preparing the request (chat template,"
            " tokenisation) and the engine's first step; no queue, no claim, no Redis.",
            buckets=_ENGINE_BUCKETS,
            registry=r,
        )
        self.cancel_to_final = Histogram(
            "tokenspout_engine_cancel_to_final_seconds",
            "Time from a cancel reaching the worker to its final event being queued.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _gauge_the_worker(self, r: CollectorRegistry) -> None:
        self.engine_running = Gauge(
            "tokenspout_engine_running",
            "Requests the inference engine holds unfinished.",
            registry=r,
        )
        self.generations_running = Gauge(
            "tokenspout_engine_generations_running",
            "Generations this worker has taken and not finished.",
            registry=r,
        )
        self.prefill_rate = Gauge(
            "tokenspout_engine_prefill_tokens_per_second",
            "The engine's prefill rate as this worker measures it (uncached prompt tokens "
            "over the time to a run's first output, a recent mean): what a request's wait "
            "for affinity is bounded by (docs/affinity.md); 0 until measured.",
            registry=r,
        )
        self.capacity = Gauge(
            "tokenspout_engine_capacity",
            "Generations this worker runs at once, at most.",
            registry=r,
        )
        self.draining = Gauge(
            "tokenspout_engine_draining",
            "1 while the worker drains after SIGTERM (takes no new work), else 0.",
            registry=r,
        )
        self.redis_errors = Counter(
            "tokenspout_engine_redis_errors",
            "Redis failures, by the loop they happened in.",
            ["where"],
            registry=r,
        )
        self.tenant_tokens, self.tenant_label = _tenant_tokens(r), TenantLabels()
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}

    def watch_prefill(self, model: str, counts: PrefillCounts) -> None:
        """Export what the engine serving ``model`` counts of its prefills (``counts``)."""
        PrefillCollector(model, counts, self.registry)

    def child(self, metric: Counter | Gauge | Histogram, *values: str) -> Any:
        """``metric.labels(*values)``, looked up once: prometheus_client checks the values
        and takes a lock at every ``labels`` call (about 2.5 us, several a request). The
        values are bounded (models, states, outcomes, ``tenant_label``'s tenants)."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def billed(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A generation this worker ended billed its tenant these tokens."""
        label = self.tenant_label(tenant or "anonymous")
        if prompt_tokens:
            self.child(self.tenant_tokens, label, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self.child(self.tenant_tokens, label, "completion").inc(completion_tokens)

    def started(self, waited_s: float, model: str, tenant: str, trace_id: str) -> None:
        """A reply started ``waited_s`` after the gateway queued it (``trace_id``: its
        recorded trace, or "")."""
        labels = self.child(self.queue_wait, model, self.tenant_label(tenant or "anonymous"))
        labels.observe(max(0.0, waited_s), {"trace_id": trace_id} if trace_id else None)

    def first_token(
        self, since_enqueued: float, engine_s: float, model: str, tenant: str, trace_id: str
    ) -> None:
        """A reply's first token is out: ``since_enqueued`` after the gateway queued it,
        ``engine_s`` of it the engine's own (``engine_first_token``)."""
        tenant_label = self.tenant_label(tenant or "anonymous")
        labels = self.child(self.time_to_first_token, model, tenant_label)
        labels.observe(max(0.0, since_enqueued), {"trace_id": trace_id} if trace_id else None)
        self.engine_first_token.observe(engine_s)
