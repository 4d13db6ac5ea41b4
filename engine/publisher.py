"""Writes session events to Redis: everything one engine step produced, in one pipeline.

Each event goes through the EMIT script (``wire.scripts.Emit``: append to the session
stream, publish on the live channel, refuse anything after a generation's final event).
Events are written in the order they were emitted; while Redis is unreachable they wait and
are retried, so a short Redis restart delays tokens instead of losing them. Each event
carries its number within its generation, so a retried pipeline never writes an event twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

import wire
from wire import Keys, SessionEvent
from wire.queue import RequestQueue
from wire.scripts import Emit

log = logging.getLogger("tokenspout.publisher")


@dataclass(frozen=True)
class _Pending:
    session_id: str
    event: SessionEvent
    final: bool
    worker: str
    assistant: wire.ChatMessage | None
    ttl_s: int
    maxlen: int
    ack: bytes | None
    seq: int
    epoch: int
    done: asyncio.Future[str | None]


class Publisher:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        queue: RequestQueue,
        on_rejected: Callable[[str, int], None],
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.queue = queue
        """The queue final events acknowledge their request in (the worker's model's)."""
        self.on_rejected = on_rejected
        """Called with a generation id and the writer's epoch whose event Redis refused
        (the generation ended, or another writer owns it now)."""
        self._emit = Emit(redis, keys)
        self._queue: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self.pipelines = 0
        self.events = 0

    def emit(
        self,
        session_id: str,
        event: SessionEvent,
        *,
        ttl_s: int,
        maxlen: int,
        final: bool = False,
        worker: str = "",
        assistant: wire.ChatMessage | None = None,
        ack: bytes | None = None,
        seq: int = 0,
        epoch: int = 0,
    ) -> asyncio.Future[str | None]:
        """Queue an event; the future resolves to its stream id, or None if refused.

        ``seq``: this event's number within its generation (1, 2, 3...; 0: none). Redis
        writes an event once whatever the retries: a pipeline resent after a connection
        loss mid-way finds the events it already wrote and skips them.

        ``worker``: the writer; Redis refuses its event unless it owns the generation (a
        ``started`` or ``resumed`` event claims it with the request of epoch ``epoch``).

        ``ack``: the request's entry id, acknowledged right after the final event in the
        same round trip, so "in flight" (gateway/generations.py) drops the moment it ends.
        """
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._queue.append(
            _Pending(
                session_id,
                event,
                final,
                worker,
                assistant,
                ttl_s,
                maxlen,
                ack,
                seq,
                epoch,
                future,
            )
        )
        self._wakeup.set()
        return future

    async def run_forever(self) -> None:
        backoff = 0.05
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await asyncio.sleep(0)  # let every request of this engine step add its delta
            batch = self._queue
            self._queue = []
            while True:
                try:
                    results = await self._write(batch)
                    backoff = 0.05
                    break
                except (RedisError, OSError) as exc:
                    log.warning("publishing %d events failed (%s); retrying", len(batch), exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
            for pending, result in zip(batch, results, strict=True):
                stream_id = Emit.reply(result)
                if stream_id is None and not pending.final:
                    self.on_rejected(pending.event.generation_id, pending.epoch)
                if not pending.done.done():
                    pending.done.set_result(stream_id)

    async def _write(self, batch: list[_Pending]) -> list[object]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for p in batch:
                await self._emit(
                    session_id=p.session_id,
                    event=p.event,
                    maxlen=p.maxlen,
                    ttl_s=p.ttl_s,
                    final=p.final,
                    writer=p.worker,
                    assistant=p.assistant,
                    seq=p.seq,
                    epoch=p.epoch,
                    pipe=pipe,
                )
                if p.ack is not None:
                    self.queue.ack_in(pipe, p.ack)
            replies: list[object] = await pipe.execute()
        self.pipelines += 1
        self.events += len(batch)
        results, position = [], 0
        for p in batch:  # one reply per event; skip the acknowledgements
            results.append(replies[position])
            position += 2 if p.ack is not None else 1
        return results
