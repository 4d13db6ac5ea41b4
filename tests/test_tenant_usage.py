"""Usage you can bill: every generation's tokens counted once, to the key it served, where
its final event is written (wire/lua/usage_core.lua), whatever ends it.

Real processes (Redis, gateways, synthetic workers); the usage is read back through the
admin API and compared with what the clients were told: each final event's usage (the
prompt of a request with ``n`` choices once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

import wire
from stack import processes
from stack.redis_cluster import EmbeddedCluster
from stack.redis_server import EmbeddedRedis, free_port
from tests.support.http import Follower, Session, cancel, follow, read_events
from tests.support.metrics import scrape, until_sample, value
from tests.support.redis_probes import lease_trusted
from tests.support.stack import Gateway, Stack
from tests.support.tenants import (
    ADMIN_KEY,
    Key,
    keyed_session,
    make_key,
    until_known,
    until_usage,
    usage_total,
)
from wire import Keys
from wire.connect import connect
from wire.tenancy import UsageCounter, read_usage

pytestmark = pytest.mark.timeout(120)


def tokens_of(usage: dict[str, Any], *, prompt: bool = True) -> int:
    return (usage["prompt_tokens"] if prompt else 0) + usage["completion_tokens"]


async def post_turn(
    client: httpx.AsyncClient,
    session: Session,
    content: str,
    headers: dict[str, str] | None = None,
    **params: Any,
) -> httpx.Response:
    sent = await client.post(
        f"{session.base}/v1/sessions/{session.session_id}/messages",
        json={"content": content, **params},
        headers={**session.headers, **(headers or {})},
    )
    assert sent.status_code == 202, sent.text
    return sent


async def turn_final(
    client: httpx.AsyncClient, base: str, key: Key, content: str, **params: Any
) -> dict[str, Any]:
    """A session turn of ``key``'s, read to its final event: that event's data."""
    session = await keyed_session(client, base, key)
    gid = (await post_turn(client, session, content, **params)).json()["generation_id"]
    reading = await read_events(client, session, until_final_of=gid)
    final: dict[str, Any] = reading.final(gid).json()
    return final


async def test_every_ending_is_counted_once_to_its_key(stack: Stack) -> None:
    """Done (OpenAI, streamed and whole), ``n`` = 2 (the prompt once), a resend with the
    same Idempotency-Key (no new generation), a cancel while running and while queued,
    and an engine error after 3 tokens (its final event carries its usage): the key's
    usage is the sum of what the clients were told, and its generations are counted."""
    stack.synthetic(200, "--capacity", "2")
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    async with httpx.AsyncClient(timeout=30) as client:
        key = await make_key(client, gateway.url, "billed")
        other = await make_key(client, gateway.url, "bystander")
        told = await _openai_told(key, f"{gateway.url}/v1")
        # Sent twice with one Idempotency-Key: one generation.
        session = await keyed_session(client, gateway.url, key)
        again = {"Idempotency-Key": "once"}
        first = await post_turn(client, session, "resend", again, max_tokens=6)
        gid = first.json()["generation_id"]
        reading = await read_events(client, session, until_final_of=gid)
        resent = await post_turn(client, session, "resend", again, max_tokens=6)
        assert resent.json()["duplicate"] and resent.json()["generation_id"] == gid
        told.append(tokens_of(reading.final(gid).json()["usage"]))
        failed = await turn_final(client, gateway.url, key, "[[fail:3]] boom", max_tokens=9)
        assert failed["type"] == "error" and failed["usage"]["completion_tokens"] == 3
        told.append(tokens_of(failed["usage"]))
        told += await _cancelled(client, gateway.url, key)
        other_told = tokens_of(
            (await turn_final(client, gateway.url, other, "elsewhere", max_tokens=3))["usage"]
        )
        total = await usage_total(client, gateway.url, key.id)
        assert total["total_tokens"] == sum(told), (total, told)
        assert total["generations"] == 1 + 2 + 1 + 1 + 1 + 3
        assert (await usage_total(client, gateway.url, other.id))["total_tokens"] == other_told


async def _openai_told(key: Key, base_url: str) -> list[int]:
    """OpenAI requests of ``key``'s: whole, two choices, streamed with usage; the tokens
    each response said it used (the two choices' prompt once)."""
    told: list[int] = []
    async with openai.AsyncOpenAI(api_key=key.secret, base_url=base_url, max_retries=0) as sdk:
        whole = await sdk.chat.completions.create(
            model="synthetic", messages=[{"role": "user", "content": "one"}], max_tokens=7
        )
        assert whole.usage is not None
        told.append(whole.usage.total_tokens)
        two = await sdk.chat.completions.create(
            model="synthetic", messages=[{"role": "user", "content": "two"}], max_tokens=5, n=2
        )
        assert two.usage is not None and two.usage.completion_tokens == 10
        told.append(two.usage.total_tokens)  # the prompt once
        streamed = await sdk.completions.create(
            model="synthetic",
            prompt="three",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in streamed:
            if chunk.usage is not None:
                told.append(chunk.usage.total_tokens)
    return told


async def _cancelled(client: httpx.AsyncClient, base: str, key: Key) -> list[int]:
    """Two generations stall the worker's two slots: a third waits queued and is cancelled
    there (usage 0), then the two are cancelled running; the tokens each was told."""
    stalled = [await keyed_session(client, base, key) for _ in range(2)]
    running = []
    for session in stalled:
        gid = (await post_turn(client, session, "[[stall]] hold", max_tokens=50)).json()[
            "generation_id"
        ]
        running.append((session, gid, follow(client, session, gid)))
    for _, _, follower in running:
        await follower.until_event("started")
    waiting = await keyed_session(client, base, key)
    queued = (await post_turn(client, waiting, "queued", max_tokens=5)).json()["generation_id"]
    told = [tokens_of((await cancel(client, waiting, queued))["final"]["usage"])]
    assert told == [0]
    for session, gid, follower in running:
        await cancel(client, session, gid)
        await follower.until_end()
        told.append(tokens_of(follower.reading.final(gid).json()["usage"]))
    return told


async def test_a_reply_taken_over_is_counted_once_whole(stack: Stack) -> None:
    """A worker SIGKILLed mid-reply: another continues it, and the key is billed the whole
    reply once (the dead worker billed nothing, having written no final event); the
    worker that ended it counts the tokens in its metric, under the key's id."""
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    metrics_port = free_port()
    async with httpx.AsyncClient(timeout=30) as client:
        key = await make_key(client, gateway.url, "taken-over")
        survivor = ["--metrics-port", str(metrics_port)]
        follower, final = await _killed_mid_reply(client, stack, gateway, key, 10, survivor)
        assert final["type"] == "done" and final["usage"]["completion_tokens"] == 60
        assert any(event.event == "resumed" for event in follower.reading.events)
        total = await usage_total(client, gateway.url, key.id)
        assert total["total_tokens"] == tokens_of(final["usage"])
        assert total["generations"] == 1
        # The worker counts its metric once its final event is written: the reader may see
        # the event first.
        url, name = (
            f"http://127.0.0.1:{metrics_port}/metrics",
            "tokenspout_engine_tenant_tokens_total",
        )
        await until_sample(
            client, url, 60, name, "completion tokens", tenant=key.id, kind="completion"
        )
        samples = await scrape(client, url)
    assert value(samples, name, tenant=key.id, kind="prompt") == final["usage"]["prompt_tokens"]


async def test_a_lost_reply_that_cannot_go_on_bills_what_it_streamed(stack: Stack) -> None:
    """With takeovers off, a worker SIGKILLed mid-reply ends it ``worker_lost``: the
    reaper reads back what it streamed, the error carries that usage, and the key is
    billed exactly the tokens its client received."""
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY, TOKENSPOUT_MAX_TAKEOVERS="0")
    async with httpx.AsyncClient(timeout=30) as client:
        key = await make_key(client, gateway.url, "lost")
        follower, final = await _killed_mid_reply(client, stack, gateway, key, 5, None)
        assert final["type"] == "error" and final["code"] == "worker_lost"
        received = follower.tokens()
        assert final["usage"]["completion_tokens"] == received
        total = await usage_total(client, gateway.url, key.id)
        assert total["completion_tokens"] == received
        assert total["total_tokens"] == tokens_of(final["usage"])


async def _killed_mid_reply(
    client: httpx.AsyncClient,
    stack: Stack,
    gateway: Gateway,
    key: Key,
    tokens: int,
    survivor: list[str] | None,
) -> tuple[Follower, dict[str, Any]]:
    """A 60-token reply of ``key``'s whose worker (the stack's first, started here) is
    SIGKILLed after ``tokens`` tokens, with another started first (its ``survivor`` args)
    or none: the reader's follower and the reply's final event."""
    doomed = stack.synthetic(20)
    session = await keyed_session(client, gateway.url, key)
    gid = (await post_turn(client, session, "carry on", max_tokens=60)).json()["generation_id"]
    follower = follow(client, session, gid)
    await follower.until_tokens(tokens)
    if survivor is not None:
        stack.synthetic(20, *survivor)
    await lease_trusted(stack.redis_url)
    processes.kill(doomed)
    await follower.until_end(60)
    final: dict[str, Any] = follower.reading.final(gid).json()
    return follower, final


@pytest.mark.cluster
@pytest.mark.timeout(240)
async def test_on_a_cluster_the_writer_counts_once_after_the_final_event(
    cluster_stack: Stack,
) -> None:
    """On a Redis Cluster a key's usage and counts live on its own slot, so each final
    event's writer counts them right after it (the worker for a reply, the gateway for a
    queued cancel): the key is billed what its clients were told, its concurrency count
    drops back to 0, and a second count of a generation counts nothing."""
    stack = cluster_stack
    stack.synthetic(200, "--capacity", "2")
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    limits = {"concurrent": 4, "requests_per_minute": 1000, "tokens_per_day": 10**6}
    async with httpx.AsyncClient(timeout=30) as client:
        key = await make_key(client, gateway.url, "sharded", limits=limits)
        told = await _openai_told(key, f"{gateway.url}/v1")
        told += await _cancelled(client, gateway.url, key)
        session = await keyed_session(client, gateway.url, key)
        gid = (await post_turn(client, session, "one more", max_tokens=3)).json()
        reading = await read_events(client, session, until_final_of=gid["generation_id"])
        told.append(tokens_of(reading.final(gid["generation_id"]).json()["usage"]))
        # Each is counted right after its final event: a reader may see the event first.
        total = await until_usage(client, gateway.url, key.id, sum(told))
        assert total["generations"] == 1 + 2 + 1 + 3 + 1
    redis = connect(stack.redis_url)
    try:
        keys = Keys(stack.prefix)
        # Counted with the usage: none of its generations counts as running any more.
        assert await redis.zcard(keys.tenant(key.id, "running")) == 0
        counter = UsageCounter(redis, keys)
        assert not await counter.after_final(session.session_id, gid["generation_id"])
    finally:
        await redis.aclose()


async def _apart(
    client: httpx.AsyncClient, base: str, cluster: EmbeddedCluster, keys: Keys, **fields: Any
) -> tuple[Key, Session, EmbeddedRedis]:
    """A key (``fields``: its limits) whose slot's primary serves neither the synthetic
    model's queue nor a new session of the key's, that session, and that primary: pausing
    its writes holds up the key's usage count alone, pausing the session's holds up the
    session's writes alone."""
    queue_node = cluster.primary_of(keys.requests("synthetic")).port
    for attempt in range(30):
        key = await make_key(client, base, f"apart-{attempt}", **fields)
        tenant_node = cluster.primary_of(keys.tenant(key.id, "requests"))
        if tenant_node.port != queue_node:
            break
    for _ in range(30):
        session = await keyed_session(client, base, key)
        if cluster.primary_of(keys.events(session.session_id)).port != tenant_node.port:
            return key, session, tenant_node
    raise AssertionError("no session apart from its key's primary in 30 tries")


@contextlib.contextmanager
def _writes_paused(cluster: EmbeddedCluster, node: EmbeddedRedis) -> Iterator[None]:
    with cluster.client(node) as client:
        client.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
        try:
            yield
        finally:
            client.execute_command("CLIENT", "UNPAUSE")


async def _first_generation(redis: Any, keys: Keys, session_id: str) -> str:
    """The id of the session's first generation, once its ``queued`` event is written."""
    async with asyncio.timeout(20):
        while not (entries := await redis.xrange(keys.events(session_id), count=1)):
            await asyncio.sleep(0.01)
    return wire.text(entries[0][1][b"g"])


async def _until_final(redis: Any, keys: Keys, session_id: str, gid: str) -> dict[str, Any]:
    """The generation's final event once Redis holds it, then a moment for its writer to
    send the count that follows it."""
    async with asyncio.timeout(20):
        while (final := await redis.hget(keys.generation(session_id, gid), "final")) is None:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    ended: dict[str, Any] = json.loads(final)
    return ended


async def _until_generations(
    client: httpx.AsyncClient, base: str, key: Key, generations: int
) -> dict[str, int]:
    async with asyncio.timeout(30):
        while (total := await usage_total(client, base, key.id))["generations"] < generations:
            await asyncio.sleep(0.1)
    return total


@pytest.mark.cluster
@pytest.mark.timeout(240)
async def test_on_a_cluster_a_worker_lost_before_it_counted_is_counted_by_the_reaper(
    cluster_stack: Stack, redis_cluster: EmbeddedCluster
) -> None:
    """The worker writes a reply's final event; its count waits on the key's primary,
    whose writes are paused; SIGKILLed right then, it never counts. Its request, which it
    acknowledges only after the count, is left pending: the reaper takes it, finds the
    reply ended and counts it, once. (Before, the request was acknowledged with the final
    event: nothing was left to find, and the key was never billed the reply.)"""
    stack = cluster_stack
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    doomed = stack.synthetic(200)
    keys, redis = Keys(stack.prefix), connect(stack.redis_url)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            key, session, primary = await _apart(client, gateway.url, redis_cluster, keys)
            with _writes_paused(redis_cluster, primary):
                # Its answer may wait on the paused primary too (the conversation's index
                # of its owner may live there): the generation is read from the session.
                sending = asyncio.ensure_future(_send(client, session, "counted later", 5))
                gid = await _first_generation(redis, keys, session.session_id)
                final = await _until_final(redis, keys, session.session_id, gid)
                processes.kill(doomed)
            assert (await sending).status_code == 202
            total = await _until_generations(client, gateway.url, key, 1)
    finally:
        await redis.aclose()
    assert total["total_tokens"] == tokens_of(final["usage"]) > 0
    assert total["generations"] == 1


@pytest.mark.cluster
@pytest.mark.timeout(240)
async def test_on_a_cluster_a_queued_cancel_whose_gateway_was_lost_is_counted_by_a_worker(
    cluster_stack: Stack, redis_cluster: EmbeddedCluster
) -> None:
    """A gateway ends a queued generation (a cancel) and is SIGKILLed while its count
    waits on the key's paused primary. The worker that takes the request later finds it
    ended (its claim refused) and counts it, once, before it acknowledges it. (Before, it
    only acknowledged it: the key was never billed that generation.)"""
    stack = cluster_stack
    doomed = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    stack.synthetic(200, "--capacity", "1")
    keys, redis = Keys(stack.prefix), connect(stack.redis_url)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            key, session, primary = await _apart(client, gateway.url, redis_cluster, keys)
            holder = await keyed_session(client, gateway.url, key)
            sent = await post_turn(client, holder, "[[stall]] hold", max_tokens=50)
            held = sent.json()["generation_id"]
            follower = follow(client, holder, held)
            await follower.until_event("started")  # the worker's one slot is taken
            gid = (await post_turn(client, session, "queued", max_tokens=5)).json()["generation_id"]
            through_doomed = Session(doomed.url, session.session_id, session.token)
            with _writes_paused(redis_cluster, primary):
                cancelling = asyncio.ensure_future(cancel(client, through_doomed, gid))
                final = await _until_final(redis, keys, session.session_id, gid)
                processes.kill(doomed.process)
            with contextlib.suppress(httpx.TransportError):
                await cancelling
            await cancel(client, holder, held)  # the slot is free: the worker meets it
            await follower.until_end()
            stalled = follower.reading.final(held).json()["usage"]
            total = await _until_generations(client, gateway.url, key, 2)
    finally:
        await redis.aclose()
    assert final["type"] == "cancelled" and tokens_of(final["usage"]) == 0
    assert total["total_tokens"] == tokens_of(stalled)
    assert total["generations"] == 2


@pytest.mark.cluster
@pytest.mark.timeout(240)
async def test_a_turn_admitted_by_a_gateway_lost_before_its_submit_is_given_back(
    cluster_stack: Stack, redis_cluster: EmbeddedCluster
) -> None:
    """A key limited to one generation at a time: a gateway admits a turn of its (ADMIT,
    on the key's slot) and is SIGKILLed while the SUBMIT that writes the generation waits
    on the session's primary (its writes paused). The generation never exists, yet it
    counted against the key: before, every request of the key was refused for the hour a
    running entry lasts (the chaos run, seed 13 on a cluster: two of a key's three slots
    lost). The reaper gives back an admission whose generation does not exist 10 s on."""
    stack = cluster_stack
    doomed = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    stack.synthetic(200)
    keys, redis = Keys(stack.prefix), connect(stack.redis_url)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            key, session, _ = await _apart(
                client, gateway.url, redis_cluster, keys, limits={"concurrent": 1}
            )
            await until_known(client, doomed.url, key)  # it reads the keys every 250 ms
            session_primary = redis_cluster.primary_of(keys.events(session.session_id))
            url = f"{doomed.url}/v1/sessions/{session.session_id}/messages"
            body = {"content": "never written", "max_tokens": 3}
            with _writes_paused(redis_cluster, session_primary):
                sending = asyncio.ensure_future(
                    client.post(url, json=body, headers=session.headers)
                )
                async with asyncio.timeout(10):
                    while not await redis.zcard(keys.tenant(key.id, "running")):
                        await asyncio.sleep(0.01)
                processes.kill(doomed.process)
            with contextlib.suppress(httpx.TransportError):
                await sending
            lost = await redis.zrange(keys.tenant(key.id, "running"), 0, -1)
            assert not await redis.exists(keys.generation(session.session_id, lost[0].decode()))
            other = await keyed_session(client, gateway.url, key)
            refused, began = 0, time.monotonic()
            async with asyncio.timeout(40):
                while (sent := await _send(client, other, "after")).status_code == 429:
                    refused += 1
                    await asyncio.sleep(0.25)
            given_back_s = time.monotonic() - began
            gid = sent.json()["generation_id"]
            await read_events(client, other, until_final_of=gid)
            running = await _until_no_running(redis, keys, key)
    finally:
        await redis.aclose()
    assert sent.status_code == 202 and refused >= 1, (sent.text, refused)
    assert given_back_s < 10 + 2 + 5, given_back_s  # SUBMITTED_WITHIN_S, a look's period
    assert running == 0


async def _send(
    client: httpx.AsyncClient, session: Session, content: str, max_tokens: int = 3
) -> httpx.Response:
    return await client.post(
        f"{session.base}/v1/sessions/{session.session_id}/messages",
        json={"content": content, "max_tokens": max_tokens},
        headers=session.headers,
    )


async def _until_no_running(redis: Any, keys: Keys, key: Key) -> int:
    """The key's running generations once none is left (a cluster counts after a final
    event, which a reader may see first), or after 10 s."""
    async with asyncio.timeout(10):
        while running := await redis.zcard(keys.tenant(key.id, "running")):
            await asyncio.sleep(0.05)
    return int(running)


async def test_a_request_with_no_key_is_counted_only_when_asked(stack: Stack) -> None:
    """With no key required a request serves ``anonymous``: by default its final event
    counts nothing in Redis (no bookkeeping for a request that names no key); with
    ``TOKENSPOUT_ANONYMOUS_USAGE`` its usage is counted as a key's is."""
    stack.synthetic(200)
    counted = stack.gateway(TOKENSPOUT_ANONYMOUS_USAGE="1")
    uncounted = stack.gateway()
    redis = connect(stack.redis_url)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for gateway in (uncounted, counted, counted):
                body = {"model": "synthetic", "prompt": "no key", "max_tokens": 3}
                answered = await client.post(f"{gateway.url}/v1/completions", json=body)
                assert answered.status_code == 200, answered.text
        now = int(time.time())
        days = await read_usage(
            redis, Keys(stack.prefix), "anonymous", "day", now - 86_400, now + 1
        )
        assert sum(day.generations for day in days) == 2
        assert sum(day.completion_tokens for day in days) == 6
    finally:
        await redis.aclose()
