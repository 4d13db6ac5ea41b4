"""API keys on session creation (HTTP and WebSocket), read once at start-up, never logged."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from stack import processes
from stack.redis_server import free_port
from tests.support.http import Session, read_events, send
from tests.support.oracle import synthetic_text
from tests.support.stack import Stack
from tests.support.ws import open_ws

pytestmark = pytest.mark.timeout(120)

KEYS = "k-alpha-5f1c9e,k-bravo-77d2a0"


async def create(client: httpx.AsyncClient, base: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return await client.post(f"{base}/v1/sessions", headers=headers)


async def test_creating_a_session_wants_a_key_and_its_endpoints_want_only_the_token(
    stack: Stack,
) -> None:
    stack.synthetic(500)
    gateway = stack.gateway(TOKENSPOUT_API_KEYS=KEYS)
    async with httpx.AsyncClient(timeout=30) as client:
        for key in (None, "wrong-key", "k-alpha", "k-alpha-5f1c9e,k-bravo-77d2a0"):
            refused = await create(client, gateway.url, key)
            assert refused.status_code == 401, (key, refused.text)
            error = refused.json()["error"]
            assert error["code"] == "invalid_api_key"
            assert "Authorization: Bearer" in error["message"]
        made = await create(client, gateway.url, "k-bravo-77d2a0")
        assert made.status_code == 201, made.text
        body = made.json()
        session = Session(gateway.url, body["session_id"], body["token"])
        # The session's own endpoints take its token and no API key.
        generation = await send(client, session, "keyed", max_tokens=3)
        reading = await read_events(client, session, until_final_of=generation)
        assert reading.text(generation) == synthetic_text("keyed", 3)
        history = await client.get(
            f"{gateway.url}/v1/sessions/{session.session_id}", headers=session.headers
        )
        assert history.status_code == 200
        # The token is not an API key.
        assert (await create(client, gateway.url, session.token)).status_code == 401


async def test_without_keys_everything_stays_open(stack: Stack) -> None:
    stack.synthetic(500)
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await create(client, gateway.url, None)).status_code == 201
        assert (await create(client, gateway.url, "anything")).status_code == 201
    ws = await open_ws(gateway.url)
    try:
        ack = await ws.generate("g1", "open socket", max_tokens=2)
        assert ack["type"] == "ack" and ack["token"]
        assert (await ws.final_of("g1"))["type"] == "done"
    finally:
        await ws.conn.close()


async def test_a_websocket_generate_that_creates_a_session_wants_a_key(stack: Stack) -> None:
    stack.synthetic(500)
    gateway = stack.gateway(TOKENSPOUT_API_KEYS=KEYS)
    ws = await open_ws(gateway.url)
    try:
        refused = await ws.generate("g1", "no key", max_tokens=2)
        assert refused["type"] == "error" and refused["code"] == "invalid_api_key"
        wrong = await ws.generate("g2", "wrong key", max_tokens=2, api_key="nope")
        assert wrong["type"] == "error" and wrong["code"] == "invalid_api_key"
        ack = await ws.generate("g3", "frame key", max_tokens=2, api_key="k-alpha-5f1c9e")
        assert ack["type"] == "ack" and ack["token"], ack
        assert (await ws.final_of("g3"))["type"] == "done"
        assert ws.text("g3") == synthetic_text("frame key", 2)
        # The socket showed a key once: its next new session needs none.
        again = await ws.generate("g4", "second session", max_tokens=2)
        assert again["type"] == "ack" and again["session_id"] != ack["session_id"]
        assert (await ws.final_of("g4"))["type"] == "done"
    finally:
        await ws.conn.close()

    # A session made elsewhere needs only its token, on a socket that shows no key.
    ws = await open_ws(gateway.url, token=ack["token"])
    try:
        follow = await ws.generate("f1", "follow up", max_tokens=2, session_id=ack["session_id"])
        assert follow["type"] == "ack", follow
        assert (await ws.final_of("f1"))["type"] == "done"
    finally:
        await ws.conn.close()

    # A non-browser client can send the key with the connect request instead.
    headed = await open_ws(
        gateway.url, additional_headers={"Authorization": "Bearer k-bravo-77d2a0"}
    )
    try:
        ack = await headed.generate("h1", "header key", max_tokens=2)
        assert ack["type"] == "ack", ack
        assert (await headed.final_of("h1"))["type"] == "done"
    finally:
        await headed.conn.close()
    wrong_header = await open_ws(gateway.url, additional_headers={"Authorization": "Bearer no"})
    try:
        refused = await wrong_header.generate("h2", "bad header", max_tokens=2)
        assert refused["code"] == "invalid_api_key"
    finally:
        await wrong_header.conn.close()


async def test_keys_come_from_a_file_read_once_and_never_reach_the_log(
    stack: Stack, tmp_path: Path
) -> None:
    stack.synthetic(500)
    key_file = tmp_path / "keys"
    key_file.write_text("# gateway keys\nfile-key-3c81aa\n\n  file-key-90be12  \n")
    env_key = "env-key-d41e07"
    gateway = stack.gateway(TOKENSPOUT_API_KEYS=env_key, TOKENSPOUT_API_KEYS_FILE=str(key_file))
    # Read at start-up, kept in memory: the file going away changes nothing.
    key_file.unlink()
    async with httpx.AsyncClient(timeout=30) as client:
        for key in ("file-key-3c81aa", "file-key-90be12", env_key):
            assert (await create(client, gateway.url, key)).status_code == 201, key
        assert (await create(client, gateway.url, "# gateway keys")).status_code == 401
        wrong = "wrong-key-5e5e5e"
        assert (await create(client, gateway.url, wrong)).status_code == 401
        openai = await client.post(
            f"{gateway.url}/v1/completions",
            json={"model": "synthetic", "prompt": "hi", "max_tokens": 2},
            headers={"Authorization": "Bearer file-key-90be12"},
        )
        assert openai.status_code == 200, openai.text
    ws = await open_ws(gateway.url)
    try:
        assert (await ws.generate("w1", "hi", max_tokens=2, api_key=wrong))["type"] == "error"
        ack = await ws.generate("w2", "hi", max_tokens=2, api_key="file-key-3c81aa")
        assert ack["type"] == "ack"
        await ws.final_of("w2")
    finally:
        await ws.conn.close()
    processes.stop(gateway.process)
    log = (stack.logs / f"gateway-{gateway.port}.log").read_text()
    assert "msg='request'" in log and "route=/v1/sessions" in log  # requests were logged
    for secret in ("file-key-3c81aa", "file-key-90be12", env_key, wrong, "file-key"):
        assert secret not in log


@pytest.mark.parametrize("content", [None, "", "\n# only a comment\n  \n"])
def test_a_missing_or_empty_key_file_stops_the_gateway_at_start_up(
    stack: Stack, tmp_path: Path, content: str | None
) -> None:
    key_file = tmp_path / "keys"
    if content is not None:
        key_file.write_text(content)
    log_path = tmp_path / "refused.log"
    process = processes.gateway(
        free_port(), stack.base_env(TOKENSPOUT_API_KEYS_FILE=str(key_file)), log_path
    )
    stack.children.append(process)
    assert process.wait(timeout=60) != 0
    output = log_path.read_text()
    assert "TOKENSPOUT_API_KEYS_FILE" in output
    assert str(key_file) in output
    assert ("cannot read" if content is None else "holds no key") in output
    assert "Traceback" not in output
