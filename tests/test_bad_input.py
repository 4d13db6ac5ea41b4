"""Bad input gets a clear error and disturbs nothing else.

Every 4xx these tests draw says what to change, in its API's own format: the field as
the client sent it, or the limit and its setting, or where a body stops being JSON
(``names_the_fix``, tests/support/hostile.py)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.support.hostile import error_of, names_the_fix
from tests.support.http import create_session, read_events, send
from tests.support.sse import parse
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(120)

LIMIT = 4096
"""The tests' ``TOKENSPOUT_MAX_BODY_BYTES``."""


async def test_bad_requests_get_clear_errors_while_another_stream_keeps_going(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=40)
    gateway = stack.gateway(
        TOKENSPOUT_MAX_BODY_BYTES=str(LIMIT), TOKENSPOUT_MAX_MESSAGE_CHARS="500"
    )
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
        names_the_fix(unknown, "'s_nope'")

        wrong = await client.post(
            url, json={"content": "x"}, headers={"X-Session-Token": "not-the-token"}
        )
        assert wrong.status_code == 403
        assert wrong.json()["error"]["code"] == "bad_session_token"
        names_the_fix(wrong)
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
        assert malformed.json()["error"]["code"] == "invalid_json"
        names_the_fix(malformed, "not valid JSON", "line 1, column 13 (byte 12)")

        not_an_object = await post(b'["hi"]')
        assert not_an_object.status_code == 422
        names_the_fix(not_an_object)

        wrong_type = await post(json={"content": "hi", "max_tokens": "many"})
        assert wrong_type.status_code == 422
        assert wrong_type.json()["error"]["field"] == "max_tokens"
        names_the_fix(wrong_type, "max_tokens")

        unknown_field = await post(json={"content": "hi", "colour": "blue"})
        assert unknown_field.status_code == 422
        names_the_fix(unknown_field, "colour")

        no_content = await post(json={"max_tokens": 3})
        assert no_content.status_code == 422
        names_the_fix(no_content, "content")

        empty = await post(json={"content": "   "})
        assert empty.status_code == 422 and empty.json()["error"]["field"] == "content"
        names_the_fix(empty)

        too_long = await post(json={"content": "x" * 501})
        assert too_long.status_code == 422
        assert too_long.json()["error"]["code"] == "message_too_long"
        names_the_fix(too_long, "500", "TOKENSPOUT_MAX_MESSAGE_CHARS")

        too_big = await post(json={"content": "x" * 5000})
        assert too_big.status_code == 413
        assert too_big.json()["error"]["code"] == "too_large"
        names_the_fix(too_big, f"{LIMIT} bytes (4 KiB)", "TOKENSPOUT_MAX_BODY_BYTES")

        too_many = await post(json={"content": "hi", "max_tokens": 10**9})
        assert too_many.status_code == 422 and too_many.json()["error"]["field"] == "max_tokens"
        names_the_fix(too_many, "4096", "TOKENSPOUT_MAX_TOKENS_LIMIT")

        out_of_range = await post(json={"content": "hi", "temperature": -1})
        assert out_of_range.status_code == 422
        names_the_fix(out_of_range, "temperature")

        first = await post(json={"content": "one at a time", "max_tokens": 30})
        assert first.status_code == 202
        busy = await post(json={"content": "and another"})
        assert busy.status_code == 409
        assert busy.json()["error"]["code"] == "generation_running"
        assert busy.headers["retry-after"] == "1"
        names_the_fix(busy)

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
        names_the_fix(unknown_generation, "generation_id", "g_no-such-generation")
        # The refused cancels stopped nothing.
        ended = await read_events(client, session, until_final_of=running_id)
        assert ended.final(running_id).event == "done"
        # A cancel of a finished generation is no error: its final state, again.
        again = await client.post(f"{cancel_url}/{running_id}/cancel", headers=session.headers)
        assert again.status_code == 200
        assert (again.json()["state"], again.json()["final"]["type"]) == ("done", "done")

        for given in ("x", "1-", "18446744073709551616-0"):
            bad_resume = await client.get(
                f"{base}/v1/sessions/{session.session_id}/events",
                params={"token": session.token, "last_event_id": given},
            )
            assert bad_resume.status_code == 422
            assert bad_resume.json()["error"]["code"] == "bad_event_id"
            assert bad_resume.json()["error"]["field"] == "last_event_id"
            names_the_fix(bad_resume, "`<milliseconds>-<sequence>`")

        # An id from the future is no 4xx: the stream says events_lost, then starts over.
        future = f"{int(time.time() * 1000) + 3_600_000}-0"
        async with client.stream(
            "GET", session.events_url, params={"token": session.token, "last_event_id": future}
        ) as resumed:
            assert resumed.status_code == 200
            async for event in parse(resumed.aiter_lines()):
                assert (event.event, event.id) == ("events_lost", "")
                assert json.loads(event.data)["last_event_id"] == future
                break

        reading = await read_events(client, bystander, until_final_of=running)
        assert reading.final(running).event == "done"
        assert len([e for e in reading.events if e.event == "token"]) == 40
        assert (await client.get(f"{base}/health")).status_code == 200


