"""Bad input gets a clear error and disturbs nothing else."""

from __future__ import annotations

import httpx
import pytest

from tests.support.http import create_session, read_events, send
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(120)


async def test_bad_requests_get_clear_errors_while_another_stream_keeps_going(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=40)
    gateway = stack.gateway(TOKENSPOUT_MAX_BODY_BYTES="4096", TOKENSPOUT_MAX_MESSAGE_CHARS="500")
    base = gateway.url
    async with httpx.AsyncClient(timeout=30) as client:
        bystander = await create_session(client, base)
        running = await send(client, bystander, "keep going", max_tokens=40)
        session = await create_session(client, base)
        # Without the owner cookie the gateway set: the token is this client's credential.
        client.cookies.clear()
        url = f"{base}/v1/sessions/{session.session_id}/messages"

        async def post(
            body: bytes | None = None,
            *,
            json: object = None,
            headers: dict[str, str] | None = None,
            path: str = url,
        ) -> httpx.Response:
            return await client.post(
                path,
                content=body,
                json=json,
                headers={**session.headers, **(headers or {}), "content-type": "application/json"},
            )

        unknown = await client.post(
            f"{base}/v1/sessions/s_nope/messages", json={"content": "x"}, headers=session.headers
        )
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "unknown_session"

        wrong = await client.post(
            url, json={"content": "x"}, headers={"X-Session-Token": "not-the-token"}
        )
        assert wrong.status_code == 403
        assert wrong.json()["error"]["code"] == "bad_session_token"
        tokenless = await client.post(url, json={"content": "x"})
        assert tokenless.status_code == 403
        history = await client.get(
            f"{base}/v1/sessions/{session.session_id}", headers=session.headers
        )
        assert history.json()["messages"] == []  # a refused message is not kept
        missing = await client.get(f"{base}/v1/sessions/{session.session_id}")
        assert missing.status_code == 403
        events = await client.get(
            f"{base}/v1/sessions/{session.session_id}/events", params={"token": "nope"}
        )
        assert events.status_code == 403

        malformed = await post(b'{"content": ')
        assert malformed.status_code == 422
        assert malformed.json()["error"]["code"] == "invalid_request"

        wrong_type = await post(json={"content": "hi", "max_tokens": "many"})
        assert wrong_type.status_code == 422
        assert wrong_type.json()["error"]["field"] == "max_tokens"

        unknown_field = await post(json={"content": "hi", "colour": "blue"})
        assert unknown_field.status_code == 422

        empty = await post(json={"content": "   "})
        assert empty.status_code == 422 and empty.json()["error"]["field"] == "content"

        too_long = await post(json={"content": "x" * 501})
        assert too_long.status_code == 422
        assert too_long.json()["error"]["code"] == "message_too_long"

        too_big = await post(json={"content": "x" * 5000})
        assert too_big.status_code == 413
        assert too_big.json()["error"]["code"] == "too_large"

        too_many = await post(json={"content": "hi", "max_tokens": 10**9})
        assert too_many.status_code == 422 and too_many.json()["error"]["field"] == "max_tokens"

        first = await post(json={"content": "one at a time", "max_tokens": 30})
        assert first.status_code == 202
        busy = await post(json={"content": "and another"})
        assert busy.status_code == 409
        assert busy.json()["error"]["code"] == "generation_running"
        assert busy.headers["retry-after"] == "1"

        # Cancel: the session's token or nothing; an unknown generation is 404.
        cancel_url = f"{base}/v1/sessions/{session.session_id}/generations"
        running_id = first.json()["generation_id"]
        no_token = await client.post(f"{cancel_url}/{running_id}/cancel")
        assert no_token.status_code == 403
        assert no_token.json()["error"]["code"] == "bad_session_token"
        bad_token = await client.post(
            f"{cancel_url}/{running_id}/cancel", headers={"X-Session-Token": bystander.token}
        )
        assert bad_token.status_code == 403
        unknown_generation = await client.post(
            f"{cancel_url}/g_no-such-generation/cancel", headers=session.headers
        )
        assert unknown_generation.status_code == 404
        assert unknown_generation.json()["error"]["code"] == "unknown_generation"
        # The refused cancels stopped nothing.
        ended = await read_events(client, session, until_final_of=running_id)
        assert ended.final(running_id).event == "done"

        bad_resume = await client.get(
            f"{base}/v1/sessions/{session.session_id}/events",
            params={"token": session.token, "last_event_id": "x"},
        )
        assert bad_resume.status_code == 422
        assert bad_resume.json()["error"]["code"] == "bad_event_id"
        assert bad_resume.json()["error"]["field"] == "last_event_id"

        reading = await read_events(client, bystander, until_final_of=running)
        assert reading.final(running).event == "done"
        assert len([e for e in reading.events if e.event == "token"]) == 40
        assert (await client.get(f"{base}/health")).status_code == 200
