"""gateway/apis/openai/hot.py: which requests the hot routes take and which go on to the app
behind it (here one that records what reached it), with their body handed on whole. The
requests it takes are answered by the gateway's own functions against the session's real
Redis; with no worker ever registered the submit is refused, so each answer here is the
hot route's own error answer, compared with the Litestar app's for the same request.
Over real processes, every chat and (legacy) completion of the adapters' tests takes one."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from litestar.types import Receive, Scope, Send

from gateway.apis.openai.hot import HotRoutes
from gateway.core.settings import Settings
from gateway.server.app import Services, create_app
from stack.redis_server import EmbeddedRedis

pytestmark = [
    pytest.mark.timeout(60),
    # Building the whole app: Litestar 2.25 warns about its handlers' inferred dependencies
    # and path parameters (as tests/inprocess/test_api_key_guard.py says).
    pytest.mark.filterwarnings(
        "ignore::litestar.exceptions.base_exceptions.LitestarDeprecationWarning"
    ),
]

KEY = "k-hot-1"
LIMIT = 4096
REQUEST = {
    "model": "m",
    "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
}


class Behind:
    """The app behind the hot route: records each request's whole body, answers 299."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")  # type: ignore[operator]
            more = bool(message.get("more_body", False))
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture
def settings(redis_server: EmbeddedRedis) -> Settings:
    return Settings(
        redis_url=redis_server.url,
        key_prefix=f"t-{secrets.token_hex(4)}",
        api_keys=KEY,
        cors_origins="https://chat.example",
        max_body_bytes=LIMIT,
    )


@pytest.fixture
async def services(settings: Settings) -> AsyncIterator[Services]:
    services = Services(settings)
    yield services
    await services.redis.aclose()


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def hot(app: Any, services: Services, settings: Settings) -> HotRoutes:
    return HotRoutes(app, services.service, services.api_keys, services.unanswered)


KEYED = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.mark.parametrize(
    ("why", "path", "body", "headers"),
    [
        ("not JSON", "/v1/chat/completions", b"{not json", KEYED),
        ("not a request", "/v1/chat/completions", b'{"stream": true}', KEYED),
        ("an unknown field", "/v1/chat/completions", b'{"stream": true, "x": 1}', KEYED),
        ("over the size limit", "/v1/chat/completions", b" " * (3 * LIMIT), KEYED),
        ("no key", "/v1/chat/completions", json.dumps(REQUEST).encode(), {}),
        (
            "a wrong key",
            "/v1/chat/completions",
            json.dumps(REQUEST).encode(),
            {**KEYED, "Authorization": "Bearer wrong"},
        ),
        (
            "a cross-origin request with CORS configured",
            "/v1/chat/completions",
            json.dumps(REQUEST).encode(),
            {**KEYED, "Origin": "https://chat.example"},
        ),
        (
            "not JSON's type",
            "/v1/chat/completions",
            json.dumps(REQUEST).encode(),
            {**KEYED, "Content-Type": "text/plain"},
        ),
        ("another route", "/v1/responses", json.dumps(REQUEST).encode(), KEYED),
        (
            "a chat request where a completion goes",
            "/v1/completions",
            json.dumps(REQUEST).encode(),
            KEYED,
        ),
    ],
)
async def test_what_the_hot_route_does_not_take_reaches_the_app_with_its_whole_body(
    services: Services,
    settings: Settings,
    why: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
) -> None:
    behind = Behind()
    async with client(hot(behind, services, settings)) as http:
        answer = await http.post(path, content=body, headers=headers)
    assert answer.status_code == 299, why
    assert behind.bodies == [body], why


COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize(
    ("path", "request_body"),
    [("/v1/chat/completions", REQUEST), ("/v1/completions", COMPLETION)],
    ids=["chat", "completion"],
)
async def test_a_request_it_takes_is_refused_as_the_app_refuses_it(
    services: Services,
    settings: Settings,
    stream: bool,
    path: str,
    request_body: dict[str, Any],
) -> None:
    """No worker has registered under this key prefix: the submit answers 503 ``no_worker``
    (a refusal after the request was taken, from the gateway's own code). The hot route's
    answer is Litestar's answer to the same request, status, headers and body."""
    behind = Behind()
    body = json.dumps({**request_body, "stream": stream}).encode()
    async with client(hot(behind, services, settings)) as http:
        taken = await http.post(path, content=body, headers=KEYED)
    assert behind.bodies == []
    async with client(create_app(settings, services)) as http:
        litestar = await http.post(path, content=body, headers=KEYED)
    assert taken.status_code == litestar.status_code == 503, litestar.text
    assert taken.json() == litestar.json()
    assert taken.json()["error"]["code"] == "no_worker"
    assert dict(taken.headers) == dict(litestar.headers)
