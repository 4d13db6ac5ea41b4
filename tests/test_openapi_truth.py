"""The OpenAPI document (``/schema/openapi.json``) against the gateway's real answers: every
route is asked real questions, good and bad (a real gateway, Redis and synthetic engine,
with API keys on), and every answer (its status, content type, body, each event of a
stream) is checked against the document by schemathesis. A route the document has, that
no question here reaches, fails the test: the document cannot drift from the gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis

from gateway.server.documented import unanswered
from stack.redis_server import EmbeddedRedis
from tests.support.stack import Gateway, synthetic_stack
from tests.support.tenants import ADMIN, ADMIN_KEY, Key, make_key

pytestmark = pytest.mark.timeout(180)
BODY_LIMIT = 16_384


@pytest.fixture(scope="module")
def gateway(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    env = {"TOKENSPOUT_ADMIN_KEY": ADMIN_KEY, "TOKENSPOUT_MAX_BODY_BYTES": str(BODY_LIMIT)}
    logs = tmp_path_factory.mktemp("o")
    with synthetic_stack(redis_server.url, logs, 400, **env) as (_, gateway):
        yield gateway


@dataclass
class Checker:
    """Asks the gateway, checks each answer against the document, notes what it asked."""

    client: httpx.AsyncClient
    document: dict[str, Any]
    key: Key
    schema: Any = None
    asked: set[tuple[str, str]] = field(default_factory=set)
    seen: set[tuple[str, str, int]] = field(default_factory=set)

    async def ask(
        self, method: str, route: str, status: int, *, keyed: bool = True, **request: Any
    ) -> httpx.Response:
        """``route`` (the document's path, ``{name}`` filled from ``request["path"]``)."""
        path = route.format(**request.pop("path", {}))
        headers = {**(self.key.headers if keyed else {}), **request.pop("headers", {})}
        answer = await self.client.request(method, path, headers=headers, **request)
        assert answer.status_code == status, (method, path, answer.status_code, answer.text[:400])
        documented = self.document["paths"][route][method.lower()]["responses"]
        assert str(status) in documented, f"{method} {route}: {status} is not in the document"
        kind = answer.headers.get("content-type", "").split(";")[0]
        media = documented[str(status)].get("content", {})
        assert kind in media or (not media and not answer.content), (method, route, kind, media)
        self.schema[route][method].validate_response(answer)  # the body, each event
        self.asked.add((method, route))
        self.seen.add((method, route, status))
        return answer


@pytest.fixture
async def checker(gateway: Gateway) -> AsyncIterator[Checker]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        document = (await client.get("/schema/openapi.json")).json()
        assert document["openapi"] == "3.2.0"
        assert unanswered(document) == []  # every route's answers are in the table
        key = await make_key(client, gateway.url, "documented")
        yield Checker(client, document, key, schemathesis.openapi.from_dict(document))


async def test_every_route_answers_as_the_document_says(checker: Checker) -> None:
    await operations(checker)
    await sessions(checker)
    await admin(checker)
    await openai(checker)
    await responses(checker)
    await tgi_and_oip(checker)
    every = {
        (method.upper(), path)
        for path, item in checker.document["paths"].items()
        for method in item
        if method in ("get", "post", "patch", "delete")
    }
    assert every - checker.asked == set(), "routes no question here reaches"
    print(f"\n{len(checker.seen)} answers of {len(every)} routes checked against the document")


async def operations(c: Checker) -> None:
    await c.ask("GET", "/health", 200, keyed=False)
    await c.ask("GET", "/ready", 200, keyed=False)
    metrics = await c.ask("GET", "/metrics", 200, keyed=False)
    assert metrics.headers["content-type"].count("charset") == 1


async def sessions(c: Checker) -> None:
    made = await c.ask("POST", "/v1/sessions", 201, json={"max_tokens": 3})
    await c.ask("POST", "/v1/sessions", 401, keyed=False, json={})
    await c.ask("POST", "/v1/sessions", 404, json={"model": "no-such-model"})
    await c.ask("POST", "/v1/sessions", 422, json={"temperature": 9})
    await c.ask("POST", "/v1/sessions", 413, content=b"x" * (BODY_LIMIT + 1))
    await c.ask("GET", "/v1/sessions", 200)
    sid, token = made.json()["session_id"], made.json()["token"]
    own = {"path": {"session_id": sid}, "headers": {"X-Session-Token": token}}
    nobody = {"path": {"session_id": "s_nobody"}, "headers": {"X-Session-Token": token}}
    stranger = {"path": {"session_id": sid}, "headers": {"X-Session-Token": "wrong"}}
    one = "/v1/sessions/{session_id}"
    await c.ask("POST", one + "/regenerate", 409, **own)
    await c.ask("POST", one + "/continue", 409, **own)
    await c.ask("POST", one + "/messages", 422, json={"content": ""}, **own)
    sent = await c.ask("POST", one + "/messages", 202, json={"content": "hello"}, **own)
    gid = sent.json()["generation_id"]
    await c.ask("GET", one + "/events", 200, params={"until": gid}, **own)
    await c.ask("GET", one + "/events", 422, params={"last_event_id": "later"}, **own)
    await c.ask("GET", one + "/events", 404, params={"until": "g_nobody"}, **own)
    again = await c.ask("POST", one + "/regenerate", 202, **own)
    # The next message waits for the regenerated reply's end (409 while it runs).
    until = {"until": again.json()["generation_id"]}
    await c.ask("GET", one + "/events", 200, params=until, **own)
    stalled = await c.ask("POST", one + "/messages", 202, json={"content": "[[stall]]"}, **own)
    await c.ask("POST", one + "/continue", 409, **own)  # one running
    cancel = one + "/generations/{generation_id}/cancel"
    running = {**own, "path": {"session_id": sid, "generation_id": stalled.json()["generation_id"]}}
    await c.ask("POST", cancel, 200, **running)
    await c.ask("POST", cancel, 404, **{**own, "path": {"session_id": sid, "generation_id": "g_x"}})
    await c.ask("GET", one, 200, **own)
    await c.ask("GET", one, 403, **stranger)
    await c.ask("GET", one, 404, **nobody)
    await c.ask("PATCH", one, 200, json={"title": "documented"}, **own)
    await c.ask("PATCH", one, 422, json={}, **own)
    await c.ask("DELETE", one, 204, **own)
    await c.ask("DELETE", one, 404, **own)


async def admin(c: Checker) -> None:
    keys = "/v1/admin/keys"
    made = await c.ask("POST", keys, 201, headers=ADMIN, keyed=False, json={"name": "doc"})
    await c.ask("POST", keys, 401, keyed=False, json={"name": "doc"})
    await c.ask("POST", keys, 422, headers=ADMIN, keyed=False, json={"name": "x", "weight": "2"})
    await c.ask("GET", keys, 200, headers=ADMIN, keyed=False)
    one = {"path": {"key_id": made.json()["id"]}, "headers": ADMIN, "keyed": False}
    await c.ask("GET", keys + "/{key_id}", 200, **one)
    await c.ask("GET", keys + "/{key_id}", 404, **{**one, "path": {"key_id": "k_nobody"}})
    await c.ask("PATCH", keys + "/{key_id}", 200, json={"weight": 2}, **one)
    await c.ask("PATCH", keys + "/{key_id}", 422, json={"weight": "2"}, **one)
    await c.ask("DELETE", keys + "/{key_id}", 200, **one)
    await c.ask("DELETE", keys + "/{key_id}", 409, **one)
    await c.ask("PATCH", keys + "/{key_id}", 409, json={"weight": 3}, **one)
    usage = "/v1/admin/usage"
    await c.ask("GET", usage, 200, params={"key": made.json()["id"]}, headers=ADMIN, keyed=False)
    await c.ask("GET", usage, 404, params={"key": "k_nobody"}, headers=ADMIN, keyed=False)
    await c.ask(
        "GET",
        usage,
        422,
        params={"key": "anonymous", "granularity": "week"},
        headers=ADMIN,
        keyed=False,
    )


async def openai(c: Checker) -> None:
    chat = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    await c.ask("POST", "/v1/chat/completions", 200, json=chat)
    await c.ask("POST", "/v1/chat/completions", 200, json={**chat, "stream": True})
    failing = {**chat, "messages": [{"role": "user", "content": "[[fail:1]] x"}], "stream": True}
    await c.ask("POST", "/v1/chat/completions", 200, json=failing)  # its error, in the stream
    await c.ask("POST", "/v1/chat/completions", 400, json={**chat, "temperature": 9})
    await c.ask("POST", "/v1/chat/completions", 401, keyed=False, json=chat)
    await c.ask("POST", "/v1/chat/completions", 404, json={**chat, "model": "no-such-model"})
    prompt = {"model": "synthetic", "prompt": "one two", "max_tokens": 3}
    await c.ask("POST", "/v1/completions", 200, json=prompt)
    await c.ask("POST", "/v1/completions", 200, json={**prompt, "stream": True})
    await c.ask("POST", "/v1/completions", 400, json={**prompt, "echo": True})
    await c.ask("GET", "/v1/models", 200)
    await c.ask("GET", "/v1/models", 401, keyed=False, headers={"Authorization": "Bearer no"})
    await c.ask("POST", "/tokenize", 200, json={"model": "synthetic", "prompt": "one two"})
    await c.ask("POST", "/tokenize", 400, json={"model": "synthetic"})
    # The synthetic engine has no tokenizer to detokenize with (vLLM does): its refusal.
    await c.ask("POST", "/detokenize", 400, json={"model": "synthetic", "tokens": [1, 2]})
    await c.ask("POST", "/detokenize", 400, json={"model": "synthetic", "tokens": "no"})


async def responses(c: Checker) -> None:
    ask = {"model": "synthetic", "input": "hello", "max_output_tokens": 3}
    made = await c.ask("POST", "/v1/responses", 200, json=ask)
    await c.ask("POST", "/v1/responses", 200, json={**ask, "stream": True})
    await c.ask("POST", "/v1/responses", 400, json={**ask, "temperature": 9})
    one = {"path": {"response_id": made.json()["id"]}}
    nobody = {"path": {"response_id": "resp_nobody"}}
    await c.ask("GET", "/v1/responses/{response_id}", 200, **one)
    await c.ask("GET", "/v1/responses/{response_id}", 200, params={"stream": "true"}, **one)
    await c.ask("GET", "/v1/responses/{response_id}", 404, **nobody)
    await c.ask("GET", "/v1/responses/{response_id}/input_items", 200, **one)
    await c.ask("GET", "/v1/responses/{response_id}/input_items", 404, **nobody)
    await c.ask("POST", "/v1/responses/{response_id}/cancel", 200, **one)  # ended: as it is
    await c.ask("POST", "/v1/responses/{response_id}/cancel", 404, **nobody)
    await c.ask("DELETE", "/v1/responses/{response_id}", 200, **one)
    await c.ask("DELETE", "/v1/responses/{response_id}", 404, **one)


async def tgi_and_oip(c: Checker) -> None:
    tgi = {"inputs": "one two", "parameters": {"max_new_tokens": 3}}
    await c.ask("POST", "/generate", 200, json=tgi)
    await c.ask("POST", "/generate", 422, json={"inputs": ""})
    await c.ask("POST", "/", 200, json=tgi)
    await c.ask("POST", "/generate_stream", 200, json=tgi)
    await c.ask("POST", "/generate_stream", 401, keyed=False, json=tgi)
    await c.ask("GET", "/info", 200)
    oip = {"text_input": "one two", "parameters": {"max_tokens": 3}}
    model = {"path": {"model": "synthetic"}}
    await c.ask("POST", "/v2/models/{model}/generate", 200, json=oip, **model)
    await c.ask("POST", "/v2/models/{model}/generate", 422, json={"text_input": ""}, **model)
    await c.ask("POST", "/v2/models/{model}/generate_stream", 200, json=oip, **model)
    await c.ask("GET", "/v2/models/{model}/ready", 200, **model)
    await c.ask("GET", "/v2/models/{model}/ready", 404, path={"model": "no-such-model"})
