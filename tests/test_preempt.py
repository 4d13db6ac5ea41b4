"""Preemption (``python -m engine --preempt``: engine/policies.py, engine/jobs.py): a full
worker stops a reply of a tenant served more for a tenant served less that runs nothing
there, and the stopped reply goes on at the next free slot, whole and billed once.

Real processes: Redis, the fair gateway with keys made through its admin API, one
synthetic worker with one slot; the clients stream chat completions as any OpenAI client
does. Without ``--preempt`` the same quiet request waits for the noisy reply to end (the
test's own control). The TAKEOVER script's budget is checked on a real Redis: a stop for
another tenant never counts against ``TOKENSPOUT_MAX_TAKEOVERS``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import pytest

from engine.backends.synthetic import scripted_reply
from stack import processes
from stack.redis_server import EmbeddedRedis, free_port
from tests.support.metrics import scrape, value
from tests.support.redis_probes import command_calls, lease_trusted
from tests.support.stack import Stack
from tests.support.tenants import ADMIN_KEY, Key, make_key, until_usage
from wire import Keys
from wire.connect import connect
from wire.outcomes import Exhausted, TakenOver
from wire.scripts import Takeover

pytestmark = pytest.mark.timeout(120)

NOISY_TOKENS, QUIET_TOKENS = 60, 5
TOKENS_PER_S = 20
"""The noisy reply holds the one slot for 3 s."""
BEFORE = 25
"""Tokens of the noisy reply before the quiet request goes: past the worker's first charge
of them to its tenant (once a second), so the noisy key is the one served more."""


@dataclass
class Reply:
    text: str = ""
    tokens: int = 0
    first_token_at: float | None = None
    arrivals: list[float] = field(default_factory=list)
    """When each token arrived (monotonic)."""
    usage: dict[str, int] = field(default_factory=dict)
    streaming: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the reply has streamed ``BEFORE`` tokens."""


async def stream_chat(
    client: httpx.AsyncClient, base: str, key: Key, content: str, max_tokens: int, reply: Reply
) -> Reply:
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{base}/v1/chat/completions"
    async with client.stream("POST", url, json=body, headers=key.headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                reply.usage = chunk["usage"]
            for choice in chunk["choices"]:
                if text := choice["delta"].get("content"):
                    reply.arrivals.append(time.monotonic())
                    reply.first_token_at = reply.first_token_at or reply.arrivals[0]
                    reply.text += text
                    reply.tokens += 1
                    if reply.tokens == BEFORE:
                        reply.streaming.set()
    return reply


async def noisy_reply_begun(
    client: httpx.AsyncClient, base: str
) -> tuple[Key, Key, Reply, asyncio.Task[Reply]]:
    """The two keys, and the noisy key's long reply under way (its task)."""
    noisy = await make_key(client, base, "noisy")
    quiet = await make_key(client, base, "quiet")
    long = Reply()
    task = asyncio.create_task(stream_chat(client, base, noisy, "a long one", NOISY_TOKENS, long))
    return noisy, quiet, long, task


async def looks_while_nobody_waits(redis_url: str) -> int:
    """The full worker's looks at the queue over 0.4 s while no tenant waits: its waits
    for a newcomer and its preemption script's reads of the stream (XREVRANGE: only that
    script's), both every 20 ms while a tenant waits."""
    redis = connect(redis_url)
    try:
        looks = ("blpop", "xrevrange")
        before = [await command_calls(redis, command) for command in looks]
        await asyncio.sleep(0.4)
        after = [await command_calls(redis, command) for command in looks]
    finally:
        await redis.aclose()
    return sum(after) - sum(before)


@pytest.mark.parametrize(
    ("flag", "scheduler", "preempt"),
    [("--preempt", "fair", True), ("--no-preempt", "fair", False), ("--preempt", "fifo", False)],
    ids=["preempt", "no-preempt", "fifo"],
)
async def test_a_quiet_key_gets_the_busy_slot_at_once_and_the_stopped_reply_goes_on_whole(
    stack: Stack, flag: str, scheduler: str, preempt: bool
) -> None:
    """With ``--preempt`` and the fair queue, at once; without, or first come first served
    (every request in one list: nobody is owed a share), after the noisy reply's end."""
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY, TOKENSPOUT_SCHEDULER=scheduler)
    metrics = free_port()
    stack.synthetic(TOKENS_PER_S, "--capacity", "1", "--metrics-port", str(metrics), flag)
    async with httpx.AsyncClient(timeout=30) as client:
        noisy, quiet, long, noisy_reply = await noisy_reply_begun(client, gateway.url)
        async with asyncio.timeout(30):
            await long.streaming.wait()
        if preempt:
            assert await looks_while_nobody_waits(stack.redis_url) <= 2
        sent = time.monotonic()
        short = await stream_chat(client, gateway.url, quiet, "a short one", QUIET_TOKENS, Reply())
        await noisy_reply
        assert short.first_token_at is not None
        waited = short.first_token_at - sent
        left_s = (NOISY_TOKENS - BEFORE) / TOKENS_PER_S
        if preempt:
            assert waited < 0.5 * left_s, f"the quiet request waited {waited:.2f} s"
        else:
            assert waited > 0.5 * left_s, f"the quiet request waited only {waited:.2f} s"
        # Both replies whole, byte for byte the engine's script, each billed once.
        for reply, content, tokens, key in (
            (long, "a long one", NOISY_TOKENS, noisy),
            (short, "a short one", QUIET_TOKENS, quiet),
        ):
            assert reply.text == "".join(t.text for t in scripted_reply(content, tokens))
            assert reply.usage["completion_tokens"] == reply.tokens == tokens, reply.usage
            await until_usage(client, gateway.url, key.id, reply.usage["total_tokens"])
        samples = await scrape(client, f"http://127.0.0.1:{metrics}/metrics")
        assert value(samples, "tokenspout_engine_preemptions_total") == int(preempt)


