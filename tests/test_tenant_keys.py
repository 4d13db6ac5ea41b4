"""Keys at run time: the admin API and ``python -m gateway keys`` against real gateway
processes and the embedded Redis; a change in force on every replica within a second; the
models a key may use; and the keys of TOKENSPOUT_API_KEYS beside them (tests/test_auth.py
keeps their own behaviour)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from stack.redis_server import EmbeddedRedis
from tests.support.http import all_of, read_events, send
from tests.support.stack import Stack
from tests.support.tenants import (
    ADMIN,
    ADMIN_KEY,
    Key,
    keyed_session,
    make_key,
    until_known,
    usage_total,
)
from wire import Keys
from wire.keys import FairNames

pytestmark = pytest.mark.timeout(120)


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m gateway keys ARGS`` on the stack's Redis and prefix."""
    env = {**os.environ, **stack.base_env()}
    return subprocess.run(
        [sys.executable, "-m", "gateway", "keys", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def cli_json(stack: Stack, *args: str) -> Any:
    done = cli(stack, *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def test_the_admin_api_makes_lists_shows_changes_and_revokes_keys(stack: Stack) -> None:
    """The secret is shown once and Redis keeps only its digest; a change shows at once;
    a revoked key is refused (and can no longer be changed); every refusal names what is
    wrong."""
    stack.synthetic(500)
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    base = f"{gateway.url}/v1/admin"
    async with httpx.AsyncClient(timeout=30) as client:
        key = await make_key(client, gateway.url, "acme", weight=2, models=["synthetic"])
        shown = (await client.get(f"{base}/keys/{key.id}", headers=ADMIN)).json()
        assert "key" not in shown and "digest" not in shown
        assert shown["hint"].startswith(key.secret[:8]) and shown["hint"].endswith(key.secret[-4:])
        assert shown["weight"] == 2 and shown["models"] == ["synthetic"]
        assert shown["limits"] == {
            "concurrent": 0,
            "requests_per_minute": 0,
            "tokens_per_minute": 0,
            "tokens_per_day": 0,
        }
        changed = await client.patch(
            f"{base}/keys/{key.id}",
            json={"name": "acme-prod", "limits": {"requests_per_minute": 60}},
            headers=ADMIN,
        )
        assert changed.status_code == 200, changed.text
        assert changed.json()["name"] == "acme-prod"
        assert changed.json()["limits"]["requests_per_minute"] == 60
        assert changed.json()["weight"] == 2  # not given: kept
        listed = (await client.get(f"{base}/keys", headers=ADMIN)).json()["keys"]
        assert [k["id"] for k in listed] == [key.id]
        records = await _records(stack)
        assert key.secret not in records and key.id in records
        revoked = await client.delete(f"{base}/keys/{key.id}", headers=ADMIN)
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
        await until_known(client, gateway.url, key, known=False)
        refused = await client.get(f"{gateway.url}/v1/models", headers=key.headers)
        assert refused.json()["error"]["message"] == "this API key was revoked"
        await _refusals(client, base, key)


async def _records(stack: Stack) -> str:
    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        records = await redis.hgetall(Keys(stack.prefix).tenant_records)
    finally:
        await redis.aclose()
    return json.dumps({k.decode(): v.decode() for k, v in records.items()})


async def _refusals(client: httpx.AsyncClient, base: str, revoked: Key) -> None:
    """What the admin API refuses, each naming what is wrong."""
    expected: list[tuple[str, str, dict[str, Any] | None, dict[str, str], int, str]] = [
        ("POST", "/keys", {"name": "x"}, {}, 401, "invalid_admin_key"),
        (
            "POST",
            "/keys",
            {"name": "x"},
            {"Authorization": "Bearer nope"},
            401,
            "invalid_admin_key",
        ),
        ("POST", "/keys", {"name": ""}, ADMIN, 422, "invalid_request"),
        ("POST", "/keys", {"name": "x", "weight": 0}, ADMIN, 422, "invalid_request"),
        ("POST", "/keys", {"name": "x", "limits": {"rpm": 1}}, ADMIN, 422, "invalid_request"),
        ("GET", "/keys/k_nobody", None, ADMIN, 404, "unknown_key"),
        ("PATCH", f"/keys/{revoked.id}", {"weight": 3}, ADMIN, 409, "key_revoked"),
        ("DELETE", f"/keys/{revoked.id}", None, ADMIN, 409, "key_revoked"),
        ("GET", "/usage?key=k_nobody", None, ADMIN, 404, "unknown_key"),
        ("GET", "/usage?key=nobody", None, ADMIN, 404, "unknown_key"),
        ("GET", f"/usage?key={revoked.id}&granularity=week", None, ADMIN, 422, "invalid_request"),
        ("GET", f"/usage?key={revoked.id}&start=yesterday", None, ADMIN, 422, "invalid_request"),
    ]
    for method, path, body, headers, status, code in expected:
        answer = await client.request(method, base + path, json=body, headers=headers)
        assert answer.status_code == status, (path, body, answer.text)
        error = answer.json()["error"]
        assert error["code"] == code, (path, body, error)
    unnamed = await client.post(
        f"{base}/keys", json={"name": "x", "limits": {"rpm": 1}}, headers=ADMIN
    )
    assert "rpm" in unnamed.json()["error"]["message"]
    await _wrong_types_and_model_names(client, base, revoked)
    week = await client.get(f"{base}/usage?key={revoked.id}&granularity=week", headers=ADMIN)
    assert week.json()["error"]["field"] == "granularity"
    # A revoked key's usage still answers (its record stays, for the books).
    kept = await client.get(f"{base}/usage", params={"key": revoked.id}, headers=ADMIN)
    assert kept.status_code == 200 and len(kept.json()["data"]) == 25  # a day by hour


async def _wrong_types_and_model_names(client: httpx.AsyncClient, base: str, key: Key) -> None:
    """JSON's own types only ("2" is no number: docs/api.md says a wrong type is 422), and a
    model name whole (a space or a brace, which no served name has, is refused); nothing
    refused is made or changed."""
    before = (await client.get(f"{base}/keys", headers=ADMIN)).json()["keys"]
    refused: list[tuple[str, str, dict[str, Any], str]] = [
        ("POST", "/keys", {"name": "x", "weight": "2"}, "weight"),
        ("POST", "/keys", {"name": "x", "limits": {"concurrent": "2"}}, "limits.concurrent"),
        ("POST", "/keys", {"name": 7}, "name"),
        ("POST", "/keys", {"name": "x", "models": ["Smol LM"]}, "models[0]"),
        ("POST", "/keys", {"name": "x", "models": ["ok", "{tag}"]}, "models[1]"),
        ("PATCH", f"/keys/{key.id}", {"weight": "2"}, "weight"),
        ("PATCH", f"/keys/{key.id}", {"limits": {"tokens_per_day": "5"}}, "limits.tokens_per_day"),
        ("PATCH", f"/keys/{key.id}", {"models": ["a b"]}, "models[0]"),
    ]
    for method, path, body, field in refused:
        answer = await client.request(method, base + path, json=body, headers=ADMIN)
        assert answer.status_code == 422, (body, answer.text)
        error = answer.json()["error"]
        assert (error["code"], error["field"]) == ("invalid_request", field), (body, error)
        assert field in error["message"], error
    assert (await client.get(f"{base}/keys", headers=ADMIN)).json()["keys"] == before


async def test_without_an_admin_key_the_admin_api_is_off(stack: Stack) -> None:
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        off = await client.get(f"{gateway.url}/v1/admin/keys", headers=ADMIN)
    assert off.status_code == 403
    assert off.json()["error"]["code"] == "admin_api_off"
    assert "TOKENSPOUT_ADMIN_KEY" in off.json()["error"]["message"]


async def test_the_cli_shares_the_store_with_a_running_gateway(stack: Stack) -> None:
    """``python -m gateway keys`` on the gateway's Redis: a key it makes serves requests
    (billed to it), its changes and revocation reach the gateway, its usage is the admin
    API's."""
    stack.synthetic(500)
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    made = cli_json(stack, "create", "from-shell", "--models", "synthetic", "--rpm", "100")
    assert made["key"].startswith("tsk_") and made["limits"]["requests_per_minute"] == 100
    key = Key(made["id"], made["key"], made["name"])
    async with httpx.AsyncClient(timeout=30) as client:
        await until_known(client, gateway.url, key)
        session = await keyed_session(client, gateway.url, key)
        gid = await send(client, session, "billed to the shell's key", max_tokens=4)
        final = (await read_events(client, session, until_final_of=gid)).final(gid).json()
        updated = cli_json(stack, "update", key.id, "--weight", "3", "--tpd", "1000")
        assert updated["weight"] == 3 and updated["limits"]["tokens_per_day"] == 1000
        assert updated["limits"]["requests_per_minute"] == 100  # not given: kept
        assert cli_json(stack, "show", key.id)["weight"] == 3
        assert [k["id"] for k in cli_json(stack, "list")["keys"]] == [key.id]
        usage = cli_json(stack, "usage", key.id, "--granularity", "day")
        over_http = await usage_total(client, gateway.url, key.id)
        counts = ("prompt_tokens", "completion_tokens", "total_tokens", "generations")
        assert {c: usage["total"][c] for c in counts} == {c: over_http[c] for c in counts}
        assert usage["total"]["completion_tokens"] == final["usage"]["completion_tokens"] == 4
        assert cli_json(stack, "revoke", key.id)["revoked_at"] is not None
        await until_known(client, gateway.url, key, known=False)
    unknown = cli(stack, "show", "k_nobody")
    assert unknown.returncode == 1 and "no key 'k_nobody'" in unknown.stderr
    wrong = cli(stack, "create", "bad", "--weight", "-1")
    assert wrong.returncode == 1 and "weight" in wrong.stderr
    again = cli(stack, "revoke", key.id)
    assert again.returncode == 1 and "revoked already" in again.stderr
    spaced = cli(stack, "create", "bad", "--models", "Smol LM")
    assert spaced.returncode == 1 and "models[0]" in spaced.stderr


async def test_a_revoked_key_is_refused_by_every_replica_within_a_second(stack: Stack) -> None:
    """Two gateway processes serve a key; revoked through one, both refuse it within 1 s
    (each reads the keys' version every 250 ms), OpenAI's SDK seeing a 401."""
    stack.synthetic(500)
    first = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    second = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    async with httpx.AsyncClient(timeout=30) as client:
        key = await make_key(client, first.url, "short-lived")
        await until_known(client, second.url, key)
        revoked = await client.delete(f"{first.url}/v1/admin/keys/{key.id}", headers=ADMIN)
        assert revoked.status_code == 200
        # Both watched at once, from the moment the revocation answered.
        took = await all_of(
            *(until_known(client, gw.url, key, known=False, within_s=1) for gw in (first, second))
        )
    print(f"\nrevoked -> refused: {[f'{s * 1000:.0f} ms' for s in took]}")
    sdk = openai.AsyncOpenAI(base_url=f"{second.url}/v1", api_key=key.secret, max_retries=0)
    async with sdk:
        with pytest.raises(openai.AuthenticationError):
            await sdk.chat.completions.create(
                model="synthetic", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )


async def test_a_key_uses_only_its_models_and_its_sessions_stop_with_it(stack: Stack) -> None:
    """A key limited to one model gets 403 naming the model and the ones it may use, in
    each API's format (OpenAI, a session); a session made with a key serves that key (its
    usage), and its turns are refused once the key is revoked."""
    stack.synthetic(500)
    stack.synthetic(500, "--served-model-name", "other")
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY, TOKENSPOUT_DEFAULT_MODEL="synthetic")
    async with httpx.AsyncClient(timeout=30) as client:
        key = await make_key(client, gateway.url, "one-model", models=["synthetic"])
        sdk = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key.secret, max_retries=0)
        async with sdk:
            with pytest.raises(openai.PermissionDeniedError) as denied:
                await sdk.completions.create(model="other", prompt="no", max_tokens=2)
            await sdk.completions.create(model="synthetic", prompt="yes", max_tokens=2)
        error = denied.value.body
        assert isinstance(error, dict) and error["code"] == "model_not_allowed"
        assert error["param"] == "model"
        assert "'other'" in error["message"] and "synthetic" in error["message"]
        made = await client.post(
            f"{gateway.url}/v1/sessions", json={"model": "other"}, headers=key.headers
        )
        assert made.status_code == 403 and made.json()["error"]["code"] == "model_not_allowed"
        session = await keyed_session(client, gateway.url, key)
        gid = await send(client, session, "mine", max_tokens=3)
        await read_events(client, session, until_final_of=gid)
        assert (await usage_total(client, gateway.url, key.id))["generations"] == 2
        await client.delete(f"{gateway.url}/v1/admin/keys/{key.id}", headers=ADMIN)
        await until_known(client, gateway.url, key, known=False)
        refused = await client.post(
            f"{session.base}/v1/sessions/{session.session_id}/messages",
            json={"content": "after the revocation"},
            headers=session.headers,
        )
        assert refused.status_code == 401, refused.text
        assert "revoked" in refused.json()["error"]["message"]


async def test_static_keys_serve_beside_run_time_keys(stack: Stack) -> None:
    """With TOKENSPOUT_API_KEYS and an admin key both set, a static key still serves (a
    tenant of its own, billed under its id), a key made at run time too, and a request
    with neither is refused; the static key is no admin key."""
    stack.synthetic(500)
    static = "k-static-4b1e90"
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY, TOKENSPOUT_API_KEYS=static)
    async with httpx.AsyncClient(timeout=30) as client:
        made = await make_key(client, gateway.url, "runtime")
        for secret, status in ((static, 200), (made.secret, 200), ("nope", 401), (None, 401)):
            headers = {"Authorization": f"Bearer {secret}"} if secret else {}
            answer = await client.post(
                f"{gateway.url}/v1/completions",
                json={"model": "synthetic", "prompt": "who", "max_tokens": 2},
                headers=headers,
            )
            assert answer.status_code == status, (secret, answer.text)
        as_admin = await client.get(
            f"{gateway.url}/v1/admin/keys", headers={"Authorization": f"Bearer {static}"}
        )
        assert as_admin.status_code == 401
        static_id = "static-" + hashlib.sha256(static.encode()).hexdigest()[:16]
        assert (await usage_total(client, gateway.url, static_id))["completion_tokens"] == 2
        assert (await usage_total(client, gateway.url, made.id))["completion_tokens"] == 2


