"""One suite, both backends (engine/backends/base.py): streaming, turns, and every cancel path,
over real gateway processes and real Redis, with the synthetic engine and with vLLM on the CPU.

Each test gets an ``EngineUnderTest``: a gateway URL, the worker's Prometheus ``/metrics``
(``tokenspout_engine_running``: requests the inference engine itself holds) and ways to start
more gateways on the same Redis key prefix. The vLLM worker is the session's ``vllm_stack``
(capacity 8), shared by every vLLM test: each test waits for it to be idle first.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from engine.model import MODEL_NAME
from stack.redis_server import free_port
from tests.support.http import Session, all_of, cancel, create_session, read_events, send
from tests.support.metrics import sample, scrape_blocking, value
from tests.support.redis_probes import after_final, stream_events
from tests.support.sse import parse
from tests.support.stack import Gateway, Stack, VllmStack
from tests.support.ws import is_final, open_ws
from wire import CONSUMER_GROUP, Keys

pytestmark = pytest.mark.timeout(900)

LONG = 1500
"""max_tokens of a generation every test cancels: minutes of decoding for vLLM here (10-20
tokens/s) and 75 s for the synthetic engine, so it cannot end by itself during the test."""
SYNTHETIC_TOKENS_PER_S = 20
STOP_WITHIN_S = 10.0
"""How soon after a cancel the engine must hold no request: one decode step is well under a
second; the rest is slack for a shared CPU and the worker's 1 s metrics refresh."""
PROMPT = "Write a long story about a lighthouse keeper, the sea and a storm."
RUNNING = "tokenspout_engine_running"
WASTE = "tokenspout_engine_tokens_after_cancel_total"
CANCELS = "tokenspout_engine_cancels_total"


def engine_arg(process: subprocess.Popen[bytes], flag: str) -> str:
    args = [str(arg) for arg in process.args]  # type: ignore[union-attr]
    return args[args.index(flag) + 1]


def metric(port: str, name: str, unset: float | None = None, **labels: str) -> float:
    """A sample of the worker's Prometheus ``/metrics`` (a counter's ``_total``); ``unset``
    for a labelled counter that has no sample yet."""
    samples = scrape_blocking(f"http://127.0.0.1:{port}/metrics")
    if unset is not None and sample(samples, name, **labels) is None:
        return unset
    return value(samples, name, **labels)


@dataclass
class EngineUnderTest:
    backend: str
    stack: Stack
    gateway: Gateway
    process: subprocess.Popen[bytes]
    short_max_tokens: int
    """max_tokens of a generation that ends by itself, cheap on either engine."""
    sampling: dict[str, Any] = field(default_factory=dict)
    _gateways: dict[str, Gateway] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def model(self) -> str:
        return "synthetic" if self.backend == "synthetic" else MODEL_NAME

    @property
    def capacity(self) -> int:
        return int(engine_arg(self.process, "--capacity"))

    def metric(self, name: str, unset: float | None = None, **labels: str) -> float:
        return metric(engine_arg(self.process, "--metrics-port"), name, unset, **labels)

    async def running(self) -> int:
        """Requests the engine holds unfinished (refreshed by the worker every second)."""
        return int(await asyncio.to_thread(self.metric, RUNNING))

    async def wait_running(self, value: int, timeout_s: float = 120) -> None:
        async with asyncio.timeout(timeout_s):
            while await self.running() != value:
                await asyncio.sleep(0.1)

    async def stops(self, since: float, case: str, within_s: float = STOP_WITHIN_S) -> float:
        """The engine holds no request within ``within_s`` of ``since``; the seconds it took."""
        while (running := await self.running()) != 0:
            elapsed = time.monotonic() - since
            assert elapsed < within_s, f"the engine still runs {running} after {elapsed:.1f} s"
            await asyncio.sleep(0.05)
        elapsed = time.monotonic() - since
        print(f"\n{self.backend} {case}: engine idle {elapsed:.2f} s after")
        return elapsed

    def extra_gateway(self, name: str, **env: str) -> Gateway:
        """Another gateway process on the same Redis and key prefix (started once per stack)."""
        if name not in self._gateways:
            self._gateways[name] = self.stack.gateway(**env)
        return self._gateways[name]


