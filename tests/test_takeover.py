"""A reply survives its engine worker: takeover after SIGKILL, hand-over on SIGTERM.

Real processes (synthetic engines, gateways, Redis). Every test checks the reader's side:
the text is byte for byte the uninterrupted reply, ids strictly increase, token counts go
up by one with no gap or repeat, exactly one final event, usage counting the whole reply.
The gateways run with the default TOKENSPOUT_WORKER_TIMEOUT_S (5 s): a takeover within a
second shows the lease connection, not the heartbeat timeout, told the gateway. The last
test checks the synthetic engine's continuation itself, in process.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time

import httpx
import msgspec
import openai
import pytest
import redis.asyncio as aioredis

import wire
from gateway.recovery.takeover import REAPER_PREFIX, LostRequests
from stack import processes
from stack.redis_server import free_port
from tests.support.http import TERMINAL, Session, cancel, create_session, follow, send
from tests.support.metrics import scrape, value
from tests.support.oracle import synthetic_text
from tests.support.redis_probes import event_key, lease_trusted
from tests.support.sse import Event
from tests.support.stack import Stack
from tests.support.tokens import assert_gap_free_tokens
from wire import CONSUMER_GROUP, GenerationRequest, Keys, WorkerInfo
from wire.generations import CONTINUATION, Generations
from wire.queue import RequestQueue

pytestmark = pytest.mark.timeout(120)

TAKEOVER_BOUND_S = 1.0
"""Kill -> next token on the reader's stream (synthetic engine; bench/takeover.py has the
distribution)."""


def check_whole(events: list[Event], gid: str, content: str, max_tokens: int) -> None:
    """The reply as the reader got it equals the uninterrupted one, in every respect."""
    ids = [event_key(e.id or "") for e in events]
    assert ids == sorted(set(ids)), "events repeated or out of order"
    mine = [e for e in events if e.json().get("generation_id") == gid]
    tokens = [e.json() for e in mine if e.event == "token"]
    assert assert_gap_free_tokens(tokens) == max_tokens
    finals = [e for e in mine if e.event in TERMINAL]
    assert [e.event for e in finals] == ["done"] and mine[-1] is finals[0]
    assert finals[0].json()["usage"]["completion_tokens"] == max_tokens
    text = "".join(e.json()["text"] for e in mine if e.event == "token")
    assert text == synthetic_text(content, max_tokens)


async def test_a_worker_killed_mid_reply_is_continued_byte_for_byte(stack: Stack) -> None:
    """SIGKILL the worker while an SSE stream and an OpenAI SDK stream read its replies:
    both end `done` with exactly the uninterrupted text; the SSE stream carries a
    `resumed` event naming both workers; the next token comes within a second."""
    doomed = stack.synthetic(20)
    gateway = stack.gateway()
    content, max_tokens = "carry on please", 60
    sdk = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        gid = await send(client, session, content, max_tokens=max_tokens)
        follower = follow(client, session, gid)
        chunks: list[str] = []

        async def sdk_stream() -> str:
            stream = await sdk.chat.completions.create(
                model="synthetic",
                messages=[{"role": "user", "content": content}],
                max_tokens=max_tokens,
                stream=True,
            )
            finish = ""
            async for chunk in stream:
                if chunk.choices:
                    chunks.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
            return finish

        sdk_task = asyncio.create_task(sdk_stream())
        await follower.until_tokens(10)
        async with asyncio.timeout(30):
            while len(chunks) < 5:
                await asyncio.sleep(0.01)
        stack.synthetic(20)
        await lease_trusted(stack.redis_url)
        processes.kill(doomed)
        killed_at = time.monotonic()
        await follower.until_end(60)
        finish = await asyncio.wait_for(sdk_task, 60)
    await sdk.close()
    next_token_s = follower.first_token_after(killed_at)
    print(f"\nSIGKILL -> next token {next_token_s * 1000:.0f} ms")
    check_whole(follower.reading.events, gid, content, max_tokens)
    resumed = [e.json() for e in follower.reading.events if e.event == "resumed"]
    assert len(resumed) == 1 and resumed[0]["takeover"] == 1
    assert resumed[0]["from_worker"] != resumed[0]["to_worker"]
    assert next_token_s < TAKEOVER_BOUND_S
    assert finish == "length"
    assert "".join(chunks) == synthetic_text(content, max_tokens)


async def test_the_readers_gateway_killed_with_the_worker(stack: Stack) -> None:
    """SIGKILL the worker and the gateway the reader is on (which may hold the reaper
    lock): the reader resumes with Last-Event-ID on another gateway, and the reply ends
    `done` with the uninterrupted text."""
    doomed = stack.synthetic(20)
    doomed_gateway, other = stack.gateway(), stack.gateway()
    content, max_tokens = "both of them died", 60
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, doomed_gateway.url)
        gid = await send(client, session, content, max_tokens=max_tokens)
        before = follow(client, session, gid)
        await before.until_tokens(10)
        stack.synthetic(20)
        processes.kill(doomed)
        processes.kill(doomed_gateway.process)
        assert before.task is not None
        with pytest.raises(httpx.TransportError):
            await before.task
        moved = Session(other.url, session.session_id, session.token)
        after = follow(client, moved, gid, after=before.reading.events[-1].id)
        await after.until_end(60)
    check_whole(before.reading.events + after.reading.events, gid, content, max_tokens)


async def test_sigterm_hands_three_running_replies_over_at_once(stack: Stack) -> None:
    """SIGTERM with another worker serving: its three running replies move there at once
    (no drain wait), each ends `done` with the uninterrupted text, and the stopped worker
    exits long before its drain time."""
    leaving = stack.synthetic(20, "--drain-s", "60")
    gateway = stack.gateway()
    max_tokens = 60
    async with httpx.AsyncClient(timeout=30) as client:
        sessions = [await create_session(client, gateway.url) for _ in range(3)]
        contents = [f"rolling restart {i}" for i in range(3)]
        gids = [
            await send(client, s, c, max_tokens=max_tokens)
            for s, c in zip(sessions, contents, strict=True)
        ]
        followers = [follow(client, s, g) for s, g in zip(sessions, gids, strict=True)]
        for follower in followers:
            await follower.until_tokens(5)
        metrics_port = free_port()
        stack.synthetic(20, "--metrics-port", str(metrics_port))
        leaving.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        await asyncio.wait_for(asyncio.to_thread(leaving.wait), 20)
        exited_s = time.monotonic() - signalled_at
        await asyncio.wait_for(asyncio.gather(*(f.task for f in followers if f.task)), 60)
        survivor = await scrape(client, f"http://127.0.0.1:{metrics_port}/metrics")
    assert value(survivor, "tokenspout_engine_takeovers_total") == 3
    gaps = [f.first_token_after(signalled_at) for f in followers]
    print(f"\nSIGTERM -> next token {', '.join(f'{g * 1000:.0f}' for g in gaps)} ms")
    for follower, gid, content in zip(followers, gids, contents, strict=True):
        check_whole(follower.reading.events, gid, content, max_tokens)
        assert [e.event for e in follower.reading.events].count("resumed") == 1
    assert max(gaps) < TAKEOVER_BOUND_S
    assert exited_s < 10 and leaving.returncode == 0


async def test_a_hand_over_takeover_declines_goes_on_here_whole(stack: Stack) -> None:
    """SIGTERM with another worker serving, for a reply TAKEOVER will not hand on (its
    worker allows no takeover): the reply drains on the leaving worker, whole. Redis holds
    writes for 0.4 s over the SIGTERM, so the hand-over first waits for some 800 events to
    be written; the engine makes tokens meanwhile, which go out once it is declined (they
    were dropped, leaving a gap)."""
    leaving_id = f"w-{secrets.token_hex(4)}"
    leaving = stack.synthetic(
        2000, "--drain-s", "30", worker_id=leaving_id, TOKENSPOUT_MAX_TAKEOVERS="0"
    )
    gateway = stack.gateway()
    content, max_tokens = "declined hand-over", 3000
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        gid = await send(client, session, content, max_tokens=max_tokens)
        follower = follow(client, session, gid)
        await follower.until_tokens(50)
        stack.synthetic(100)
        admin = aioredis.Redis.from_url(stack.redis_url)
        try:
            await admin.execute_command("CLIENT", "PAUSE", 400, "WRITE")
        finally:
            await admin.aclose()
        leaving.send_signal(signal.SIGTERM)
        await follower.until_end(30)
        assert await asyncio.to_thread(leaving.wait, 20) == 0
    check_whole(follower.reading.events, gid, content, max_tokens)
    assert "resumed" not in [e.event for e in follower.reading.events]
    log = (stack.logs / f"engine-{leaving_id}.log").read_text()
    assert f"not handing {gid} over: exhausted" in log, log[-2000:]


async def test_a_takeover_racing_a_cancel_never_continues_the_reply(stack: Stack) -> None:
    """A cancel sent right after the worker is killed (before, during or after the
    takeover) ends the reply `cancelled` with usage counting every token streamed, and no
    token follows it."""
    doomed = stack.synthetic(20)
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        sessions = [await create_session(client, gateway.url) for _ in range(3)]
        gids = [await send(client, s, "stop me", max_tokens=200) for s in sessions]
        followers = [follow(client, s, g) for s, g in zip(sessions, gids, strict=True)]
        for follower in followers:
            await follower.until_tokens(5)
        stack.synthetic(20)
        processes.kill(doomed)
        for delay, session, gid in zip((0.0, 0.1, 0.4), sessions, gids, strict=True):
            await asyncio.sleep(delay)
            await cancel(client, session, gid)
        await asyncio.wait_for(asyncio.gather(*(f.task for f in followers if f.task)), 30)
    for follower, gid in zip(followers, gids, strict=True):
        events = follower.reading.of(gid)
        assert events[-1].event == "cancelled", [e.event for e in events]
        tokens = [e.json() for e in events if e.event == "token"]
        made = assert_gap_free_tokens(tokens)
        assert events[-1].json()["usage"]["completion_tokens"] == made
        assert events[-1].json()["usage"]["prompt_tokens"] == 2


async def test_the_nth_takeover_ends_worker_lost(stack: Stack) -> None:
    """A reply that kills every worker that runs it ([[crash:5]]: each worker exits at
    token 5, the one that takes it over at once) is taken over TOKENSPOUT_MAX_TAKEOVERS
    times, then ends with `error` `worker_lost`."""
    first, second = stack.synthetic(20), stack.synthetic(20)
    gateway = stack.gateway(TOKENSPOUT_MAX_TAKEOVERS="1")
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        gid = await send(client, session, "poison [[crash:5]]", max_tokens=50)
        follower = follow(client, session, gid)
        await follower.until_end(30)
    events = follower.reading.of(gid)
    kinds = [e.event for e in events]
    assert kinds == ["queued", "started", *["token"] * 5, "resumed", "error"], kinds
    error = events[-1].json()
    assert error["code"] == "worker_lost" and "taken over 1 times" in error["message"]
    assert first.wait(10) == 17 and second.wait(10) == 17


async def test_a_request_that_kills_every_worker_before_it_starts_ends_worker_lost(
    stack: Stack,
) -> None:
    """A request whose every worker dies while preparing it, before any claims it
    ([[crash:prepare]]), goes back on the queue TOKENSPOUT_MAX_TAKEOVERS times, then ends
    with `error` `worker_lost`: it does not take down one worker after another for ever.
    A third worker, started once the two are gone, never gets it, and serves the next."""
    first, second = stack.synthetic(20), stack.synthetic(20)
    gateway = stack.gateway(TOKENSPOUT_MAX_TAKEOVERS="1")
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        gid = await send(client, session, "poison [[crash:prepare]]", max_tokens=50)
        follower = follow(client, session, gid)
        await follower.until_end(30)
        assert first.wait(10) == 17 and second.wait(10) == 17
        stack.synthetic(20)
        healthy = await send(client, session, "and now?", max_tokens=3)
        after = follow(client, session, healthy)
        await after.until_end(30)
    kinds = [e.event for e in follower.reading.of(gid)]
    assert kinds == ["queued", "error"], kinds
    error = follower.reading.of(gid)[-1].json()
    assert error["code"] == "worker_lost", error
    assert "stopped before it started (2 times)" in error["message"], error
    assert [e.event for e in after.reading.of(healthy)][-1] == "done"


async def test_a_worker_killed_while_prefilling_a_takeover(stack: Stack) -> None:
    """The worker that took a takeover dies before it claims it (here: held in prefill):
    the takeover is queued again at the same epoch and a third worker continues the
    reply, byte for byte."""
    keys = Keys(stack.prefix)
    queue = keys.requests("synthetic")
    redis = aioredis.Redis.from_url(stack.redis_url)
    doomed = stack.synthetic(20)
    gateway = stack.gateway()
    content, max_tokens = "second time lucky", 60
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            session = await create_session(client, gateway.url)
            gid = await send(client, session, content, max_tokens=max_tokens)
            follower = follow(client, session, gid)
            await follower.until_tokens(8)
            slow = stack.synthetic(20, "--prepare-delay-s", "60")
            processes.kill(doomed)
            gen_key = keys.generation(session.session_id, gid)
            async with asyncio.timeout(20):  # the slow worker holds the takeover
                while not (
                    await redis.hget(gen_key, "takeovers") == b"1"
                    and (await redis.xpending(queue, CONSUMER_GROUP))["pending"]
                ):
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.2)  # well inside its 60 s prefill
            assert await redis.hget(gen_key, "state") == b"queued"
            stack.synthetic(20)
            processes.kill(slow)
            await follower.until_end(60)
    finally:
        await redis.aclose()
    check_whole(follower.reading.events, gid, content, max_tokens)
    resumed = [e.json() for e in follower.reading.events if e.event == "resumed"]
    assert [r["takeover"] for r in resumed] == [1]


@pytest.mark.parametrize("after", [0, 1, 7, 29])
async def test_the_synthetic_engine_continues_exactly_where_it_was(after: int) -> None:
    """Word N of a synthetic reply depends only on the request and N, so a continuation
    from any point yields the rest of the uninterrupted reply, deltas and all."""
    from engine.backends.synthetic import SyntheticBackend
    from wire import GenerationRequest, Resume, SamplingParams

    backend = SyntheticBackend(tokens_per_s=0)
    request = GenerationRequest("g_1", "s_1", SamplingParams(max_tokens=40), prompt="go on")
    whole = [d async for d in backend.generate(await backend.prepare(request))]
    streamed = whole[:after]
    resume = Resume(
        takeover=1,
        from_worker="w",
        prompt_tokens=2,
        completion_tokens=after,
        text="".join(d.text for d in streamed),
        token_ids=[i for d in streamed for i in d.token_ids],
    )
    resumed = GenerationRequest(
        "g_1", "s_1", SamplingParams(max_tokens=40), prompt="go on", resume=resume
    )
    rest = [d async for d in backend.generate(await backend.prepare(resumed))]
    assert [(d.text, d.token_ids, d.finish_reason) for d in streamed + rest] == [
        (d.text, d.token_ids, d.finish_reason) for d in whole
    ]


async def test_a_worker_wrongly_taken_for_lost_never_writes_twice(stack: Stack) -> None:
    """The reaper hands on a reply whose worker is alive (as after a dropped connection):
    the old run's events are refused from then on, and here the same worker takes the
    continuation, stopping its old run. The reader sees one reply, whole, one `resumed`."""
    stack.synthetic(20)
    gateway = stack.gateway()
    keys = Keys(stack.prefix)
    redis = aioredis.Redis.from_url(stack.redis_url)
    content, max_tokens = "only slow, not dead", 60
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            session = await create_session(client, gateway.url)
            gid = await send(client, session, content, max_tokens=max_tokens)
            follower = follow(client, session, gid)
            await follower.until_tokens(10)
            owner = (await redis.hget(keys.generation(session.session_id, gid), "worker")) or b""
            queue = RequestQueue(redis, keys, "synthetic")
            (raw,) = [
                f[b"r"] for _id, f in await queue.read_after("", 100) if gid.encode() in f[b"r"]
            ]
            request = msgspec.json.decode(raw, type=GenerationRequest)
            generations = Generations(redis, keys, events_maxlen=1000, ttl_s=600)
            takeover = LostRequests(generations, max_takeovers=3, requests_maxlen=100)
            assert await takeover.hand_on(queue, request, raw, owner.decode()) == "taken_over"
            await follower.until_end(60)
    finally:
        await redis.aclose()
    check_whole(follower.reading.events, gid, content, max_tokens)
    (resumed,) = [e.json() for e in follower.reading.events if e.event == "resumed"]
    assert resumed["from_worker"] == resumed["to_worker"] == owner.decode()


async def test_a_worker_whose_lease_connection_is_cut_spends_no_more_takeovers(
    stack: Stack,
) -> None:
    """The lease connection of the model's only worker is cut just after a heartbeat (a
    reset between it and Redis): the reaper sees the lease gone and takes its reply over,
    and the worker takes the continuation back. It heartbeats with a fresh lease before
    going on, so the reply ends whole after one takeover, two at most (the reaper's look
    may land between the take and that heartbeat). Going on at once, each reaper pass
    until its next heartbeat took it over again: all three takeovers, `worker_lost`."""
    stack.synthetic(20)
    gateway = stack.gateway()
    keys = Keys(stack.prefix)
    redis = aioredis.Redis.from_url(stack.redis_url)
    content, max_tokens = "cut off, not dead", 60
    try:
        (worker_id,) = [wire.text(w) for w in await redis.zrange(keys.workers, 0, -1)]
        async with httpx.AsyncClient(timeout=30) as client:
            session = await create_session(client, gateway.url)
            gid = await send(client, session, content, max_tokens=max_tokens)
            follower = follow(client, session, gid)
            await follower.until_tokens(10)
            beat = await redis.zscore(keys.workers, worker_id)
            async with asyncio.timeout(5):
                while await redis.zscore(keys.workers, worker_id) == beat:
                    await asyncio.sleep(0.01)
            info = msgspec.json.decode(await redis.get(keys.worker(worker_id)), type=WorkerInfo)
            assert await redis.client_kill_filter(_id=info.lease_id) == 1
            await follower.until_end(60)
    finally:
        await redis.aclose()
    check_whole(follower.reading.events, gid, content, max_tokens)
    resumed = [e.json() for e in follower.reading.events if e.event == "resumed"]
    assert 1 <= len(resumed) <= 2, resumed
    assert {r["to_worker"] for r in resumed} == {worker_id}


async def lose_queued(redis: aioredis.Redis, stream: str, gid: str, copies: int) -> None:
    """Wait for ``copies`` requests of ``gid`` in ``stream``, then lose them all (as a
    Redis failover loses what the queue's primary had acknowledged)."""
    async with asyncio.timeout(20):
        while (
            len(ours := [i for i, f in await redis.xrange(stream) if gid.encode() in f[b"r"]])
            < copies
        ):
            await asyncio.sleep(0.05)
    await redis.xdel(stream, *ours)


async def test_a_turn_whose_taker_kept_no_continuation_goes_on_at_its_epoch(
    stack: Stack,
) -> None:
    """A session turn taken over whose taker wrote no continuation anywhere (TAKEOVER went
    through, then the node refused its next writes: a Redis at its maxmemory; the cluster
    chaos minute, seed 12, hung a reply so) is queued again by its reader's gateway as a
    continuation made from the submit's note and what was streamed, at the takeover's
    epoch: the reader gets the whole reply. Queued again as its first request, every
    worker refused it (its epoch past) and the reader waited for ever."""
    doomed = stack.synthetic(20)
    gateway = stack.gateway(TOKENSPOUT_SSE_HEARTBEAT_S="1")
    keys = Keys(stack.prefix)
    redis = aioredis.Redis.from_url(stack.redis_url)
    stream = RequestQueue(redis, keys, "synthetic").key
    content, max_tokens = "taken, then nothing kept", 30
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            session = await create_session(client, gateway.url)
            gid = await send(client, session, content, max_tokens=max_tokens)
            follower = follow(client, session, gid)
            await follower.until_tokens(5)
            await lease_trusted(stack.redis_url)
            processes.kill(doomed)
            await lose_queued(redis, stream, gid, 2)
            assert await redis.hdel(keys.generation(session.session_id, gid), CONTINUATION) == 1
            stack.synthetic(20)
            await follower.until_end(30)
        check_whole(follower.reading.events, gid, content, max_tokens)
        resumed = [e.json() for e in follower.reading.events if e.event == "resumed"]
        assert [r["takeover"] for r in resumed] == [1]
    finally:
        await redis.aclose()


async def test_a_takeover_whose_queueing_redis_refused_is_done_again_at_the_next_pass(
    stack: Stack,
) -> None:
    """The reaper's TAKEOVER went through, then Redis refused its write of the continuation
    to the queue (a Redis at its maxmemory: the cluster chaos minute, seed 12, left a reply
    nobody was reading never ended, its tokens streamed and never billed). The reaper hands
    it on again at its next pass, so the reply ends whole with no reader to ask for it. It
    was left pending under the reaper's own name, which its passes skipped, for another
    gateway's reaper to find (none here). The refusal is an ACL one on the gateway's Redis
    user: XADD refused, everything else allowed, as for the one write that failed."""
    admin = aioredis.Redis.from_url(stack.redis_url)
    user = f"gateway-{secrets.token_hex(4)}"
    await admin.acl_setuser(
        user, enabled=True, passwords=["+pw"], keys=["*"], channels=["*"], commands=["+@all"]
    )
    doomed = stack.synthetic(20)
    gateway = stack.gateway(REDIS_URL=stack.redis_url.replace("://", f"://{user}:pw@", 1))
    keys = Keys(stack.prefix)
    stream = RequestQueue(admin, keys, "synthetic").key
    content, max_tokens = "refused on its way back", 30
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            session = await create_session(client, gateway.url)
            gid = await send(client, session, content, max_tokens=max_tokens)
            generation = keys.generation(session.session_id, gid)
            async with asyncio.timeout(20):  # a few tokens streamed, read by nobody
                while int(await admin.hget(generation, "seq") or 0) < 6:
                    await asyncio.sleep(0.02)
            await lease_trusted(stack.redis_url)
            await admin.acl_setuser(user, commands=["-xadd"])
            processes.kill(doomed)
            async with asyncio.timeout(20):  # taken over, its continuation not queued
                while (
                    not [
                        p
                        for p in await admin.xpending_range(stream, CONSUMER_GROUP, "-", "+", 10)
                        if wire.text(p["consumer"]).startswith(REAPER_PREFIX)
                    ]
                    or await admin.hget(generation, "takeovers") != b"1"
                ):
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # a few passes of the reaper meet the refusal
            await admin.acl_setuser(user, commands=["+xadd"])
            stack.synthetic(20)
            async with asyncio.timeout(10):
                while await admin.hget(generation, "final_id") is None:
                    await asyncio.sleep(0.05)
            follower = follow(client, session, gid)
            await follower.until_end(10)
        check_whole(follower.reading.events, gid, content, max_tokens)
        resumed = [e.json() for e in follower.reading.events if e.event == "resumed"]
        assert [r["takeover"] for r in resumed] == [1]
    finally:
        await admin.acl_deluser(user)
        await admin.aclose()


async def test_a_continuation_redis_lost_is_queued_again_at_its_epoch(stack: Stack) -> None:
    """A reply taken over whose continuation Redis lost (a Cluster failover can drop the
    queue's write while the generation, on another shard, says ``queued``: the cluster
    chaos minute, seed 14, hung a reply so) is queued again by its reader's gateway: the
    continuation its taker kept beside the generation, at the takeover's epoch. The reader
    of a session turn and of a one-shot OpenAI stream each get the whole reply. Queued
    again as its first request, every worker refused it (its epoch is past) and the reader
    waited for ever; a one-shot request was not queued again at all."""
    doomed = stack.synthetic(20)
    gateway = stack.gateway(TOKENSPOUT_SSE_HEARTBEAT_S="1")
    redis = aioredis.Redis.from_url(stack.redis_url)
    stream = RequestQueue(redis, Keys(stack.prefix), "synthetic").key
    content, max_tokens = "lost on its way over", 30
    sdk = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    chunks: list[str] = []
    completion_ids: set[str] = set()

    async def one_shot() -> None:
        answer = await sdk.chat.completions.create(
            model="synthetic",
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            stream=True,
        )
        async for chunk in answer:
            completion_ids.add(chunk.id)
            if chunk.choices:
                chunks.append(chunk.choices[0].delta.content or "")

    try:
        async with httpx.AsyncClient(timeout=30) as client:
            session = await create_session(client, gateway.url)
            gid = await send(client, session, content, max_tokens=max_tokens)
            follower = follow(client, session, gid)
            sdk_task = asyncio.create_task(one_shot())
            await follower.until_tokens(5)
            async with asyncio.timeout(30):
                while len(chunks) < 5:
                    await asyncio.sleep(0.01)
            (completion_id,) = completion_ids
            one_shot_gid = completion_id.removeprefix("chatcmpl-")
            await lease_trusted(stack.redis_url)
            processes.kill(doomed)
            # No worker is left: the continuations wait in the queue, and Redis loses them
            # (with the requests they continue, acknowledged: the stream keeps no copy).
            await lose_queued(redis, stream, gid, 2)
            await lose_queued(redis, stream, one_shot_gid, 2)
            stack.synthetic(20)
            await follower.until_end(30)
            await asyncio.wait_for(sdk_task, 30)
        await sdk.close()
        check_whole(follower.reading.events, gid, content, max_tokens)
        resumed = [e.json() for e in follower.reading.events if e.event == "resumed"]
        assert [r["takeover"] for r in resumed] == [1]
        assert "".join(chunks) == synthetic_text(content, max_tokens)
        (gateway_log,) = stack.logs.glob("gateway-*.log")
        assert f"generation {gid} of session" in gateway_log.read_text()
    finally:
        await redis.aclose()
