"""A worker's claim of a generation and its engine's first token (engine/worker.py): the
engine starts while the claim is on its way, and Redis takes the run's events only if the
claim held. A real worker (synthetic engine) on a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

import wire
from engine.backends.base import Delta, Prepared
from engine.backends.synthetic import SyntheticBackend
from engine.worker import Worker
from wire import GenerationRequest, Keys, SamplingParams, Started
from wire.emit_step import EmitTarget
from wire.outcomes import TakenOver

pytestmark = pytest.mark.timeout(60)


class Rig:
    """One worker whose publisher runs, fed requests by hand (no take loop)."""

    def __init__(self, redis: aioredis.Redis, tokens_per_s: float) -> None:
        self.redis = redis
        self.keys = Keys(f"t-{secrets.token_hex(4)}")
        self.backend = SyntheticBackend(tokens_per_s=tokens_per_s)
        self.worker = Worker(redis, self.backend, keys=self.keys, worker_id="w-claim")
        self.sid, self.gid = f"s_{secrets.token_hex(4)}", f"g_{secrets.token_hex(4)}"

    async def generation(self, **fields: str) -> None:
        key = self.keys.generation(self.sid, self.gid)
        await self.redis.hset(key, mapping=fields)
        await self.redis.expire(key, 600)

    async def take(self, max_tokens: int) -> bytes:
        """Queue a request for the generation and hand it to the worker as its job table would."""
        request = GenerationRequest(
            self.gid, self.sid, SamplingParams(max_tokens=max_tokens), prompt="claim it"
        )
        queue = self.worker.requests_key
        fields: dict[Any, Any] = {b"r": wire.encode(request)}
        await self.redis.xgroup_create(queue, wire.CONSUMER_GROUP, id="0", mkstream=True)
        entry = cast(bytes, await self.redis.xadd(queue, fields))
        await self.redis.xreadgroup(wire.CONSUMER_GROUP, "w-claim", {queue: ">"})
        self.worker.jobs.add(entry, fields)
        return entry

    async def kinds(self) -> list[bytes]:
        """The kinds of the events written to the session's stream so far."""
        entries = wire.entries_of(await self.redis.xrange(self.keys.events(self.sid)))
        return [fields[b"t"] for _, fields in entries]

    async def idle(self) -> None:
        while self.worker.jobs.busy:
            await asyncio.sleep(0.01)

    async def pending(self) -> int:
        info = await self.redis.xpending(self.worker.requests_key, wire.CONSUMER_GROUP)
        return int(info["pending"])


@pytest.fixture
async def publishing(redis: aioredis.Redis) -> AsyncIterator[Rig]:
    rig = Rig(redis, tokens_per_s=200)
    task = asyncio.create_task(rig.worker.publisher.run_forever())
    try:
        yield rig
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await rig.backend.stop()  # an aborted run's engine may still sleep to its next step