_vllm_gateways: dict[str, dict[str, Gateway]] = {}
"""Extra gateways of the session's vLLM stack (by key prefix), kept as long as the stack is."""


@pytest.fixture(
    params=[
        pytest.param("synthetic", id="synthetic"),
        pytest.param("vllm", id="vllm", marks=pytest.mark.vllm),
    ]
)
def engine(request: pytest.FixtureRequest) -> Iterator[EngineUnderTest]:
    if request.param == "synthetic":
        stack: Stack = request.getfixturevalue("stack")
        # Capacity 1: one long generation fills the worker for the cancel-while-queued case;
        # every other test runs one generation at a time.
        process = stack.synthetic(
            SYNTHETIC_TOKENS_PER_S, "--capacity", "1", "--metrics-port", str(free_port())
        )
        yield EngineUnderTest("synthetic", stack, stack.gateway(), process, short_max_tokens=20)
        return
    vllm: VllmStack = request.getfixturevalue("vllm_stack")
    under_test = EngineUnderTest(
        "vllm",
        vllm.stack,
        vllm.gateway,
        vllm.engine,
        short_max_tokens=20,
        sampling={"temperature": 0},
        _gateways=_vllm_gateways.setdefault(vllm.stack.prefix, {}),
    )
    # A test that failed half-way may have left requests in the shared engine.
    deadline = time.monotonic() + 60
    while under_test.metric(RUNNING) != 0:
        assert time.monotonic() < deadline, "the shared vLLM engine stays busy"
        time.sleep(0.2)
    yield under_test


async def rest_cancel(client: httpx.AsyncClient, session: Session, gid: str) -> dict[str, Any]:
    body = await cancel(client, session, gid)
    assert body["generation_id"] == gid
    return body


async def nothing_after_the_final(engine: EngineUnderTest, session_id: str, gid: str) -> None:
    """In Redis, the generation has exactly one final event and nothing after it."""
    await asyncio.sleep(1.0)  # anything the engine still made would be in Redis by now
    events = await stream_events(engine.stack.redis_url, engine.stack.prefix, session_id)
    kinds = [e[b"t"] for e in events if e[b"g"].decode() == gid]
    assert sum(k in (b"done", b"cancelled", b"error") for k in kinds) == 1, kinds
    assert after_final(events, gid) == []


def check_partial_usage(final: dict[str, Any], tokens: list[dict[str, Any]]) -> None:
    """A cancelled generation's usage counts exactly the tokens delivered before it."""
    assert final["type"] == "cancelled" and final["reason"] == "user", final
    assert final["usage"]["completion_tokens"] == tokens[-1]["count"] >= 3
    assert final["usage"]["completion_tokens"] < LONG
    assert final["usage"]["prompt_tokens"] > 0