async def test_every_api_says_what_to_fix_in_its_own_format(stack: Stack) -> None:
    """The same mistakes at each API (OpenAI chat, completions and Responses, TGI, OIP):
    a body over the limit, one that is not JSON, a wrong type, a value out of range, an
    unknown id, a resume point past the end. Each 4xx names the field as the client sent
    it, or the limit and its setting, or where the JSON breaks."""
    stack.synthetic(0)
    gateway = stack.gateway(TOKENSPOUT_MAX_BODY_BYTES=str(LIMIT))
    big = "x" * (LIMIT + 1)
    chat = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}]}
    cases: list[tuple[str, str, object, tuple[str, ...]]] = [
        ("/v1/chat/completions", "too large", {**chat, "user": big},
         ("TOKENSPOUT_MAX_BODY_BYTES",)),
        ("/v1/chat/completions", "not JSON", b'{"model": "synthetic",', ("line 1, column 23",)),
        ("/v1/chat/completions", "wrong type", {**chat, "messages": "hi"}, ("messages",)),
        ("/v1/chat/completions", "out of range", {**chat, "temperature": 9}, ("temperature",)),
        ("/v1/chat/completions", "over a limit", {**chat, "max_completion_tokens": 10**6},
         ("max_completion_tokens", "TOKENSPOUT_MAX_TOKENS_LIMIT")),
        ("/v1/chat/completions", "unknown field", {**chat, "colour": "red"}, ("colour",)),
        ("/v1/completions", "not JSON", b'{"prompt": }', ("line 1, column 12 (byte 11)",)),
        ("/v1/completions", "over a limit", {"model": "synthetic", "prompt": "a", "logprobs": 9},
         ("logprobs",)),
        ("/v1/responses", "too large", {"model": "synthetic", "input": big},
         ("TOKENSPOUT_MAX_BODY_BYTES",)),
        ("/v1/responses", "not JSON", b'{\n "input": "hi"', ("line 2, column 15",)),
        ("/v1/responses", "over a limit",
         {"model": "synthetic", "input": "hi", "max_output_tokens": 10**6},
         ("max_output_tokens", "TOKENSPOUT_MAX_TOKENS_LIMIT")),
        ("/v1/responses", "unknown id",
         {"model": "synthetic", "input": "hi", "previous_response_id": "resp_s_x.g_y"},
         ("previous_response_id", "resp_s_x.g_y")),
        ("/generate", "too large", {"inputs": big}, ("TOKENSPOUT_MAX_BODY_BYTES",)),
        ("/generate", "not JSON", b"{\"inputs\": 'hi'}", ("line 1, column 12",)),
        ("/generate", "wrong type", {"inputs": 5}, ("inputs",)),
        ("/generate", "over a limit", {"inputs": "hi", "parameters": {"max_new_tokens": 10**6}},
         ("max_new_tokens", "TOKENSPOUT_MAX_TOKENS_LIMIT")),
        ("/generate", "out of range", {"inputs": "hi", "parameters": {"top_n_tokens": 99}},
         ("top_n_tokens",)),
        ("/v2/models/synthetic/generate", "too large", {"text_input": big},
         ("TOKENSPOUT_MAX_BODY_BYTES",)),
        ("/v2/models/synthetic/generate", "not JSON", b"{", ("line 1, column 2",)),
        ("/v2/models/synthetic/generate", "wrong type",
         {"text_input": "hi", "parameters": {"temperature": "hot"}}, ("temperature",)),
        ("/v2/models/synthetic/generate", "missing", {"parameters": {}}, ("text_input",)),
    ]  # fmt: skip
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        for path, mistake, body, names in cases:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            answer = await client.post(
                path, content=content, headers={"content-type": "application/json"}
            )
            assert 400 <= answer.status_code < 500, (path, mistake, answer.text)
            names_the_fix(answer, *names)
            message, _, _ = error_of(answer)
            print(f"{path} {mistake}: {answer.status_code} {message}")

        unknown = await client.get("/v1/responses/resp_s_nope.g_nope")
        assert unknown.status_code == 404
        names_the_fix(unknown, "response_id", "resp_s_nope.g_nope")
        created = await client.post(
            "/v1/responses", json={"model": "synthetic", "input": "hi", "max_output_tokens": 2}
        )
        rid = created.json()["id"]
        past = await client.get(
            f"/v1/responses/{rid}", params={"stream": "true", "starting_after": 99}
        )
        assert past.status_code == 410 and past.json()["error"]["code"] == "events_lost"
        names_the_fix(past, "starting_after 99", "start over from the beginning")
        cancelled_again = await client.post(f"/v1/responses/{rid}/cancel")
        assert cancelled_again.status_code == 200  # an ended response: returned unchanged
        assert cancelled_again.json()["status"] == created.json()["status"]
