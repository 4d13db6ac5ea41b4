"""gateway/core/auth.py's ``api_key_check`` on the routers and handlers that want a key: every
one answers 401 in its own protocol's error format without a key, before the body is
read, and lets a keyed request through to the body's check. The app runs without its
lifespan: nothing here reaches Redis (tests/test_auth.py and the adapters' tests send
keyed requests all the way, over real processes)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from litestar.testing import TestClient

from gateway.core.settings import Settings
from gateway.server.app import create_app

pytestmark = [
    pytest.mark.timeout(60),
    # Building the whole app: Litestar 2.25 warns about its handlers' inferred dependencies
    # and path parameters (Litestar 3 wants them marked); the served gateway does not run
    # with warnings as errors, and this test is about the key check.
    pytest.mark.filterwarnings(
        "ignore::litestar.exceptions.base_exceptions.LitestarDeprecationWarning"
    ),
]

KEY = "k-guard-1"
TGI = ["/", "/generate", "/generate_stream"]
OIP = ["/v2/models/synthetic/generate", "/v2/models/synthetic/generate_stream"]
OPENAI = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"]


@pytest.fixture
def client() -> Iterator[TestClient]:  # type: ignore[type-arg]
    settings = Settings(key_prefix=f"t-{secrets.token_hex(4)}", api_keys=KEY)
    yield TestClient(app=create_app(settings))  # not entered: no lifespan, no Redis


MALFORMED = b"{not json"


def test_without_a_key_every_guarded_endpoint_answers_401_in_its_format(
    client: TestClient,  # type: ignore[type-arg]
) -> None:
    headers: dict[str, str] = {}
    for path in TGI:
        refused = client.post(path, json={"inputs": "hi"}, headers=headers)
        assert refused.status_code == 401, path
        assert refused.json()["error_type"] == "invalid_api_key", path
    assert client.get("/info", headers=headers).status_code == 401
    for path in OIP:
        refused = client.post(path, json={"text_input": "hi"}, headers=headers)
        assert refused.status_code == 401, path
        assert list(refused.json()) == ["error"] and "API key" in refused.json()["error"]
    assert client.get("/v2/models/synthetic/ready", headers=headers).status_code == 401
    for path in ["/v1/sessions", *OPENAI]:
        refused = client.post(path, json={}, headers=headers)
        assert refused.status_code == 401, path
        assert refused.json()["error"]["code"] == "invalid_api_key", path


def test_a_key_that_is_not_static_before_the_keys_first_load_is_told_to_try_again(
    client: TestClient,  # type: ignore[type-arg]
) -> None:
    """Without its lifespan the app never loaded the run-time keys (a gateway that started
    while Redis was down): a key that is not a static one may be a valid run-time key, so
    it is neither refused (401) nor served as anonymous, but told to try again."""
    headers = {"Authorization": "Bearer wrong"}
    for path in TGI:
        answer = client.post(path, json={"inputs": "hi"}, headers=headers)
        assert answer.status_code == 503, path
        assert "not loaded yet" in answer.json()["error"], path  # TGI's own error_type
        assert answer.headers["retry-after"] == "1"
    for path in OIP:
        answer = client.post(path, json={"text_input": "hi"}, headers=headers)
        assert answer.status_code == 503, path
        assert "not loaded yet" in answer.json()["error"]
    for path in ["/v1/sessions", *OPENAI]:
        answer = client.post(path, json={}, headers=headers)
        assert answer.status_code == 503, path
        assert answer.json()["error"]["code"] == "keys_not_loaded", path
        assert answer.headers["retry-after"] == "1"


def test_the_key_is_checked_before_the_body_is_read_and_a_keyed_request_passes(
    client: TestClient,  # type: ignore[type-arg]
) -> None:
    json_type = {"Content-Type": "application/json"}
    for path in [*TGI, *OIP, "/v1/sessions", *OPENAI]:
        refused = client.post(path, content=MALFORMED, headers=json_type)
        assert refused.status_code == 401, path
        keyed = {**json_type, "Authorization": f"Bearer {KEY}"}
        answered = client.post(path, content=MALFORMED, headers=keyed)
        assert answered.status_code in (400, 422), (path, answered.text)  # the body's turn