async def test_a_reply_streams_in_token_events_and_the_second_turn_sees_the_first(
    engine: EngineUnderTest,
) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, engine.url)
        n = engine.short_max_tokens
        first = await send(client, session, "Name three colours.", max_tokens=n, **engine.sampling)
        reading = await read_events(client, session, until_final_of=first, timeout_s=300)
        kinds = [e.event for e in reading.of(first)]
        assert kinds[:2] == ["queued", "started"] and kinds[-1] == "done", kinds
        tokens = [e.json() for e in reading.of(first) if e.event == "token"]
        assert len(tokens) >= 3 and set(kinds[2:-1]) == {"token"}, kinds
        counts = [t["count"] for t in tokens]
        assert counts == sorted(set(counts))
        assert counts[-1] == sum(len(t["token_ids"]) for t in tokens)
        done = reading.final(first).json()
        started = reading.of(first)[1].json()
        assert done["usage"] == {
            "prompt_tokens": started["prompt_tokens"],
            "completion_tokens": counts[-1],
        }
        assert done["finish_reason"] in ("stop", "length")
        assert (done["finish_reason"] == "length") == (counts[-1] == n)
        answer = reading.text(first)
        assert answer.strip()

        second = await send(client, session, "And two more?", max_tokens=n, **engine.sampling)
        more = await read_events(
            client,
            session,
            until_final_of=second,
            last_event_id=reading.events[-1].id,
            timeout_s=300,
        )
        assert more.final(second).event == "done"
        started_again = next(e.json() for e in more.of(second) if e.event == "started")
        # The second prompt holds the first question and its answer.
        grown = started_again["prompt_tokens"] - started["prompt_tokens"]
        assert grown >= done["usage"]["completion_tokens"]

        view = await client.get(
            f"{engine.url}/v1/sessions/{session.session_id}", headers=session.headers
        )
        messages = view.json()["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
        assert messages[1]["content"] == answer


async def test_a_rest_cancel_after_the_third_token_stops_the_engine(
    engine: EngineUnderTest,
) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, engine.url)
        gid = await send(client, session, PROMPT, max_tokens=LONG, **engine.sampling)
        reading = await read_events(client, session, limit=5, timeout_s=300)
        assert [e.event for e in reading.events] == ["queued", "started", "token", "token", "token"]
        await engine.wait_running(1)
        waste, cancels = engine.metric(WASTE), engine.metric(CANCELS, unset=0, reason="user")

        sent = time.monotonic()
        answer = await rest_cancel(client, session, gid)
        print(f"\n{engine.backend} REST cancel answered in {time.monotonic() - sent:.3f} s")
        assert answer["state"] == "cancelled", answer
        await read_events(
            client,
            session,
            until_final_of=gid,
            reading=reading,
            last_event_id=reading.events[-1].id,
        )
        await engine.stops(sent, "REST cancel")

        final = reading.final(gid)
        assert reading.events[-1] is final and final.json() == answer["final"]
        check_partial_usage(final.json(), [e.json() for e in reading.of(gid) if e.event == "token"])
        # At most one decode step's worth of tokens made after the worker got the cancel.
        assert engine.metric(WASTE) - waste <= 1
        assert engine.metric(CANCELS, reason="user") == cancels + 1
        await nothing_after_the_final(engine, session.session_id, gid)


async def test_a_websocket_cancel_after_the_third_token_stops_the_engine(
    engine: EngineUnderTest,
) -> None:
    ws = await open_ws(engine.url)
    try:
        ack = await ws.generate("story", PROMPT, max_tokens=LONG, **engine.sampling)
        assert ack["type"] == "ack", ack
        await ws.until(
            lambda f: f.get("id") == "story" and f["type"] == "token" and f["count"] >= 3,
            timeout_s=300,
        )
        await engine.wait_running(1)
        waste = engine.metric(WASTE)

        sent = time.monotonic()
        await ws.send(type="cancel", id="story")
        # The ack and the cancelled frame may come in either order.
        cancel_ack = await ws.until(lambda f: f["type"] == "ack" and f.get("op") == "cancel")
        assert cancel_ack["state"] in ("cancelling", "cancelled"), cancel_ack
        final = await ws.final_of("story", timeout_s=60)
        print(f"\n{engine.backend} WebSocket cancelled frame {time.monotonic() - sent:.3f} s on")
        await engine.stops(sent, "WebSocket cancel")
        check_partial_usage(final, ws.tokens("story"))

        await ws.send(type="cancel", id="story")  # twice: the final state again, no error
        again = await ws.until(lambda f: f["type"] == "ack" and f.get("op") == "cancel")
        assert again["state"] == "cancelled", again
        with contextlib.suppress(TimeoutError):  # frames that would follow come by now
            while True:
                await ws.recv(timeout_s=1.0)
        frames = ws.frames["story"]
        assert not [f for f in frames[frames.index(final) + 1 :] if f["type"] != "ack"], frames
        assert sum(is_final(f) for f in frames) == 1
        assert engine.metric(WASTE) - waste <= 1
    finally:
        await ws.conn.close()

    # The session's SSE stream carries the same generation and the same single final event.
    session = Session(engine.url, ack["session_id"], ack["token"])
    gid = ack["generation_id"]
    async with httpx.AsyncClient(timeout=60) as client:
        reading = await read_events(client, session, until_final_of=gid)
    assert reading.text(gid) == ws.text("story") != ""
    assert reading.final(gid).id == final["event_id"]
    await nothing_after_the_final(engine, session.session_id, gid)