async def test_a_keys_weight_is_its_share_in_the_models_fair_queue(stack: Stack) -> None:
    """The weight the admin API gives a key, and then changes, is the weight its requests
    carry into the model's fair share (wire/lua/fair_core.lua); a key without one weighs 1,
    the default, kept nowhere (nor one whose weight went back to 1)."""
    stack.synthetic(500)
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    weights = FairNames(Keys(stack.prefix).fair("synthetic")).weights
    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            heavy = await make_key(client, gateway.url, "heavy", weight=4)
            plain = await make_key(client, gateway.url, "plain")
            for key in (heavy, plain):
                await _completion(client, gateway.url, key)
            assert await redis.hget(weights, heavy.id) == b"4.0"
            assert await redis.hget(weights, plain.id) is None  # 1, the default
            for weight, kept in ((0.5, b"0.5"), (1, None)):
                await client.patch(
                    f"{gateway.url}/v1/admin/keys/{heavy.id}",
                    json={"weight": weight},
                    headers=ADMIN,
                )
                async with asyncio.timeout(2):  # in force within a second
                    while await redis.hget(weights, heavy.id) != kept:
                        await _completion(client, gateway.url, heavy)
    finally:
        await redis.aclose()


async def _completion(client: httpx.AsyncClient, base: str, key: Key) -> None:
    answer = await client.post(
        f"{base}/v1/completions",
        json={"model": "synthetic", "prompt": "weigh", "max_tokens": 1},
        headers=key.headers,
    )
    assert answer.status_code == 200, answer.text


async def test_a_gateway_started_while_redis_is_down_serves_and_tells_keys_to_try_again(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """A gateway that starts while Redis is away answers /health and serves, but cannot judge
    a key made at run time before it has read the keys: 503 keys_not_loaded with Retry-After
    (not 401, not anonymous), until Redis answers and the key is served. The CI run before
    this fix: the gateway waited for the keys before serving, and make run's Ctrl-C test and
    the late-worker test timed out on /health."""
    stack = Stack(restartable_redis.url, "late-keys", tmp_path)
    try:
        first = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
        async with httpx.AsyncClient(timeout=30) as client:
            key = await make_key(client, first.url, "late")
            restartable_redis.stop()
            second = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)  # waits for its /health
            told = await client.get(f"{second.url}/v1/models", headers=key.headers)
            assert told.status_code == 503, told.text
            assert told.json()["error"]["code"] == "keys_not_loaded"
            assert told.headers["retry-after"] == "1"
            restartable_redis.start()
            async with asyncio.timeout(5):
                while (
                    await client.get(f"{second.url}/v1/models", headers=key.headers)
                ).status_code != 200:
                    await asyncio.sleep(0.05)
    finally:
        stack.stop()