async def test_a_stop_for_another_tenant_never_counts_against_the_takeover_budget(
    redis_server: EmbeddedRedis,
) -> None:
    """Taken over once already and stopped once for another tenant: with a budget of one
    takeover, a lost worker's reply is still taken over; one more loss exhausts it."""
    redis = connect(redis_server.url)
    keys = Keys("preempt-budget")
    takeover = Takeover(redis, keys)
    gen = keys.generation("s", "g")
    try:

        async def running_on(worker: str) -> None:
            await redis.hset(gen, mapping={"state": "running", "worker": worker})

        await running_on("w1")
        stopped = await takeover(
            session_id="s", generation_id="g", worker="w1", max_takeovers=1, preempted=True
        )
        assert isinstance(stopped, TakenOver)
        await running_on("w2")
        lost = await takeover(session_id="s", generation_id="g", worker="w2", max_takeovers=1)
        assert isinstance(lost, TakenOver)
        await running_on("w3")
        again = await takeover(session_id="s", generation_id="g", worker="w3", max_takeovers=1)
        assert isinstance(again, Exhausted)
        assert await redis.hmget(gen, "takeovers", "preempted") == [b"2", b"1"]
    finally:
        await redis.delete(gen)
        await redis.aclose()


async def until_tokens(reply: Reply, tokens: int) -> None:
    async with asyncio.timeout(30):
        while reply.tokens < tokens:
            await asyncio.sleep(0.01)


async def test_a_worker_lost_with_a_stopped_reply_has_both_replies_taken_over_whole(
    stack: Stack,
) -> None:
    """SIGKILL the worker while it keeps the reply it stopped (its request pending there)
    and runs the quiet one: the reaper hands both on to another worker, and each ends with
    exactly the engine's script, billed once."""
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    doomed = stack.synthetic(TOKENS_PER_S, "--capacity", "1", "--preempt")
    async with httpx.AsyncClient(timeout=30) as client:
        noisy = await make_key(client, gateway.url, "noisy")
        quiet = await make_key(client, gateway.url, "quiet")
        long, short = Reply(), Reply()
        replies = [
            asyncio.create_task(
                stream_chat(client, gateway.url, noisy, "a long one", NOISY_TOKENS, long)
            )
        ]
        await until_tokens(long, BEFORE)
        replies.append(
            asyncio.create_task(stream_chat(client, gateway.url, quiet, "a short one", 40, short))
        )
        await until_tokens(short, 3)
        stopped_at = long.tokens
        await until_tokens(short, 6)
        assert long.tokens == stopped_at < NOISY_TOKENS, "the long reply waits, stopped"
        stack.synthetic(TOKENS_PER_S, "--capacity", "1")
        await lease_trusted(stack.redis_url)
        processes.kill(doomed)
        async with asyncio.timeout(60):
            await asyncio.gather(*replies)
        for reply, content, tokens, key in (
            (long, "a long one", NOISY_TOKENS, noisy),
            (short, "a short one", 40, quiet),
        ):
            assert reply.text == "".join(t.text for t in scripted_reply(content, tokens))
            assert reply.usage["completion_tokens"] == tokens, reply.usage
            await until_usage(client, gateway.url, key.id, reply.usage["total_tokens"])