async def test_a_cancel_through_gateway_b_ends_the_stream_read_through_gateway_a(
    engine: EngineUnderTest,
) -> None:
    gateway_b = engine.extra_gateway("b")
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, engine.url)
        via_b = Session(gateway_b.url, session.session_id, session.token)
        gid = await send(client, session, PROMPT, max_tokens=LONG, **engine.sampling)
        reading = await read_events(client, session, limit=5, timeout_s=300)
        assert reading.events[-1].event == "token"
        await engine.wait_running(1)

        sent = time.monotonic()
        reader = asyncio.create_task(
            read_events(
                client,
                session,
                until_final_of=gid,
                reading=reading,
                last_event_id=reading.events[-1].id,
            )
        )
        answer = await rest_cancel(client, via_b, gid)
        await reader
        print(f"\n{engine.backend} cancelled on gateway A {time.monotonic() - sent:.3f} s on")
        await engine.stops(sent, "cancel through gateway B")
        assert answer["state"] == "cancelled", answer
        final = reading.final(gid)
        assert reading.events[-1] is final and final.json() == answer["final"]
        check_partial_usage(final.json(), [e.json() for e in reading.of(gid) if e.event == "token"])
        await nothing_after_the_final(engine, session.session_id, gid)


async def test_cancelling_twice_answers_the_final_state_again(engine: EngineUnderTest) -> None:
    gateway_b = engine.extra_gateway("b")
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, engine.url)
        gid = await send(client, session, PROMPT, max_tokens=LONG, **engine.sampling)
        reading = await read_events(client, session, limit=5, timeout_s=300)
        assert reading.events[-1].event == "token"
        cancels = engine.metric(CANCELS, unset=0, reason="user")

        first = await rest_cancel(client, session, gid)
        second = await rest_cancel(
            client, Session(gateway_b.url, session.session_id, session.token), gid
        )
        assert first["state"] == "cancelled" and second == first
        await engine.wait_running(0, timeout_s=STOP_WITHIN_S)
        assert engine.metric(CANCELS, reason="user") == cancels + 1  # one abort, not two
        await nothing_after_the_final(engine, session.session_id, gid)


async def test_a_cancel_after_done_answers_done(engine: EngineUnderTest) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, engine.url)
        n = engine.short_max_tokens
        gid = await send(client, session, "Say hello.", max_tokens=n, **engine.sampling)
        reading = await read_events(client, session, until_final_of=gid, timeout_s=300)
        done = reading.final(gid).json()
        assert done["type"] == "done"

        late = await rest_cancel(client, session, gid)
        assert late == {"generation_id": gid, "state": "done", "final": done}
        assert await rest_cancel(client, session, gid) == late
        await nothing_after_the_final(engine, session.session_id, gid)


