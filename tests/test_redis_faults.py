"""Redis itself failing under a running reply: restarted with or without its data, or
frozen. Real processes, a real Redis of the test's own.

Each test states the guarantee of docs/reliability.md that it checks.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis

import wire
from bench.chaos.redises import aof_incr_file
from stack.procfs import tcp_local_ports_to
from stack.redis_server import EmbeddedRedis, free_port
from stack.rig import wait_worker
from tests.support.http import (
    TERMINAL,
    Reading,
    cancel,
    create_session,
    read_events,
    reply_under_way,
    send,
)
from tests.support.metrics import scrape
from tests.support.oracle import synthetic_text
from tests.support.redis_probes import event_key
from tests.support.sse import parse
from tests.support.stack import Stack
from wire import Keys

pytestmark = pytest.mark.timeout(180)


async def test_redis_restart_with_persistence_resumes_every_stream(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """Guarantee 4a: Redis restarts with its data (AOF): streams pause, then resume whole."""
    stack = Stack(restartable_redis.url, "restart", tmp_path)
    try:
        engine_port = free_port()
        stack.synthetic(25, "--metrics-port", str(engine_port))
        gateway = stack.gateway()
        metrics_urls = (f"{gateway.url}/metrics", f"http://127.0.0.1:{engine_port}/metrics")
        async with httpx.AsyncClient(timeout=30) as client:
            session = await create_session(client, gateway.url)
            generation = await send(client, session, "through a restart", max_tokens=100)
            errors_before = [await redis_errors(client, url) for url in metrics_urls]
            reading = Reading()
            reader = asyncio.create_task(
                read_events(
                    client, session, until_final_of=generation, reading=reading, timeout_s=90
                )
            )
            while len(reading.events) < 10:
                await asyncio.sleep(0.05)
            restartable_redis.stop()
            outage = await client.get(f"{gateway.url}/ready")
            assert outage.status_code == 503 and outage.json()["ready"] is False
            await asyncio.sleep(1.5)
            seen = len(reading.events)
            restartable_redis.start()
            back = time.monotonic()
            while len(reading.events) == seen and not reader.done():
                await asyncio.sleep(0.01)
            print(f"\nRedis back -> next event after {time.monotonic() - back:.2f} s")
            await reader  # the same SSE connection carries on
            assert reading.text(generation) == synthetic_text("through a restart", 100)
            ids = [event_key(e.id or "") for e in reading.events]
            assert ids == sorted(set(ids))
            # Both sides saw the outage and counted it.
            errors_after = [await redis_errors(client, url) for url in metrics_urls]
            for before, after, url in zip(errors_before, errors_after, metrics_urls, strict=True):
                assert after > before, f"{url}: Redis errors {before} -> {after}"
            await _a_new_session_works(client, gateway.url)
    finally:
        stack.stop()


async def redis_errors(client: httpx.AsyncClient, metrics_url: str) -> float:
    """``tokenspout_{gateway,engine}_redis_errors_total``, summed over ``where``."""
    samples = await scrape(client, metrics_url)
    return sum(
        count
        for (name, _), count in samples.items()
        if name in ("tokenspout_gateway_redis_errors_total", "tokenspout_engine_redis_errors_total")
    )


async def test_redis_restart_without_its_data_ends_streams_clearly(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """Guarantee 4b: Redis comes back empty: open streams end with `session_lost`,
    nothing crashes, and new sessions work."""
    stack = Stack(restartable_redis.url, "wiped", tmp_path)
    try:
        worker = stack.synthetic(tokens_per_s=25)
        gateway = stack.gateway()
        async with httpx.AsyncClient(timeout=30) as client:
            session = await create_session(client, gateway.url)
            await send(client, session, "into the void", max_tokens=200)
            await read_events(client, session, limit=5)
            frames: list[str] = []
            streaming = asyncio.Event()

            async def read_raw() -> None:
                async with client.stream(
                    "GET", session.events_url, headers=session.headers
                ) as response:
                    assert response.status_code == 200
                    streaming.set()
                    async for line in response.aiter_lines():
                        frames.append(line)

            reader = asyncio.create_task(read_raw())
            # The stream has started (its headers came) and its feed is live.
            await asyncio.wait_for(streaming.wait(), 30)
            await stack.wait_live_readers(session.session_id)
            restartable_redis.kill(wipe=True)
            restartable_redis.start()
            await asyncio.wait_for(reader, 30)  # the stream ends by itself
            assert "event: error" in frames
            assert any('"code":"session_lost"' in line for line in frames)
            await _a_new_session_works(client, gateway.url)
            assert worker.poll() is None and gateway.process.poll() is None
    finally:
        stack.stop()


async def _a_new_session_works(client: httpx.AsyncClient, base: str) -> None:
    deadline = time.monotonic() + 20
    while (await client.get(f"{base}/ready")).status_code != 200:
        assert time.monotonic() < deadline, "/ready did not recover"
        await asyncio.sleep(0.2)
    session = await create_session(client, base)
    generation = await send(client, session, "after the storm", max_tokens=4)
    reading = await read_events(client, session, until_final_of=generation)
    assert reading.text(generation) == synthetic_text("after the storm", 4)


async def test_api_streams_that_lose_their_session_end_in_their_own_error_format(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """Once the headers are out, a failure (here: Redis comes back empty, `session_lost`)
    ends each adapter's stream with its error frame instead of cutting it off."""
    stack = Stack(restartable_redis.url, "adapters", tmp_path)
    try:
        stack.synthetic(tokens_per_s=25)
        gateway = stack.gateway()
        streams = {
            "openai": (
                "/v1/chat/completions",
                {
                    "model": "synthetic",
                    "messages": [{"role": "user", "content": "into the void"}],
                    "max_tokens": 200,
                    "stream": True,
                },
            ),
            "tgi": (
                "/generate_stream",
                {"inputs": "into the void", "parameters": {"max_new_tokens": 200}},
            ),
            "oip": (
                "/v2/models/synthetic/generate_stream",
                {"text_input": "into the void", "parameters": {"max_tokens": 200}},
            ),
        }
        data: dict[str, list[str]] = {name: [] for name in streams}
        async with httpx.AsyncClient(timeout=30) as client:

            async def read(name: str) -> None:
                path, body = streams[name]
                async with client.stream("POST", gateway.url + path, json=body) as response:
                    assert response.status_code == 200
                    async for event in parse(response.aiter_lines()):
                        data[name].append(event.data)

            readers = [asyncio.create_task(read(name)) for name in streams]
            async with asyncio.timeout(30):
                while not all(len(events) >= 3 for events in data.values()):
                    await asyncio.sleep(0.05)
            restartable_redis.kill(wipe=True)
            restartable_redis.start()
            await asyncio.wait_for(asyncio.gather(*readers), 30)  # each ends by itself
            await _a_new_session_works(client, gateway.url)

        *_, error, done = data["openai"]
        assert done == "[DONE]"
        assert json.loads(error)["error"]["code"] == "session_lost"
        assert json.loads(error)["error"]["type"] == "invalid_request_error"
        tgi = json.loads(data["tgi"][-1])
        assert tgi["error_type"] == "generation" and "lost" in tgi["error"]
        assert "lost" in json.loads(data["oip"][-1])["error"]
        for name in ("tgi", "oip"):
            assert all("error" not in json.loads(item) for item in data[name][:-1])
    finally:
        stack.stop()


