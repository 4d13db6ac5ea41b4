"""``WS /v1/ws`` (gateway/apis/sessions/socket.py, gateway/apis/sessions/protocol.py) over a
real gateway process, real Redis and the synthetic engine."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from websockets.exceptions import ConnectionClosedError

from tests.support.http import Session, create_session, read_events, send
from tests.support.oracle import synthetic_text
from tests.support.stack import Stack
from tests.support.ws import open_ws

pytestmark = pytest.mark.timeout(180)


async def test_generations_share_a_socket_by_id_and_a_cancel_stops_only_its_own(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=40)
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        ws = await open_ws(gateway.url)
        try:
            await ws.send(type="ping", id="p1")
            assert await ws.until(lambda f: f["type"] == "pong") == {"type": "pong", "id": "p1"}

            a = await ws.generate("a", "first one", max_tokens=200)
            b = await ws.generate("b", "second one", max_tokens=30)
            assert a["type"] == b["type"] == "ack" and a["state"] == "queued"
            assert a["session_id"] != b["session_id"] and a["token"] and b["token"]

            await ws.until(
                lambda f: f.get("id") == "a" and f["type"] == "token" and f["count"] >= 3
            )
            await ws.send(type="cancel", id="a")
            ack = await ws.until(lambda f: f["type"] == "ack" and f["op"] == "cancel")
            assert ack["id"] == "a" and ack["generation_id"] == a["generation_id"]
            assert ack["state"] in ("cancelling", "cancelled")

            cancelled = await ws.final_of("a")
            assert cancelled["type"] == "cancelled" and cancelled["reason"] == "user"
            done = await ws.final_of("b")
            assert done["type"] == "done" and done["usage"]["completion_tokens"] == 30
            assert ws.text("b") == synthetic_text("second one", 30)

            # No token of "a" after its cancelled frame; its usage is what the client got.
            # (The cancel's ack and the cancelled frame race: either may come first.)
            a_frames = [f for f in ws.frames["a"] if f.get("op") != "cancel"]
            assert a_frames[-1] == cancelled
            a_tokens = ws.tokens("a")
            assert cancelled["usage"]["completion_tokens"] == a_tokens[-1]["count"] >= 3
            assert ws.text("a") == synthetic_text("first one", a_tokens[-1]["count"])
            assert [f["type"] for f in a_frames][:3] == ["ack", "queued", "started"]

            # The WebSocket generation is on the session's SSE stream, the same events.
            session_a = Session(gateway.url, a["session_id"], a["token"])
            reading = await read_events(client, session_a, until_final_of=a["generation_id"])
            assert reading.text(a["generation_id"]) == ws.text("a")
            assert reading.final(a["generation_id"]).json()["usage"] == cancelled["usage"]
            assert reading.final(a["generation_id"]).id == cancelled["event_id"]

            # A generation started over HTTP is cancelled over the WebSocket.
            session_c = await create_session(client, gateway.url)
            c = await send(client, session_c, "started over http", max_tokens=200)
            await read_events(client, session_c, limit=5)  # queued, started, 3 tokens
            await ws.send(
                type="cancel",
                id="c",
                session_id=session_c.session_id,
                generation_id=c,
                token=session_c.token,
            )
            ack_c = await ws.until(lambda f: f.get("id") == "c")
            assert ack_c["type"] == "ack" and ack_c["state"] == "cancelled"
            reading_c = await read_events(client, session_c, until_final_of=c)
            assert reading_c.final(c).json()["reason"] == "user"
            assert reading_c.final(c).event == "cancelled"
        finally:
            await ws.conn.close()

        # ?token= authorises a socket for that session: its next turn goes without a token.
        ws2 = await open_ws(gateway.url, token=session_c.token)
        try:
            ack = await ws2.generate("next", "another turn", session_id=session_c.session_id)
            assert ack["type"] == "ack" and "token" not in ack
            assert (await ws2.final_of("next"))["type"] == "done"
            # A turn after others reads from right before its queued event: no loss there.
            kinds = [f["type"] for f in ws2.frames["next"]]
            assert kinds[:3] == ["ack", "queued", "started"] and "events_lost" not in kinds
            wrong = await ws2.generate("x", "hi", session_id=a["session_id"])
            assert wrong["type"] == "error" and wrong["code"] == "bad_session_token"
        finally:
            await ws2.conn.close()


async def test_bad_frames_get_typed_errors_and_too_many_close_the_socket_with_4400(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway(TOKENSPOUT_MAX_BODY_BYTES="4096")
    ws = await open_ws(gateway.url)
    try:
        await ws.conn.send("this is not json")
        error = await ws.recv()
        assert error["type"] == "error" and error["code"] == "invalid_json" and "id" not in error

        await ws.send(type="launch", id="x")
        error = await ws.recv()
        assert (error["code"], error["id"], error["field"]) == ("unknown_type", "x", "type")

        await ws.send(type="generate", id="g")
        error = await ws.recv()
        assert (error["code"], error["id"], error["field"]) == ("invalid_frame", "g", "content")

        await ws.send(type="generate", id="t", content="hi", temperature=9)
        error = await ws.recv()
        assert (error["code"], error["field"]) == ("invalid_frame", "temperature")

        await ws.send(type="generate", id="big", content="x" * 5000)
        error = await ws.recv()
        assert error["code"] == "frame_too_large"

        # Refusals of well-formed frames are errors too, but not protocol abuse.
        for _ in range(12):
            await ws.send(type="cancel", id="never-started")
            error = await ws.recv()
            assert (error["code"], error["id"]) == ("not_found", "never-started")
        await ws.send(type="generate", id="e", content="   ")
        assert (await ws.recv())["field"] == "content"

        # The socket still works after all that.
        assert (await ws.generate("ok", "still here", max_tokens=5))["type"] == "ack"
        assert (await ws.final_of("ok"))["type"] == "done"
        assert ws.text("ok") == synthetic_text("still here", 5)

        # Five bad frames so far (the empty content counts as a refusal, not abuse): the
        # tenth closes the socket with 4400 after its error frame.
        for n in range(5):
            await ws.conn.send(json.dumps([n]))
        errors = [await ws.recv() for _ in range(5)]
        assert [e["code"] for e in errors] == ["invalid_frame"] * 5
        with pytest.raises(ConnectionClosedError) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 4400
        assert closed.value.rcvd.reason == "too_many_bad_frames"
    finally:
        await ws.conn.close()


async def test_a_client_that_stops_reading_gets_coalesced_tokens_and_loses_none(
    stack: Stack,
) -> None:
    """Frames wait for the socket; the feed behind them re-reads Redis and the tokens come
    as fewer, larger frames. Several megabytes, so the kernel's buffers really fill."""
    stack.synthetic(tokens_per_s=4000)
    gateway = stack.gateway(
        TOKENSPOUT_MAX_MESSAGE_CHARS="2000000", TOKENSPOUT_MAX_BODY_BYTES="2500000"
    )
    words, max_tokens, ids = 4000, 4010, ["s0", "s1", "s2", "s3"]
    contents = {i: " ".join(f"{i}{n:05d}" + "w" * 400 for n in range(words)) for i in ids}
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", gateway.port))
    ws = await open_ws(gateway.url, sock=raw, max_queue=1, max_size=None)
    async with httpx.AsyncClient(timeout=30) as client:
        try:
            acks = {i: await ws.generate(i, contents[i], max_tokens=max_tokens) for i in ids}
            # Read nothing more until every reply is complete in Redis.
            for ack in acks.values():
                url = f"{gateway.url}/v1/sessions/{ack['session_id']}"
                async with asyncio.timeout(120):
                    while True:
                        view = await client.get(url, params={"token": ack["token"]})
                        if len(view.json()["messages"]) == 2:
                            break
                        await asyncio.sleep(0.2)
            assert (await client.get(f"{gateway.url}/health")).status_code == 200

            for i in ids:
                final = await ws.final_of(i, timeout_s=120)
                assert final["type"] == "done"
                assert final["usage"]["completion_tokens"] == max_tokens
                tokens = ws.tokens(i)
                assert tokens[-1]["count"] == max_tokens
                counts = [f["count"] for f in tokens]
                assert counts == sorted(set(counts))
                assert ws.text(i) == synthetic_text(contents[i], max_tokens)
            frames = sum(len(ws.tokens(i)) for i in ids)
            assert frames < len(ids) * max_tokens, "no token frame was coalesced"
        finally:
            await ws.conn.close()