async def test_a_generation_nobody_reads_is_abandoned_after_a_short_grace(
    engine: EngineUnderTest,
) -> None:
    gateway = engine.extra_gateway("grace", TOKENSPOUT_ABANDON_GRACE_S="2")
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, gateway.url)
        gid = await send(client, session, PROMPT, max_tokens=LONG, **engine.sampling)
        seen = 0
        async with client.stream("GET", session.events_url, headers=session.headers) as response:
            assert response.status_code == 200
            async with asyncio.timeout(300):
                async for event in parse(response.aiter_lines()):
                    if event.event == "token":
                        seen = event.json()["count"]
                        if seen >= 3:
                            break
            await engine.wait_running(1)
        left = time.monotonic()  # the client is gone; nobody else reads the session

        # Grace (2 s) plus the watch's expiry and the worker's 1 s check, with slack.
        await engine.stops(left, "abandoned after disconnect (grace 2 s)", within_s=30)
        reading = await read_events(client, session, until_final_of=gid)
        final = reading.final(gid)
        assert final.event == "cancelled" and final.json()["reason"] == "abandoned"
        # The disconnect itself did not end it: it ran on until the grace was over.
        assert seen < final.json()["usage"]["completion_tokens"] < LONG
        await nothing_after_the_final(engine, session.session_id, gid)


async def test_a_generation_cancelled_while_queued_never_reaches_the_engine(
    engine: EngineUnderTest,
) -> None:
    capacity = engine.capacity
    peak = {"engine": 0, "worker": 0}

    async def sample() -> None:
        while True:
            peak["engine"] = max(peak["engine"], await engine.running())
            worker = await asyncio.to_thread(engine.metric, "tokenspout_engine_generations_running")
            peak["worker"] = max(peak["worker"], int(worker))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    limits = httpx.Limits(max_connections=50)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        try:
            # Fill the worker with long generations, each seen running.
            async def long_one(index: int) -> tuple[Session, str]:
                session = await create_session(client, engine.url)
                content = f"{PROMPT} Number {index}."
                gid = await send(client, session, content, max_tokens=LONG, **engine.sampling)
                reading = await read_events(client, session, limit=3, timeout_s=300)
                assert [e.event for e in reading.events] == ["queued", "started", "token"]
                return session, gid

            running = await all_of(*(long_one(i) for i in range(capacity)))
            await engine.wait_running(capacity)

            queued = await create_session(client, engine.url)
            gid = await send(client, queued, "Wait your turn.", max_tokens=LONG, **engine.sampling)
            reading = await read_events(client, queued, limit=1)
            assert reading.events[0].event == "queued"
            answer = await rest_cancel(client, queued, gid)
            assert answer["state"] == "cancelled", answer
            assert answer["final"]["reason"] == "user"
            assert answer["final"]["usage"] == {"prompt_tokens": 0, "completion_tokens": 0}
            await read_events(
                client,
                queued,
                until_final_of=gid,
                reading=reading,
                last_event_id=reading.events[-1].id,
            )
            assert [e.event for e in reading.events] == ["queued", "cancelled"]
            assert reading.events[1].json() == answer["final"]

            sent = time.monotonic()
            answers = await all_of(*(rest_cancel(client, s, g) for s, g in running))
            assert {a["state"] for a in answers} <= {"cancelled", "cancelling"}, answers
            await engine.stops(sent, f"{capacity} cancels at once", within_s=30)
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler

    # The worker took the cancelled request off the queue when a slot freed, and skipped it.
    redis = aioredis.Redis.from_url(engine.stack.redis_url)
    try:
        async with asyncio.timeout(30):
            while True:
                groups = await redis.xinfo_groups(Keys(engine.stack.prefix).requests(engine.model))
                group = next(g for g in groups if g["name"].decode() == CONSUMER_GROUP)
                if group["lag"] == 0 and group["pending"] == 0:
                    break
                await asyncio.sleep(0.1)
    finally:
        await redis.aclose()
    events = await stream_events(engine.stack.redis_url, engine.stack.prefix, queued.session_id)
    assert [e[b"t"] for e in events if e[b"g"].decode() == gid] == [b"queued", b"cancelled"]
    assert peak == {"engine": capacity, "worker": capacity}, peak
