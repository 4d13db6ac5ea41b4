"""Cancel semantics (gateway/core/store/submitter.py cancel, engine/jobs.py) that need the
synthetic engine's control, over real gateway processes and real Redis. Cancel on every path
with both backends (REST, WebSocket, gateway B, twice, after done, abandoned, queued) is in
tests/test_backend_cancels.py."""

from __future__ import annotations

import asyncio
import contextlib
import random

import httpx
import pytest
import redis.asyncio as aioredis

from tests.support.http import all_of, cancel, create_session, read_events, send, slot_held
from tests.support.redis_probes import after_final, stream_events
from tests.support.stack import Stack
from tests.support.ws import WsClient, open_ws
from wire import CONSUMER_GROUP, Keys

pytestmark = pytest.mark.timeout(240)


async def test_a_generation_cancelled_while_queued_never_reaches_the_engine(stack: Stack) -> None:
    stack.synthetic(200, "--capacity", "1")
    gateway = stack.gateway()
    holding = contextlib.AsyncExitStack()
    # The worker's one slot is busy: what follows stays queued until the hold ends.
    await holding.enter_async_context(slot_held(gateway.url))
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        http_gid = await send(client, session, "nobody runs me", max_tokens=5)
        outcome = await cancel(client, session, http_gid)
        assert outcome["state"] == "cancelled"
        assert outcome["final"]["usage"] == {"prompt_tokens": 0, "completion_tokens": 0}

        ws = await open_ws(gateway.url)
        try:
            ack = await ws.generate("q", "me neither", max_tokens=5)
            await ws.send(type="cancel", id="q")
            cancel_ack = await ws.until(lambda f: f["type"] == "ack" and f["op"] == "cancel")
            assert cancel_ack["state"] == "cancelled"
            assert (await ws.final_of("q"))["type"] == "cancelled"
            await ws.send(type="cancel", id="q")  # twice: the final state again
            again = await ws.until(lambda f: f["type"] == "ack" and f["op"] == "cancel")
            assert again["state"] == "cancelled"
        finally:
            await ws.conn.close()

        # Now the slot frees: the worker takes both requests off the queue and runs neither.
        await holding.aclose()
        redis = aioredis.Redis.from_url(stack.redis_url)
        try:
            async with asyncio.timeout(30):
                while True:
                    groups = await redis.xinfo_groups(Keys(stack.prefix).requests("synthetic"))
                    group = next(g for g in groups if g["name"].decode() == CONSUMER_GROUP)
                    if group["lag"] == 0 and group["pending"] == 0:
                        break
                    await asyncio.sleep(0.1)
        finally:
            await redis.aclose()
        for sid, gid in ((session.session_id, http_gid), (ack["session_id"], ack["generation_id"])):
            events = await stream_events(stack.redis_url, stack.prefix, sid)
            assert [e[b"t"] for e in events if e[b"g"].decode() == gid] == [b"queued", b"cancelled"]

        # The session is not left busy: the next message runs.
        next_gid = await send(client, session, "now run", max_tokens=3)
        reading = await read_events(client, session, until_final_of=next_gid)
        assert reading.final(next_gid).event == "done"


async def test_200_generations_cancelled_at_random_points_emit_no_token_after_cancelled(
    stack: Stack,
) -> None:
    engine = stack.synthetic(tokens_per_s=5)
    gateway = stack.gateway()
    rng = random.Random(20261122)
    sockets, per_socket = 8, 25

    async def run_socket(n: int) -> tuple[WsClient, list[str]]:
        ws = await open_ws(gateway.url)
        ids = [f"g{n}-{k}" for k in range(per_socket)]
        # Cancel on the ack (often still queued), after 1 to 13 tokens, or never (done).
        plan = {i: rng.choice([0, 0, 1, 2, 3, 5, 8, 13, 40]) for i in ids}
        for i in ids:
            await ws.send(type="generate", id=i, content=f"random stop {i}", max_tokens=30)
        pending, finished = set(ids), set()
        async with asyncio.timeout(120):
            while finished != set(ids):
                frame = await ws.recv()
                i = frame.get("id")
                assert frame["type"] != "error", frame
                count = frame["count"] if frame["type"] == "token" else 0
                if i in pending and frame["type"] != "done" and count >= plan[i]:
                    pending.discard(i)
                    await ws.send(type="cancel", id=i)
                if frame["type"] in ("done", "cancelled"):
                    finished.add(i)
        await asyncio.sleep(1.0)  # frames that would follow a final one would come by now
        with contextlib.suppress(TimeoutError):
            while True:
                await ws.recv(timeout_s=0.2)
        await ws.conn.close()
        return ws, ids

    results = await all_of(*(run_socket(n) for n in range(sockets)))
    assert engine.poll() is None
    cancelled = 0
    for ws, ids in results:
        for i in ids:
            frames = ws.frames[i]
            finals = [f for f in frames if f["type"] in ("done", "cancelled", "error")]
            assert len(finals) == 1, frames
            end = frames.index(finals[0])
            assert all(f["type"] == "ack" for f in frames[end + 1 :]), frames
            if finals[0]["type"] == "cancelled":
                cancelled += 1
                tokens = ws.tokens(i)
                got = tokens[-1]["count"] if tokens else 0
                assert finals[0]["usage"]["completion_tokens"] == got
            else:
                assert finals[0]["type"] == "done", finals
            ack = next(f for f in frames if f["type"] == "ack" and f["op"] == "generate")
            events = await stream_events(stack.redis_url, stack.prefix, ack["session_id"])
            assert after_final(events, ack["generation_id"]) == []
    assert cancelled >= 100, cancelled