async def test_a_frame_over_the_cap_gets_an_error_and_one_past_the_hard_bound_closes_1009(
    stack: Stack,
) -> None:
    """Up to 4 x TOKENSPOUT_MAX_BODY_BYTES a frame is read and refused with a typed error;
    past that uvicorn refuses it while reading (close 1009), and only that socket closes."""
    stack.synthetic(tokens_per_s=100)
    gateway = stack.gateway(TOKENSPOUT_MAX_BODY_BYTES="4096")
    bystander, ws = await open_ws(gateway.url), await open_ws(gateway.url)
    try:
        assert (await bystander.generate("b", "keep going", max_tokens=60))["type"] == "ack"

        await ws.send(type="generate", id="big", content="x" * 5000)
        error = await ws.recv()
        assert (error["type"], error["code"]) == ("error", "frame_too_large")
        await ws.send(type="generate", id="bigger", content="x" * (4 * 4096 - 100))
        assert (await ws.recv())["code"] == "frame_too_large"
        await ws.send(type="ping", id="still open")
        assert await ws.recv() == {"type": "pong", "id": "still open"}

        await ws.send(type="generate", id="huge", content="x" * (4 * 4096 + 1))
        with pytest.raises(ConnectionClosedError) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009

        # The gateway goes on serving everyone else.
        done = await bystander.final_of("b")
        assert done["type"] == "done" and bystander.text("b") == synthetic_text("keep going", 60)
        fresh = await open_ws(gateway.url)
        try:
            assert (await fresh.generate("f", "after that", max_tokens=3))["type"] == "ack"
            assert (await fresh.final_of("f"))["type"] == "done"
        finally:
            await fresh.conn.close()
    finally:
        await ws.conn.close()
        await bystander.conn.close()


