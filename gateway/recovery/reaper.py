"""Background duties of every gateway process.

- ``Reaper``: one gateway at a time (a Redis lock) makes sure no client waits forever, in
  every model's queue (each model registered in ``Keys.models``).
  - A lost worker (its lease connection closed, or no heartbeat for
    ``TOKENSPOUT_WORKER_TIMEOUT_S``) leaves requests in the consumer group's pending list:
    a request that never started goes back on the queue for a surviving worker; one that
    was running is taken over (gateway/recovery/takeover.py): it goes back on the queue with what
    it streamed, and another worker continues the reply. Checked every ``REAP_PASS_S``.
  - A request no worker takes within ``TOKENSPOUT_QUEUE_TIMEOUT_S`` (none alive, or all
    busy) ends with an ``error`` event (``queue_timeout``); a worker that dequeues it later
    finds it final and skips it.
  - A session turn whose gateway died between writing it and queueing its request (the
    two round trips of a submit) is queued ``STRANDED_AFTER_S`` after
    (gateway/recovery/stranded.py).
  Each duty survives any failure of one pass (logged): a bad entry in the requests stream
  must not stop the reaper for the life of the process.
- ``ReaderDeadline`` (gateway/recovery/reader_deadline.py): every gateway process also
  looks after the generations its own readers saw queued and never saw start.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from redis.exceptions import RedisError

import wire
from gateway.core import tracing
from gateway.core.settings import Settings
from gateway.recovery.admissions import UnsubmittedAdmissions
from gateway.recovery.stranded import STRANDED_AFTER_S, StrandedTurns
from gateway.recovery.takeover import REAPER_PREFIX, LostRequests, live_workers
from wire import Error, GenerationRequest, entry_id_key
from wire.generations import Generations
from wire.queue import QueueLook, RequestQueue, look_at
from wire.scripts import HoldReaperLock

log = logging.getLogger("tokenspout.watchdog")
_request_decoder = msgspec.json.Decoder(GenerationRequest)


QUEUE_SCAN_PAGE = 200
QUEUE_SCAN_MAX = 2_000
"""Queued requests the queue deadline looks at per pass (the oldest first)."""
REAP_PASS_S = 0.1
"""How often the reaper looks for lost workers: a killed worker's reply goes on in another
within about this long (plus the new worker's prefill)."""
LOCK_MS = 2_000
FAILURE_LOG_EVERY_S = 10.0
"""A duty that keeps failing the same way is logged once per this long, not every pass."""
STALE_CLAIM_MS = 5_000
"""An entry a reaper claimed and has not handed on for this long: that reaper stopped."""
QUIET_OUTCOMES = {
    "final": "it ended already, or Redis holds no such generation",
    "moved": "another worker runs it now",
}
"""Outcomes of a hand-on that hand nothing on: the request is acknowledged all the same."""


def queue_timeout(generation_id: str, timeout_s: float) -> Error:
    """The final event of a generation no worker took within the queue deadline."""
    return Error(
        generation_id,
        "queue_timeout",
        f"no engine worker took this generation within {timeout_s:g} s",
    )


def decode_request(entry_id: bytes | str, fields: dict[bytes, bytes]) -> GenerationRequest | None:
    """The request of a ``requests`` entry, or None (logged) for one nobody can read."""
    try:
        return _request_decoder.decode(fields[b"r"])
    except (KeyError, msgspec.DecodeError) as exc:
        log.error("unreadable entry %s in the requests stream: %r", wire.text(entry_id), exc)
        return None


class RepeatedFailures:
    """The reaper's failures, logged without a flood: a duty's first failure, then that
    duty's failures at most once per ``every_s`` (with how many went unlogged), and one
    line once it works again: with Redis away, a pass every ``REAP_PASS_S`` would log ten
    warnings a second per gateway process."""

    def __init__(self, every_s: float = FAILURE_LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._failing: dict[str, tuple[float, int]] = {}
        """A failing duty -> when it was last logged, and its failures since."""

    def failed(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        last = self._failing.get(what)
        if last is None or now - last[0] >= self.every_s:
            more = f" ({last[1]} more like it unlogged)" if last is not None and last[1] else ""
            log.warning("reaper: %s failed: %s%s", what, exc, more)
            self._failing[what] = (now, 0)
        else:
            self._failing[what] = (last[0], last[1] + 1)

    def worked(self, what: str) -> None:
        if self._failing and self._failing.pop(what, None) is not None:
            log.info("reaper: %s works again", what)


class Reaper:
    def __init__(
        self,
        generations: Generations,
        settings: Settings,
        *,
        stranded: StrandedTurns | None = None,
        admissions: UnsubmittedAdmissions | None = None,
    ) -> None:
        """``generations``: the transitions it makes (its Redis, keys, events' cap and TTL);
        ``settings``: the worker timeout, the queue deadline, the takeovers allowed, the
        default model. ``stranded``, ``admissions``: those duties (None: not this one's)."""
        self.redis, self.keys = generations.redis, generations.keys
        self.generations = generations
        self.stranded = stranded
        """Queues the session turns stranded on their way to a queue."""
        self.admissions = admissions
        """Gives back what limited keys admitted for generations never submitted."""
        self.default_model = settings.default_model
        """Queued for before any worker of it registered (TOKENSPOUT_DEFAULT_MODEL), so its
        queue needs the deadline too."""
        self.worker_timeout_s = settings.worker_timeout_s
        self.queue_timeout_s = settings.queue_timeout_s
        self._hold_lock = HoldReaperLock(self.redis, self.keys)
        self._owner = f"{REAPER_PREFIX}{time.monotonic_ns()}"
        self.lost = LostRequests(
            generations,
            max_takeovers=settings.max_takeovers,
            requests_maxlen=settings.requests_maxlen,
        )
        self._expired_through: dict[str, str] = {}
        """Queue -> every queued entry up to this id has been looked at by the deadline."""
        self.failures = RepeatedFailures()

    async def run_forever(self, interval_s: float = REAP_PASS_S) -> None:
        while True:
            await self.pass_once()
            await asyncio.sleep(interval_s)

    async def pass_once(self) -> None:
        """The lock (taken or kept); then one look at every queue (one round trip for
        all); then each duty on the queues where it has something to do. At rest a pass
        is 3 round trips: the lock, the model list, and one look at every queue."""
        if not await self._guarded("acquiring the reaper lock", self._acquire):
            return
        looks = await self._guarded("looking at the queues", self._look)
        if not isinstance(looks, list):
            return
        for duty, queues in (
            (self.reap_once, [queue for queue, look in looks if look.pending]),
            (self.expire_queued, [queue for queue, look in looks if look.waiting]),
            (self.expire_waiting, [queue for queue, look in looks if look.waiting_fair]),
            (self.queue_stranded, [queue for queue, look in looks if look.noted]),
        ):
            await self._guarded(duty.__name__, functools.partial(duty, queues))
        if self.admissions is not None and self.admissions.due():
            await self._guarded("giving back admissions never submitted", self.admissions.look)

    async def _look(self) -> list[tuple[RequestQueue, QueueLook]]:
        queues = await self._queues()
        looks = await look_at(self.redis, queues, time.time() - STRANDED_AFTER_S)
        return list(zip(queues, looks, strict=True))

    async def _guarded(self, what: str, duty: Callable[[], Awaitable[object]]) -> object:
        """Run one duty; log whatever it raises (the next pass tries again)."""
        try:
            done = await duty()
        except (RedisError, OSError) as exc:
            self.failures.failed(what, exc)
        except Exception:
            log.exception("reaper: %s failed; the next pass tries again", what)
        else:
            self.failures.worked(what)
            return done
        return None

    async def _acquire(self) -> bool:
        return await self._hold_lock(owner=self._owner, ttl_ms=LOCK_MS)

    async def _queues(self) -> list[RequestQueue]:
        """Every registered model's queue, and the default model's."""
        models = {wire.text(model) for model in await self.redis.hvals(self.keys.models)}
        models |= {self.default_model} if self.default_model else set()
        return [RequestQueue(self.redis, self.keys, model) for model in sorted(models)]

    async def _each_queue(
        self,
        what: str,
        duty: Callable[[RequestQueue], Awaitable[int]],
        queues: list[RequestQueue],
    ) -> int:
        """``duty`` on each queue; one queue's failure (logged) does not skip the others."""
        done = 0
        for queue in queues:
            result = await self._guarded(f"{what} {queue.key}", functools.partial(duty, queue))
            done += result if isinstance(result, int) else 0
        return done

    # --- dead workers --------------------------------------------------------------------

    async def reap_once(self, queues: list[RequestQueue]) -> int:
        """Hand on the pending requests of lost workers in ``queues``; returns how many."""
        return await self._each_queue("reaping", self._reap_queue, queues)

    async def _reap_queue(self, queue: RequestQueue) -> int:
        consumers = await queue.pending_consumers()
        if not consumers:
            return 0
        alive = await live_workers(self.redis, self.keys, consumers, self.worker_timeout_s)
        handled = 0
        for consumer in consumers:
            if consumer == self._owner:
                # What this reaper claimed and could not hand on: Redis refused a write
                # after its TAKEOVER (at its maxmemory, say). It is done again now, not
                # left for another gateway's reaper to find ``STALE_CLAIM_MS`` later.
                pending = await queue.pending_of(consumer)
            elif consumer in alive:
                continue
            else:
                stale = STALE_CLAIM_MS if consumer.startswith(REAPER_PREFIX) else None
                pending = await queue.pending_of(consumer, stale)
                # Judged again after reading what it holds, so the verdict is younger than
                # every entry it hands on: this pass may have waited out a Redis write
                # pause while the worker heartbeat and read new work, none of it lost.
                if pending and await live_workers(
                    self.redis, self.keys, [consumer], self.worker_timeout_s
                ):
                    continue
            for message_id, idle in pending:
                # Claimed only if still idle as long as seen: an entry another reaper
                # claimed meanwhile (its idle time reset) is left to that one.
                await self._take_over(queue, message_id, consumer, idle)
            handled += len(pending)
        return handled

    async def _take_over(
        self, queue: RequestQueue, message_id: str, consumer: str, idle_ms: int
    ) -> None:
        for entry_id, fields in await queue.claim(self._owner, idle_ms, message_id):
            request = decode_request(entry_id, fields) if fields else None
            if request is not None:  # else trimmed away meanwhile, or unreadable: drop it
                began = time.time_ns()
                done = await self.lost.hand_on(queue, request, fields[b"r"], consumer)
                lost = {"tokenspout.outcome": done, "tokenspout.from_worker": consumer}
                tracing.detached_span(request.traceparent, "tokenspout.takeover", lost, began)
                if done in QUIET_OUTCOMES:
                    log.info(
                        "%s, pending for %s: nothing to hand on (%s)",
                        request.generation_id,
                        consumer,
                        QUIET_OUTCOMES[done],
                    )
            else:
                log.warning(
                    "dropping request %s pending for %s: trimmed away or unreadable",
                    wire.text(entry_id),
                    consumer,
                )
            await queue.ack(entry_id)
        await queue.forget_consumer(self._owner)

    # --- session turns stranded on their way to a queue ------------------------------------

    async def queue_stranded(self, queues: list[RequestQueue]) -> int:
        """Queue the session turns whose gateway died between writing them and queueing
        their requests, in ``queues``; returns how many."""
        if self.stranded is None:
            return 0
        stranded = functools.partial(self.stranded.queue_stranded, older_than_s=STRANDED_AFTER_S)
        return await self._each_queue("queueing stranded turns of", stranded, queues)

    # --- the queue deadline --------------------------------------------------------------

    async def expire_queued(self, queues: list[RequestQueue]) -> int:
        """End the requests no worker took within the queue deadline in ``queues``;
        returns how many."""
        return await self._each_queue("expiring queued requests in", self._expire_queue, queues)

    async def _expire_queue(self, queue: RequestQueue) -> int:
        """Looks at the entries after the consumer group's last-delivered id (none
        delivered: the whole stream), oldest first, and stops at the first one in time;
        at none when no request waits."""
        start = await queue.waiting_after()
        if start is None:
            return 0
        through = self._expired_through.get(queue.key)
        if through is not None and (start == "" or entry_id_key(through) > entry_id_key(start)):
            start = through
        deadline = time.time() - self.queue_timeout_s
        ended = scanned = 0
        in_time = False
        while not in_time and scanned < QUEUE_SCAN_MAX:
            page = await queue.read_after(start, QUEUE_SCAN_PAGE)
            expired: list[GenerationRequest] = []
            for entry_id, fields in page:
                request = decode_request(entry_id, fields)
                added_s = wire.entry_ms(wire.text(entry_id)) / 1000
                if added_s > deadline or (request is not None and request.enqueued_at > deadline):
                    in_time = True
                    break
                if request is not None:
                    expired.append(request)
                start = wire.text(entry_id)
            ended += await self._end_expired(expired)
            if start:
                self._expired_through[queue.key] = start
            scanned += len(page)
            if len(page) < QUEUE_SCAN_PAGE:
                break
        return ended

    async def expire_waiting(self, queues: list[RequestQueue]) -> int:
        """End the requests of the tenants' lists in ``queues`` that waited past the queue
        deadline; returns how many."""
        return await self._each_queue("expiring waiting requests in", self._expire_fair, queues)

    async def _expire_fair(self, queue: RequestQueue) -> int:
        deadline = time.time() - self.queue_timeout_s
        taken_out = await queue.expire_waiting(deadline, QUEUE_SCAN_MAX)
        expired = [decode_request(b"waiting", {b"r": raw}) for raw in taken_out]
        return await self._end_expired([request for request in expired if request is not None])

    async def _end_expired(self, requests: list[GenerationRequest]) -> int:
        ends = [
            (r.session_id, queue_timeout(r.generation_id, self.queue_timeout_s)) for r in requests
        ]
        ended = sum(await self.generations.end_queued(ends))
        if ended:
            log.warning("%d queued generations timed out: no engine worker took them", ended)
        return ended
