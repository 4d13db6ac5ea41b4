"""Hostile WebSocket frames: hypothesis-made frames at ``WS /v1/ws``.

Guarantee 5 of docs/reliability.md, for the socket: every frame gets typed frames back (an
``error``, or the ``ack`` of a valid one), the socket answers the next ``ping``, it only
ever closes with a documented 4400 code, and a stream in another session is undisturbed.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.support.hostile import json_values
from tests.support.http import create_session, read_events, send
from tests.support.oracle import synthetic_text
from tests.support.stack import Stack
from tests.support.ws import ws_url

pytestmark = pytest.mark.timeout(300)

MAX_FRAME_BYTES = 4096
SERVER_FRAMES = {"ack", "queued", "started", "token", "done", "cancelled", "error", "pong"}
CLOSE_REASONS = {"too_many_bad_frames", "replies_not_read"}

frame_fields = {
    "id": json_values | st.text(min_size=1, max_size=70),
    "content": json_values | st.text(max_size=80),
    "session_id": json_values | st.text(max_size=30),
    "generation_id": json_values | st.text(max_size=30),
    "token": json_values | st.text(max_size=30),
    "max_tokens": json_values | st.integers(-5, 10_000),
    "temperature": json_values,
    "top_p": json_values,
    "top_k": json_values,
    "stop": json_values,
    "seed": json_values,
    "extra": json_values,
}
typed_frames = st.fixed_dictionaries(
    {"type": st.sampled_from(["generate", "cancel", "ping", "launch", ""]) | json_values},
    optional=frame_fields,
).map(json.dumps)
valid_generates = st.fixed_dictionaries(
    {
        "type": st.just("generate"),
        "id": st.text(min_size=1, max_size=8),
        "content": st.text(min_size=1, max_size=40).filter(str.strip),
        "max_tokens": st.integers(1, 20),
    }
).map(json.dumps)
hostile_frames = st.one_of(
    valid_generates,
    typed_frames,
    typed_frames.map(str.encode),  # the same as a binary frame
    st.binary(max_size=200),
    st.text(max_size=200),
    json_values.map(json.dumps),
    st.integers(1, 3000).map(lambda depth: "[" * depth + "]" * depth),
    st.integers(MAX_FRAME_BYTES + 1, 3 * MAX_FRAME_BYTES).map(lambda size: "x" * size),
)


class Prober:
    """One socket at a time; a new one whenever the gateway closes the last."""

    def __init__(self, base: str, sockets: ExitStack) -> None:
        self.url = ws_url(base)
        self.sockets = sockets
        self.conn: ClientConnection = sockets.enter_context(connect(self.url))
        self.frames_sent = 0
        self.closes: list[tuple[int, str]] = []
        self.replies: dict[str, int] = {}

    def send_and_probe(self, frame: str | bytes) -> None:
        """Send ``frame``, then a ping; read every frame up to its pong."""
        probe = f"probe-{self.frames_sent}"
        self.frames_sent += 1
        try:
            self.conn.send(frame)
            self.conn.send(json.dumps({"type": "ping", "id": probe}))
            while True:
                reply: dict[str, Any] = json.loads(self.conn.recv(timeout=30))
                assert reply["type"] in SERVER_FRAMES, reply
                self.replies[reply["type"]] = self.replies.get(reply["type"], 0) + 1
                if reply == {"type": "pong", "id": probe}:
                    return
        except ConnectionClosed as closed:
            assert closed.rcvd is not None, "the gateway dropped the socket without a close"
            assert closed.rcvd.code == 4400 and closed.rcvd.reason in CLOSE_REASONS, closed
            self.closes.append((closed.rcvd.code, closed.rcvd.reason))
            self.conn = self.sockets.enter_context(connect(self.url))


def fuzz_socket(base: str) -> Prober:
    with ExitStack() as sockets:
        prober = Prober(base, sockets)

        @settings(
            max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(frame=hostile_frames)
        def frame_is_answered(frame: str | bytes) -> None:
            prober.send_and_probe(frame)

        frame_is_answered()
    return prober


async def test_hostile_frames_get_typed_answers_and_disturb_no_stream(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=100)
    gateway = stack.gateway(TOKENSPOUT_MAX_BODY_BYTES=str(MAX_FRAME_BYTES))
    async with httpx.AsyncClient(timeout=60) as client:
        bystander = await create_session(client, gateway.url)
        generation = await send(client, bystander, "undisturbed", max_tokens=1500)
        watching = asyncio.create_task(
            read_events(client, bystander, until_final_of=generation, timeout_s=240)
        )
        prober = await asyncio.to_thread(fuzz_socket, gateway.url)
        print(
            f"\nhostile WebSocket frames: {prober.frames_sent} sent, replies {prober.replies},"
            f" {len(prober.closes)} sockets closed with 4400"
        )
        assert prober.frames_sent >= 1000
        # Most frames are malformed, so sockets did get closed for abuse; errors were typed.
        assert prober.closes and prober.replies["error"] >= len(prober.closes) * 9
        assert prober.replies["ack"] > 0 and prober.replies["token"] > 0  # valid ones worked
        reading = await watching
        assert reading.text(generation) == synthetic_text("undisturbed", 1500)
        health = await client.get(f"{gateway.url}/health")
        assert health.status_code == 200
        assert gateway.process.poll() is None
