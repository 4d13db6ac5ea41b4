"""What the job table (engine/jobs.py) asks and does not decide itself: which queued
requests this worker takes, and whether a reply here gives way to a waiting one.

Each is a policy the table holds and asks at one place: ``TakePolicy.take`` when slots are
free, ``PreemptPolicy.owed`` when a reply may give way. The table makes every move that
follows (start a job, stop one, keep its continuation); a policy only answers.

- ``QueueOrder``: take what the model's queue gives, in its order (the stream's entries
  first: work admitted before; then the tenants' by their share of tokens: VTC,
  docs/tenants.md), telling it what this worker served since.
- ``CacheAffinity`` (the default; ``TOKENSPOUT_AFFINITY_WAIT_MS=0`` turns it off): the
  queue's order, but a request whose prompt begins with a prefix this worker's engine
  holds is taken here first, and one another worker holds is left to it for at most the
  wait, and no longer than this worker's engine would take to prefill that prefix
  (``PrefillRate``); each reply's final event says which prefixes its engine now holds
  (docs/affinity.md).
- ``FairPreemption`` (``python -m engine --preempt``): the queue's rule
  (wire/lua/fair_preempt.lua): the tenant of a reply that may give way that was served
  most lately must have been served more than its share, and a waiting tenant (the least
  served first) less than half as much; then that tenant's request is taken for it.

With every slot busy, a request waits for a slot to free whatever order the fair queue
gives it: hundreds of milliseconds for a quiet key behind a noisy one's replies
(docs/tenants.md, "What the fairness bench shows"). So while every slot is busy the table
waits on ``PreemptPolicy.due`` (the queue's newcomer bell, rung when a tenant that had
nothing waiting queues a request, or, while tenants wait in lists, ``RECHECK_MS``: a request
may become owed after it came) and asks again. While no tenant waits it asks only at a
ring: its looks cost nothing then. One full worker acts per ring (BLPOP hands it to one; a
ring it owed nothing for is rung again, once, for another); nothing is stopped while work
admitted before (a takeover, a request given back) waits in the queue's stream. A
preempting worker offers new requests no free slots (``RequestQueue(offers_free=False)``),
so every new request waits in a list, where it chooses from (its free slots still count for
cache affinity).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from engine.metrics import WorkerMetrics
from wire import GenerationRequest, prefixes
from wire.queue import RequestQueue, ServedTokens
from wire.replies import StreamEntry
from wire.scripts import AffinityWait

RECHECK_MS = 20
"""While every slot is busy, a look at the queue at least this often besides each ring: a
request whose tenant was not owed a slot when it came (what the running tenants were served
reaches the queue with the worker's next charge, once a second) may be owed one later."""
IDLE_WAIT_MS = 1000
"""While no tenant waits, the longest wait for a newcomer's ring before the next."""
AFFINITY_WAIT_MS = 100
"""The most a request whose prefix another worker holds (with a free slot) waits for it
before any worker takes it (``TOKENSPOUT_AFFINITY_WAIT_MS``; 0: no affinity): a prefill of
the thousands of tokens a conversation's history holds costs more on a GPU. A shorter prefix
waits less: no longer than the taker would take to prefill it."""
PREFILL_SAMPLE_TOKENS = 64
"""A run's prefill is measured when it computed at least this many prompt tokens: a shorter
one's time is mostly the engine's step, not its prefill."""
TAKE_BLOCK_MS = 1000
"""How long a take waits for the queue's bell when nothing waits."""
HELD_RETOLD_S = 60.0
"""A prefix this worker said it holds within this long is not said again: its holders live
``HELD_TTL_S`` (300 s) after the last saying, so a prefix served over and over (a shared
system prompt) costs Redis one saying a minute, not one a reply."""
TOLD_MOST = 100_000
"""The most prefixes remembered as told (the oldest forgotten first: told again)."""


class TakePolicy(Protocol):
    """Which queued requests this worker takes."""

    async def take(self, free: int) -> list[StreamEntry]:
        """Up to ``free`` requests, taken for this worker (none: nothing came meanwhile)."""
        ...

    def held(self, request: GenerationRequest, reply: str) -> Sequence[str]:
        """The prefixes ``request``, run here with ``reply``, left in this worker's engine
        that its final event says it holds (none: nobody asks)."""
        ...

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A run here computed ``tokens`` prompt tokens (those its cache did not hold) in
        ``seconds`` before its first output."""
        ...


class PreemptPolicy(Protocol):
    """Whether a reply here gives way to a request waiting in the queue."""

    async def due(self) -> bool:
        """Until it may be worth asking again (every slot busy); False: nothing came that
        could make anyone owed."""
        ...

    @property
    def anyone_waits(self) -> bool:
        """Whether the last take or look left a request waiting that could be owed."""
        ...

    async def owed(
        self, yielding: Sequence[str], others: Sequence[str]
    ) -> tuple[str, StreamEntry] | None:
        """For replies of the tenants ``yielding`` (one name per reply) that may give way,
        beside replies of ``others``: the tenant (its slot) that gives way and the waiting
        request taken for this worker in its place; None when nobody is owed."""
        ...


class QueueOrder:
    """Take in the queue's own order, telling it what this worker served."""

    def __init__(self, queue: RequestQueue, worker_id: str, served: ServedTokens) -> None:
        self.queue = queue
        self.worker_id = worker_id
        self.served = served

    async def take(self, free: int) -> list[StreamEntry]:
        return await self.queue.take(self.worker_id, free, TAKE_BLOCK_MS, self.served)

    def held(self, request: GenerationRequest, reply: str) -> Sequence[str]:
        return ()

    def prefilled(self, tokens: int, seconds: float) -> None:
        return None


class PrefillRate:
    """An engine's prefill rate as its runs show it: a run's uncached prompt tokens over its
    time to first output, a recent mean. Under load a run's first output also waits for the
    other runs' steps: the rate reads low, and a wait bounded by it errs long (never past its
    own bound)."""

    WEIGHT = 0.2
    """Of each new run in the mean (about the last ten runs count)."""

    def __init__(self) -> None:
        self.tokens_per_s = 0.0
        """0 until a run was measured."""

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < PREFILL_SAMPLE_TOKENS or seconds <= 0:
            return
        rate = tokens / seconds
        mean = self.tokens_per_s
        self.tokens_per_s = rate if mean == 0 else mean + self.WEIGHT * (rate - mean)


class CacheAffinity(QueueOrder):
    """The queue's order, its requests whose prefix this worker's engine holds first."""

    def __init__(
        self,
        queue: RequestQueue,
        worker_id: str,
        served: ServedTokens,
        *,
        wait_ms: int,
        metrics: WorkerMetrics,
    ) -> None:
        super().__init__(queue, worker_id, served)
        self.wait_ms = wait_ms
        """The most a request another worker holds waits for it before this one takes it."""
        self.metrics = metrics
        self.prefill = PrefillRate()
        self.told = ToldNames()
        metrics.prefill_rate.set_function(lambda: self.prefill.tokens_per_s)

    async def take(self, free: int) -> list[StreamEntry]:
        wait = AffinityWait(self.wait_ms, self.prefill.tokens_per_s)
        taken = await self.queue.take(
            self.worker_id, free, TAKE_BLOCK_MS, self.served, affinity=wait
        )
        for _, fields in taken:
            if outcome := fields.get(b"a"):
                label = outcome.decode()
                self.metrics.child(self.metrics.affinity, label).inc()
                waited_s = int(fields[b"w"]) / 1000
                self.metrics.child(self.metrics.affinity_wait, label).observe(waited_s)
        return taken

    def held(self, request: GenerationRequest, reply: str) -> Sequence[str]:
        return self.told.due(prefixes.held(self.queue.model, request, reply), time.monotonic())

    def prefilled(self, tokens: int, seconds: float) -> None:
        self.prefill.observe(tokens, seconds)


class ToldNames:
    """The prefixes this worker said it holds lately, and when: only those not said within
    ``HELD_RETOLD_S`` are said again. Names told with a write Redis then lost (a restart
    with no data) are told again at the latest that long after: until then a next turn
    may lose its affinity (a prefill), never a word."""

    def __init__(self, most: int = TOLD_MOST) -> None:
        self.most = most
        self._told: dict[str, float] = {}
        """Name -> when it was last told (monotonic s), the oldest first."""

    def due(self, names: Sequence[str], now: float) -> list[str]:
        """Of ``names``, those to tell now (taken as told at ``now``)."""
        due = []
        for name in names:
            told = self._told.get(name)
            if told is None or now - told >= HELD_RETOLD_S:
                due.append(name)
                self._told.pop(name, None)
                self._told[name] = now
        while len(self._told) > self.most:
            del self._told[next(iter(self._told))]
        return due


class FairPreemption:
    """The queue's rule of who is owed a slot (wire/lua/fair_preempt.lua), asked here only."""

    def __init__(self, queue: RequestQueue, worker_id: str) -> None:
        self.queue = queue
        self.worker_id = worker_id
        self._rung = False
        """The last wait ended at a ring while no tenant waited: a look that owes it
        nothing rings again, for another full worker."""

    @property
    def anyone_waits(self) -> bool:
        return self.queue.tenants_wait

    async def due(self) -> bool:
        if self.queue.tenants_wait:
            await self.queue.newcomer(RECHECK_MS)
            return True
        self._rung = await self.queue.newcomer(IDLE_WAIT_MS)
        return self._rung

    async def owed(
        self, yielding: Sequence[str], others: Sequence[str]
    ) -> tuple[str, StreamEntry] | None:
        found = await self.queue.preempt_for(self.worker_id, yielding, others)
        if found is None and self._rung and self.queue.tenants_wait:
            await self.queue.ring_newcomer()
        self._rung = False
        return found
