"""A request queued twice, taken again while the first copy's claim is on its way
(engine/jobs.py): the gateway's submit, retried after Redis lost its scripts, queues a
first copy before its generation exists and a second one after. A real worker and a real
Redis; only the first claim's answer is held back, to take the second copy in between."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

import wire
from engine.backends.synthetic import SyntheticBackend
from engine.worker import Worker
from wire import GenerationRequest, Keys, SamplingParams, Started
from wire.emit_step import EmitTarget

pytestmark = pytest.mark.timeout(60)


async def test_the_second_copy_runs_when_the_first_copys_claim_was_refused(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = Keys(f"t-{secrets.token_hex(4)}")
    worker = Worker(redis, SyntheticBackend(tokens_per_s=200), keys=keys, worker_id="w-copy")
    sid, gid = f"s_{secrets.token_hex(4)}", f"g_{secrets.token_hex(4)}"
    request = GenerationRequest(gid, sid, SamplingParams(max_tokens=5), prompt="twice")
    fields: dict[Any, Any] = {b"r": wire.encode(request)}
    queue = worker.requests_key
    await redis.xgroup_create(queue, wire.CONSUMER_GROUP, id="0", mkstream=True)

    first_refused, answer_first = asyncio.Event(), asyncio.Event()
    emit = worker.publisher.emit_waited
    claims: list[EmitTarget] = []

    def first_claim_held(
        target: EmitTarget, event: wire.SessionEvent, seq: int, **options: Any
    ) -> Any:
        written = emit(target, event, seq, **options)
        if not isinstance(event, Started):
            return written
        claims.append(target)
        if len(claims) > 1:  # the second copy's
            return written

        async def held() -> str | None:
            stream_id = await written
            first_refused.set()
            await answer_first.wait()
            return stream_id

        return asyncio.ensure_future(held())

    async def kinds() -> list[bytes]:
        """The kinds of the events written to the session's stream so far."""
        return [f[b"t"] for _, f in wire.entries_of(await redis.xrange(keys.events(sid)))]

    monkeypatch.setattr(worker.publisher, "emit_waited", first_claim_held)
    publishing = asyncio.create_task(worker.publisher.run_forever())
    try:
        first = cast(bytes, await redis.xadd(queue, fields))  # SUBMIT failed: no generation
        await redis.xreadgroup(wire.CONSUMER_GROUP, "w-copy", {queue: ">"})
        worker.jobs.add(first, fields)
        await asyncio.wait_for(first_refused.wait(), 10)  # EMIT refused it: nothing queued
        await redis.hset(keys.generation(sid, gid), mapping={"state": "queued"})
        await redis.expire(keys.generation(sid, gid), 600)
        second = cast(bytes, await redis.xadd(queue, fields))  # the retried submit
        await redis.xreadgroup(wire.CONSUMER_GROUP, "w-copy", {queue: ">"})
        worker.jobs.add(second, fields)
        answer_first.set()
        async with asyncio.timeout(20):
            while not (written := await kinds()) or written[-1] != b"done":
                await asyncio.sleep(0.02)
            while worker.jobs.busy:
                await asyncio.sleep(0.02)
    finally:
        publishing.cancel()
        await asyncio.gather(publishing, return_exceptions=True)
    assert written == [b"started"] + [b"token"] * (len(written) - 2) + [b"done"], written
    assert (await redis.xpending(queue, wire.CONSUMER_GROUP))["pending"] == 0