async def test_refusals_past_the_session_and_global_limits_carry_a_retry_hint(
    stack: Stack,
) -> None:
    """A second generate in a busy session: ``generation_running``; past
    TOKENSPOUT_MAX_INFLIGHT: ``overloaded``; both with ``retry_after_s`` and the socket
    stays usable."""
    stack.synthetic(20, "--capacity", "1")
    gateway = stack.gateway(TOKENSPOUT_MAX_INFLIGHT="2")
    ws = await open_ws(gateway.url)
    try:
        first = await ws.generate("a", "a long one", max_tokens=400)
        assert first["type"] == "ack"
        busy = await ws.generate(
            "a2", "and another", session_id=first["session_id"], token=first["token"]
        )
        assert (busy["type"], busy["code"], busy["retry_after_s"]) == (
            "error",
            "generation_running",
            1,
        )
        assert (await ws.generate("b", "queued behind", max_tokens=5))["type"] == "ack"
        refused = await ws.generate("c", "one too many", max_tokens=5)
        assert (refused["type"], refused["code"], refused["retry_after_s"]) == (
            "error",
            "overloaded",
            1,
        )
        assert "event_id" not in refused  # a refusal, not the end of a generation

        await ws.send(type="cancel", id="a")
        assert (await ws.final_of("a"))["type"] == "cancelled"
        assert (await ws.final_of("b"))["type"] == "done"
        again = await ws.generate("c2", "now there is room", max_tokens=5)
        assert again["type"] == "ack"
        assert (await ws.final_of("c2"))["type"] == "done"
    finally:
        await ws.conn.close()