async def test_the_first_token_is_written_before_the_claims_answer_comes_back(
    publishing: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim's answer is held back: its token is in Redis all the same (it went with
    the claim), so a reply's first token never waits for the claim's round trip."""
    rig = publishing
    await rig.generation(state="queued")
    answer_claim = asyncio.Event()
    emit = rig.worker.publisher.emit_waited

    def claim_held(target: EmitTarget, event: wire.SessionEvent, seq: int, **options: Any) -> Any:
        written = emit(target, event, seq, **options)
        if not isinstance(event, Started):
            return written

        async def held() -> str | None:
            stream_id = await written
            await answer_claim.wait()
            return stream_id

        return asyncio.ensure_future(held())

    monkeypatch.setattr(rig.worker.publisher, "emit_waited", claim_held)
    await rig.take(max_tokens=5)
    try:
        async with asyncio.timeout(10):
            while b"token" not in await rig.kinds():
                await asyncio.sleep(0.01)
    finally:
        answer_claim.set()
        async with asyncio.timeout(10):
            await rig.idle()
    assert await rig.kinds() == [b"started", *[b"token"] * 5, b"done"]
    assert await rig.pending() == 0


async def test_a_run_whose_claim_is_refused_writes_nothing_and_stops_its_engine(
    publishing: Rig,
) -> None:
    """The generation ended before the worker took it (cancelled while queued): Redis
    refuses the claim and every token the engine made meanwhile; the engine's run is
    aborted long before its 1,000 tokens, and the request is acknowledged."""
    rig = publishing
    await rig.generation(state="cancelled", final_id="1-0")
    await rig.take(max_tokens=1000)  # 5 s at 200 tokens/s
    async with asyncio.timeout(2.5):
        await rig.idle()
    assert rig.backend.running() == 0
    assert await rig.kinds() == []
    assert await rig.pending() == 0


async def test_a_refused_claims_abort_that_comes_before_the_engine_has_the_request(
    publishing: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM takes a request in an await of its own (its input processing): the refused
    claim's abort can come first and find nothing to stop. The run's first delta then
    closes it, so the engine still stops long before its 1,000 tokens (the old worker
    read the whole run, 5 s here, as waste)."""
    rig = publishing
    await rig.generation(state="cancelled", final_id="1-0")
    generate = rig.backend.generate

    async def slow_to_take(prepared: Prepared) -> AsyncGenerator[Delta, None]:
        await asyncio.sleep(0.05)  # the claim's answer, and its abort, come meanwhile
        async with contextlib.aclosing(generate(prepared)) as deltas:
            async for delta in deltas:
                yield delta

    monkeypatch.setattr(rig.backend, "generate", slow_to_take)
    await rig.take(max_tokens=1000)
    async with asyncio.timeout(2.5):
        await rig.idle()
    assert rig.backend.running() == 0
    waste = rig.worker.metrics.registry.get_sample_value(
        "tokenspout_engine_tokens_after_cancel_total"
    )
    assert waste is not None and waste >= 1  # the engine did start after the abort
    assert await rig.kinds() == []
    assert await rig.pending() == 0


async def test_a_reply_that_ends_in_its_refused_claims_write_is_not_counted(
    publishing: Rig,
) -> None:
    """A one-token reply ends in the very write that carries its claim (the engine is that
    quick): Redis refuses the claim and the end with it, and the worker counts no
    generation as ended here."""
    rig = publishing
    await rig.generation(state="cancelled", final_id="1-0")
    await rig.take(max_tokens=1)
    async with asyncio.timeout(5):
        await rig.idle()
    assert await rig.kinds() == []
    assert await rig.pending() == 0
    ended = rig.worker.metrics.registry.get_sample_value(
        "tokenspout_engine_generations_total", {"state": "done"}
    )
    assert ended is None, ended


async def test_a_run_taken_over_by_the_reaper_leaves_its_request_to_the_reaper(
    publishing: Rig,
) -> None:
    """The reaper took this worker for lost (its heartbeats held up) and its reply over: the
    request claimed for the reaper, the generation queued at the next epoch. The reaper
    queues the continuation and acknowledges the request itself; its queueing refused
    (Redis at its maxmemory), it leaves the request pending for its next pass to do again.
    The worker's next event is refused and its run dropped, and the request is not its to
    acknowledge: acknowledged, the reply was lost for good (the chaos run, seed 11)."""
    rig = publishing
    await rig.generation(state="queued")
    entry = await rig.take(max_tokens=400)
    async with asyncio.timeout(10):
        while b"token" not in await rig.kinds():
            await asyncio.sleep(0.01)
    queue = rig.worker.requests_key
    await rig.redis.xclaim(queue, wire.CONSUMER_GROUP, "reaper-test", 0, [entry])
    taken = await rig.worker.publisher.generations.take_over(
        rig.sid, rig.gid, worker="w-claim", max_takeovers=3, lost=True
    )
    assert isinstance(taken, TakenOver), taken
    async with asyncio.timeout(10):
        await rig.idle()
    assert await rig.pending() == 1, "the worker acknowledged the request the reaper holds"