async def test_a_frozen_redis_is_waited_for_and_ready_says_so(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """Redis stops answering but closes nothing (SIGSTOP: a stalled host or a long script).
    Commands have no timeout of their own (wire/connect.py: redis-py's 5 s one cost a
    request 8-10 % of its CPU), so nothing gives up and retries: while it is frozen for
    longer than that, ``/ready`` answers 503 within its own 5 s bound; once Redis answers
    again the reply goes on, whole, on the same connection."""
    stack = Stack(restartable_redis.url, "frozen", tmp_path)
    try:
        stack.synthetic(25)
        gateway = stack.gateway()
        async with httpx.AsyncClient(timeout=30) as client:
            _, generation, follower = await reply_under_way(
                client, gateway.url, "through a freeze", 8, max_tokens=100
            )
            assert restartable_redis.process is not None
            pid = restartable_redis.process.pid
            os.kill(pid, signal.SIGSTOP)
            try:
                began = time.monotonic()
                frozen = await client.get(f"{gateway.url}/ready")
                answered_s = time.monotonic() - began
                await asyncio.sleep(max(0.0, 7.0 - answered_s))  # past redis-py's 5 s
            finally:
                os.kill(pid, signal.SIGCONT)
            assert frozen.status_code == 503, frozen.text
            assert "did not answer within 5 s" in frozen.json()["redis"]
            assert answered_s < 7.0, answered_s
            await follower.until_end(90)
            reading = follower.reading
            assert reading.final(generation).event == "done"
            assert reading.text(generation) == synthetic_text("through a freeze", 100)
            ids = [event_key(e.id or "") for e in reading.events]
            assert ids == sorted(set(ids))
            assert (await client.get(f"{gateway.url}/ready")).status_code == 200
    finally:
        stack.stop()


async def test_a_worker_started_while_redis_is_down_waits_for_it_then_serves(
    tmp_path: Path,
) -> None:
    """A worker (and a gateway) started while Redis is away (restarting, failing over, not
    up yet) waits for it, saying so, and serves once it answers. Found by the chaos run: a
    worker started during a Redis restart ended with a ConnectionRefusedError traceback."""
    server = EmbeddedRedis(data_dir=tmp_path / "redis")  # not started yet
    server.data_dir.mkdir()
    stack = Stack(server.url, "late", tmp_path)
    try:
        gateway = stack.gateway()
        worker = stack.engine(
            "--backend", "synthetic", "--tokens-per-s", "200", worker_id="late", wait=False
        )
        log = tmp_path / "engine-late.log"
        deadline = time.monotonic() + 60
        while "Redis does not answer" not in (log.read_text() if log.exists() else ""):
            assert worker.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the worker never said it was waiting"
            await asyncio.sleep(0.1)
        with server:
            await asyncio.to_thread(wait_worker, server.url, stack.prefix, "late", worker, 30)
            async with httpx.AsyncClient(timeout=30) as client:
                await _a_new_session_works(client, gateway.url)
            assert worker.poll() is None
            stack.stop()
    finally:
        stack.stop()


async def test_a_worker_stopped_while_redis_restarts_still_hands_its_reply_on(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """SIGTERM a worker while Redis restarts: its hand-over fails, is tried again once
    Redis is back, and the reply moves to the other worker and ends whole. Found by the
    chaos soak: a hand-over that failed (a stale connection after a Redis restart) was never
    tried again, the worker dropped every later token, acknowledged the request and left,
    and the reply stayed running with no end: its reader waited forever."""
    stack = Stack(restartable_redis.url, "stale", tmp_path)
    try:
        first = stack.synthetic(25, "--drain-s", "5", worker_id="first")
        gateway = stack.gateway()
        async with httpx.AsyncClient(timeout=30) as client:
            _, gid, reader = await reply_under_way(
                client, gateway.url, "over a restart", 10, max_tokens=100
            )
            stack.synthetic(25, "--drain-s", "5", worker_id="second")
            restartable_redis.stop()
            first.send_signal(signal.SIGTERM)  # its hand-over meets no Redis
            await asyncio.sleep(1)
            restartable_redis.start()
            await reader.until_end(60)
        assert reader.reading.final(gid).event == "done"
        assert reader.reading.text(gid) == synthetic_text("over a restart", 100)
    finally:
        stack.stop()


async def test_a_hand_over_that_fails_is_tried_again(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """SIGTERM a worker whose connections Redis has closed and refuses to reopen (past
    redis-py's retries): its hand-over fails, and is tried again once Redis takes
    connections, so the reply moves to the other worker. Found by the chaos soak: a failed
    hand-over was never tried again; the worker dropped every later token, acknowledged the
    request and left, and the reply stayed running with no end, its reader waiting forever."""
    stack = Stack(restartable_redis.url, "refused", tmp_path)
    admin = redis.Redis(port=restartable_redis.port)
    try:
        first = stack.synthetic(25, "--drain-s", "40", worker_id="first")
        gateway = stack.gateway()
        async with httpx.AsyncClient(timeout=30) as client:
            session = await create_session(client, gateway.url)
            gid = await send(client, session, "hold [[stall]]", max_tokens=50)
            await read_events(client, session, until_event="started")
            stack.synthetic(25, "--drain-s", "5", worker_id="second")
            lease = next(c for c in admin.client_list() if c["name"] == wire.lease_name("first"))
            lease_port = int(lease["addr"].rsplit(":", 1)[1])
            admin.config_set("maxclients", 1)  # no new connection, from anyone
            for port in tcp_local_ports_to(first.pid, restartable_redis.port):
                if port != lease_port:
                    admin.client_kill_filter(_type=None, addr=f"127.0.0.1:{port}")
            first.send_signal(signal.SIGTERM)
            await asyncio.sleep(10)  # past the retries of the hand-over's first attempt
            admin.config_set("maxclients", 10000)
            reading = await read_events(client, session, until_event="resumed", timeout_s=30)
            assert (
                admin.hget(Keys(stack.prefix).generation(session.session_id, gid), "worker")
                == b"second"
            )
            assert not [e for e in reading.events if e.event in TERMINAL]
            await cancel(client, session, gid)
    finally:
        admin.close()
        stack.stop()


async def test_a_worker_resumed_after_a_redis_restart_announces_itself_before_taking_work(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """The only worker is SIGSTOPped mid-reply, Redis restarts meanwhile, and the worker
    resumes past the worker timeout: the reaper has taken the reply over (the worker's lease
    and heartbeat are gone); the worker heartbeats before it takes work again, so it takes
    the continuation and finishes the reply whole. Found by the chaos soak: the resumed
    worker took the continuation on its stale connections before its next heartbeat, the
    reaper (still seeing it silent) took it away again, three times in 0.4 s, and the
    reply ended `worker_lost`."""
    stack = Stack(restartable_redis.url, "wake", tmp_path)
    try:
        worker = stack.synthetic(25)
        gateway = stack.gateway()
        async with httpx.AsyncClient(timeout=30) as client:
            _, gid, reader = await reply_under_way(
                client, gateway.url, "sleep and wake", 10, max_tokens=60
            )
            os.killpg(worker.pid, signal.SIGSTOP)
            try:
                restartable_redis.stop()
                restartable_redis.start()
                await asyncio.sleep(6.5)  # past TOKENSPOUT_WORKER_TIMEOUT_S (5 s)
            finally:
                os.killpg(worker.pid, signal.SIGCONT)
            await reader.until_end(60)
        assert reader.reading.final(gid).event == "done", reader.reading.final(gid)
        assert reader.reading.text(gid) == synthetic_text("sleep and wake", 60)
    finally:
        stack.stop()


async def test_a_worker_whose_heartbeat_a_write_pause_held_up_announces_itself_before_taking_work(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """Redis holds every write for 8 s (``CLIENT PAUSE WRITE``) mid-reply. The worker's
    heartbeat waits out the pause and lands with the time it was sent, past the worker
    timeout. The worker counts that heartbeat as old as the others see it and heartbeats
    again before it takes work: the reaper (whose reads went on) takes the reply over once
    if its pass comes first, and not at all when the worker's next heartbeat does (tens of
    ms after the pause, its take returning as the pause ends); the reply finishes whole.
    Found by the chaos run on a Redis Cluster: the worker counted a held-up heartbeat fresh
    from its reply, took continuations while the reaper still saw its old score, and a
    reply was taken over three times in 0.3 s and ended ``worker_lost``."""
    stack = Stack(restartable_redis.url, "held", tmp_path)
    admin = redis.Redis.from_url(restartable_redis.url)
    try:
        stack.synthetic(25)
        gateway = stack.gateway()
        async with httpx.AsyncClient(timeout=30) as client:
            # 12 s at 25 tokens/s: the reply outlasts the pause.
            _, gid, reader = await reply_under_way(
                client, gateway.url, "a held heartbeat", 10, max_tokens=300
            )
            admin.execute_command("CLIENT", "PAUSE", 8_000, "WRITE")
            await reader.until_end(60)
        reading = reader.reading
        assert reading.final(gid).event == "done", reading.final(gid)
        assert reading.text(gid) == synthetic_text("a held heartbeat", 300)
        takeovers = [e.json() for e in reading.of(gid) if e.event == "resumed"]
        assert len(takeovers) <= 1, takeovers
    finally:
        admin.close()
        stack.stop()


async def test_a_redis_at_its_maxmemory_holds_replies_refuses_new_ones_then_serves(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """Redis at its ``maxmemory`` (no eviction, the default) refuses every write that needs
    memory (``OOM``): a running reply waits (its worker retries its writes), a new message
    is answered 503 with ``Retry-After``; once memory is free again the reply goes on,
    whole, and new work is served. Found by the chaos run: a worker whose request-taking
    script was refused with ``OOM`` ended (its consume loop let the error through)."""
    stack, admin = (
        Stack(restartable_redis.url, "full", tmp_path),
        redis.Redis(port=restartable_redis.port),
    )
    try:
        gateway, worker = stack.gateway(), stack.synthetic(25)
        async with httpx.AsyncClient(timeout=30) as client:
            _, gid, reader = await reply_under_way(
                client, gateway.url, "a full Redis", 10, max_tokens=100
            )
            used = int(admin.info("memory")["used_memory"])
            admin.config_set("maxmemory", used + 64 * 1024)
            try:
                async with asyncio.timeout(10):  # the reply's writes fill what is left
                    refused = await _refused_at_maxmemory(client, gateway.url)
                assert refused.status_code == 503 and "retry-after" in refused.headers
                await asyncio.sleep(3)  # the worker meets OOM on every take meanwhile
                assert worker.poll() is None, "the worker ended at Redis's maxmemory"
            finally:
                admin.config_set("maxmemory", 0)
            await reader.until_end(60)
            await _a_new_session_works(client, gateway.url)
        assert reader.reading.final(gid).event == "done"
        assert reader.reading.text(gid) == synthetic_text("a full Redis", 100)
        assert worker.poll() is None
    finally:
        admin.close()
        stack.stop()


async def _refused_at_maxmemory(client: httpx.AsyncClient, base: str) -> httpx.Response:
    """New sessions and messages until one is refused (a write that needs memory)."""
    while True:
        made = await client.post(f"{base}/v1/sessions")
        if made.status_code != 201:
            return made
        sid, token = made.json()["session_id"], made.json()["token"]
        sent = await client.post(
            f"{base}/v1/sessions/{sid}/messages",
            json={"content": "no room", "max_tokens": 2},
            headers={"X-Session-Token": token},
        )
        if sent.status_code != 202:
            return sent
        await asyncio.sleep(0.1)


async def test_a_reply_whose_end_a_crashed_redis_lost_is_ended_again_by_its_worker(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """Redis's host crashes right after a reply ended: back from its AOF, Redis lacks what
    the last fsync did not cover (here: the reply's last tokens and its end, cut from the
    AOF as a crash would). Its worker, finding Redis was away, writes its recent final
    events again: the reply, which would otherwise run for ever with no end (its worker
    moved on), ends ``events_lost`` after the tokens Redis kept, and a reader is told at
    once. Found by the chaos run's host crashes."""
    stack = Stack(restartable_redis.url, "crashed", tmp_path)
    try:
        gateway, _ = stack.gateway(), stack.synthetic(50)
        async with httpx.AsyncClient(timeout=30) as client:
            session, gid, reader = await reply_under_way(
                client, gateway.url, "lost at the end", 10, max_tokens=40
            )
            incr = aof_incr_file(restartable_redis.data_dir)
            assert incr is not None
            synced = incr.stat().st_size  # the last fsync, 30 tokens before the end
            await reader.until_end(30)
            restartable_redis.kill()
            with incr.open("r+b") as aof:
                aof.truncate(synced)
            restartable_redis.start()
            back = time.monotonic()
            key = Keys(stack.prefix).generation(session.session_id, gid)
            with redis.Redis(port=restartable_redis.port) as admin:
                async with asyncio.timeout(10):
                    while admin.hget(key, "final") is None:
                        await asyncio.sleep(0.05)
            print(f"\nended again {time.monotonic() - back:.2f} s after Redis was back")
            again = await read_events(client, session, until_final_of=gid, timeout_s=10)
        final = again.final(gid)
        assert (final.event, final.json()["code"]) == ("error", "events_lost"), final
        counts = [e.json()["count"] for e in again.of(gid) if e.event == "token"]
        assert counts == list(range(1, len(counts) + 1)) and 0 < len(counts) < 40
    finally:
        stack.stop()


async def test_a_turn_whose_submit_a_crashed_redis_lost_is_submitted_again(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """A message answered 202, then Redis's host crashes before its AOF was synced: Redis
    comes back without the turn (its generation, its message, its request), and its reader
    has no event to tell it so. The gateway that answered it looks once more 2.5 s later,
    finds the generation gone and submits it again as it was: the reader gets the whole
    reply, under the generation id it was given. Found by the chaos run's host crashes."""
    stack = Stack(restartable_redis.url, "resubmit", tmp_path)
    try:
        gateway = stack.gateway()
        # It takes the request and prepares it 3 s: the crash comes before its claim.
        stack.synthetic(50, "--prepare-delay-s", "3")
        async with httpx.AsyncClient(timeout=30) as client:
            session = await create_session(client, gateway.url)
            await asyncio.sleep(1.5)  # the session itself is on disk
            incr = aof_incr_file(restartable_redis.data_dir)
            assert incr is not None
            synced = incr.stat().st_size
            gid = await send(client, session, "lost in the crash", max_tokens=12)
            restartable_redis.kill()
            with incr.open("r+b") as aof:
                aof.truncate(synced)
            restartable_redis.start()
            reading = await read_events(client, session, until_final_of=gid, timeout_s=20)
        assert reading.final(gid).event == "done"
        assert reading.text(gid) == synthetic_text("lost in the crash", 12)
    finally:
        stack.stop()


async def test_with_wait_aof_each_submit_is_on_the_aofs_disk_before_it_is_answered(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """``TOKENSPOUT_WAIT_AOF=1`` (gateway/core/store/durable.py): every submit, a session
    message and a one-shot request alike, asks Redis for ``WAITAOF 1 0`` before its client
    is answered; a gateway without the setting never does. Both replies come whole."""
    stack = Stack(restartable_redis.url, "waitaof", tmp_path)
    admin = redis.Redis.from_url(restartable_redis.url)

    def waitaofs() -> int:
        stats = admin.info("commandstats").get("cmdstat_waitaof", {})
        return int(stats.get("calls", 0))

    try:
        stack.synthetic(200)
        sides = [(stack.gateway(), 0), (stack.gateway(TOKENSPOUT_WAIT_AOF="1"), 2)]
        async with httpx.AsyncClient(timeout=30) as client:
            for gateway, asked in sides:
                before = waitaofs()
                session = await create_session(client, gateway.url)
                gid = await send(client, session, "kept", max_tokens=3)
                reading = await read_events(client, session, until_final_of=gid)
                assert reading.events[-1].event == "done"
                body = {"model": "synthetic", "messages": [{"role": "user", "content": "kept"}]}
                answer = await client.post(
                    f"{gateway.url}/v1/chat/completions", json=body | {"max_tokens": 3}
                )
                assert answer.json()["choices"][0]["message"]["content"] == synthetic_text(
                    "kept", 3
                )
                assert waitaofs() - before == asked, gateway.url
    finally:
        admin.close()
        stack.stop()
