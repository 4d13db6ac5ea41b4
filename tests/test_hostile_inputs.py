"""Hostile input: schema-driven fuzzing (schemathesis) and hypothesis-made bodies.

Guarantee 5 of docs/reliability.md: no input gets a 5xx, crashes the gateway, or
disturbs another client's stream.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.hostile import json_values, names_the_fix
from tests.support.http import Session, create_session, read_events, send
from tests.support.oracle import synthetic_text
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(300)

message_bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda value: json.dumps(value).encode()),
    st.fixed_dictionaries(
        {"content": st.text(max_size=60)},
        optional={
            "max_tokens": json_values,
            "temperature": json_values,
            "top_p": json_values,
            "top_k": json_values,
            "stop": json_values,
            "seed": json_values,
        },
    ).map(lambda value: json.dumps(value).encode()),
    st.integers(min_value=1, max_value=4000).map(lambda depth: b"[" * depth + b"]" * depth),
)


def schemathesis_run(url: str, examples: int, report: Path) -> dict[str, object]:
    import subprocess

    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{url}/schema/openapi.json",
        "-n",
        str(examples),
        "--seed",
        "1",
        "--checks",
        "not_a_server_error",
        # events: an endless stream, read by the tests instead. The API adapters'
        # generations (a Responses request included) run at this test's slow engine speed;
        # they have their own fuzz run over a fast engine
        # (tests/test_adapter_hostile_inputs.py); so has TGI's `POST /`.
        "--exclude-path-regex",
        "events|completions|responses|generate|info|^/$",
        "--report",
        "json",
        "--report-json-path",
        str(report),
    ]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert finished.returncode == 0, finished.stdout[-3000:]
    result: dict[str, object] = json.loads(report.read_text())
    return result


async def test_fuzzed_requests_get_no_server_error_and_disturb_no_stream(
    stack: Stack, tmp_path: Path
) -> None:
    stack.synthetic(tokens_per_s=20)
    gateway = stack.gateway(TOKENSPOUT_MAX_BODY_BYTES="8192")
    async with httpx.AsyncClient(timeout=60) as client:
        bystander = await create_session(client, gateway.url)
        generation = await send(client, bystander, "undisturbed", max_tokens=200)
        watching = asyncio.create_task(
            read_events(client, bystander, until_final_of=generation, timeout_s=200)
        )
        report = await asyncio.to_thread(schemathesis_run, gateway.url, 70, tmp_path / "st.json")
        cases = report["test_cases"]
        assert isinstance(cases, dict)
        assert cases["generated"] >= 700 and cases["with_failures"] == 0
        bodies = await asyncio.to_thread(hostile_bodies, gateway.url, bystander)
        print(
            f"\nhostile inputs: {cases['generated']} schema-driven + {bodies} hypothesis bodies,"
            " 0 server errors"
        )
        reading = await watching
        assert reading.text(generation) == synthetic_text("undisturbed", 200)
        assert gateway.process.poll() is None


def hostile_bodies(base: str, bystander: Session) -> int:
    """POST hypothesis-made bodies at a real session; every answer is a 4xx or a 202."""
    sent = 0
    with httpx.Client(timeout=30) as client:
        victim = client.post(f"{base}/v1/sessions").json()
        url = f"{base}/v1/sessions/{victim['session_id']}/messages"
        headers = {"X-Session-Token": victim["token"], "content-type": "application/json"}

        @settings(
            max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(body=message_bodies)
        def post(body: bytes) -> None:
            nonlocal sent
            response = client.post(url, content=body, headers=headers)
            sent += 1
            assert response.status_code < 500, (body[:200], response.text)
            assert response.headers["content-type"].startswith("application/json")
            if response.status_code >= 400:
                names_the_fix(response)  # the field, the limit, or where the JSON breaks
            if response.status_code == 202:  # a valid one got through: stop it again
                generation = response.json()["generation_id"]
                cancel = client.post(
                    f"{base}/v1/sessions/{victim['session_id']}/generations/{generation}/cancel",
                    headers=headers,
                )
                assert cancel.status_code == 200

        post()
        for last_event_id in ("", "0", "abc", "1-", "-1-1", "99999999999999999999-0", "1-2-3"):
            with client.stream(
                "GET",
                bystander.events_url,
                params={"token": bystander.token, "last_event_id": last_event_id, "x": "1"},
                headers={"Last-Event-ID": last_event_id},
            ) as response:
                sent += 1
                assert response.status_code < 500
                if response.status_code >= 400:
                    response.read()
                    names_the_fix(response)
    return sent