async def test_a_light_key_never_stops_another_and_a_free_slot_goes_to_it_before_a_stopped_reply(
    stack: Stack,
) -> None:
    """One slot. The noisy reply stops for quiet key A's; quiet key B's request comes while
    A's runs: A's reply is not stopped for it (A asks no more than its share), and when A's
    ends, the free slot goes to B before the noisy reply's continuation (the noisy key was
    served far more lately). Every reply whole, one stop in all.

    A's reply runs past the worker's next charge (once a second), so A's tokens reach the
    queue while it runs, at whatever point of it the charge falls. A stays under the level
    only while twice its tokens (its 22, when all are charged) stay under the noisy key's:
    the noisy reply runs 60 before A asks (65 charged, about 56 when A ends: they count
    half every 5 s)."""
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    metrics = free_port()
    stack.synthetic(TOKENS_PER_S, "--capacity", "1", "--metrics-port", str(metrics), "--preempt")
    async with httpx.AsyncClient(timeout=30) as client:
        noisy, a, b = [await make_key(client, gateway.url, name) for name in ("noisy", "a", "b")]
        long, first, second = Reply(), Reply(), Reply()
        asks = [(noisy, "a long one", 70, long)]
        tasks = [asyncio.create_task(stream_chat(client, gateway.url, *asks[0]))]
        await until_tokens(long, 60)
        asks.append((a, "quiet a", 20, first))
        tasks.append(asyncio.create_task(stream_chat(client, gateway.url, *asks[1])))
        await until_tokens(first, 5)
        asks.append((b, "quiet b", 10, second))
        tasks.append(asyncio.create_task(stream_chat(client, gateway.url, *asks[2])))
        async with asyncio.timeout(60):
            await asyncio.gather(*tasks)
        assert second.arrivals[0] > first.arrivals[-1], "A's reply was stopped for B's"
        # From A's second token (its first may race the stop's last noisy token) to B's last.
        during = [t for t in long.arrivals if first.arrivals[1] < t < second.arrivals[-1]]
        assert during == [], "the noisy reply waited for A's and then B's"
        for key, content, tokens, reply in asks:
            assert reply.text == "".join(t.text for t in scripted_reply(content, tokens))
            assert reply.usage["completion_tokens"] == tokens, reply.usage
            await until_usage(client, gateway.url, key.id, reply.usage["total_tokens"])
        samples = await scrape(client, f"http://127.0.0.1:{metrics}/metrics")
        assert value(samples, "tokenspout_engine_preemptions_total") == 1


async def test_a_stopped_reply_whose_stop_redis_lost_goes_on_whole(stack: Stack) -> None:
    """A crash lost the worker's stop of a reply for another tenant (its TAKEOVER) and the
    claim that went on with it: Redis says the reply runs on that worker at the epoch
    before, the worker runs it at the next, and Redis refuses its writes. No reaper hands
    on a live worker's reply, so the worker does (engine/jobs.py ``_hand_on_if_left_here``):
    the reply goes on from its events and ends whole, billed once (single Redis, seed 3:
    it stayed running for ever). The loss is made by writing the hash back to the epoch
    before, as a crash that loses the last writes leaves it."""
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    stack.synthetic(TOKENS_PER_S, "--capacity", "1", "--preempt")
    redis = connect(stack.redis_url)
    keys = Keys(stack.prefix)
    async with httpx.AsyncClient(timeout=30) as client:
        noisy, quiet, long, noisy_reply = await noisy_reply_begun(client, gateway.url)
        await until_tokens(long, BEFORE)
        gen = next(iter([key async for key in redis.scan_iter(match=keys.generation("*", "*"))]))
        await stream_chat(client, gateway.url, quiet, "a short one", QUIET_TOKENS, Reply())
        async with asyncio.timeout(30):  # going on at epoch 1, on the same worker
            while await redis.hmget(gen, "state", "takeovers") != [b"running", b"1"]:
                await asyncio.sleep(0.005)
        await redis.hset(gen, mapping={"takeovers": 0, "preempted": 0})
        async with asyncio.timeout(60):
            await noisy_reply
        assert long.text == "".join(t.text for t in scripted_reply("a long one", NOISY_TOKENS))
        assert long.usage["completion_tokens"] == long.tokens == NOISY_TOKENS, long.usage
        await until_usage(client, gateway.url, noisy.id, long.usage["total_tokens"])
        assert await redis.hmget(gen, "state", "takeovers") == [b"done", b"1"]
    await redis.aclose()
