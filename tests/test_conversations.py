"""A browser's conversations over the session API (the owner cookie, list, rename, settings,
delete) and the turns that rewrite the history (edit, regenerate, continue), over a real
gateway process, real Redis and the synthetic engine. One stack serves the module: each
test is its own owner (a client without cookies gets a fresh one)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from stack.redis_server import EmbeddedRedis
from tests.support.http import Session, read_events
from tests.support.oracle import synthetic_text
from tests.support.stack import Gateway, Stack
from tests.support.ws import open_ws

pytestmark = pytest.mark.timeout(120)
OWNER = "tokenspout_owner"


@pytest.fixture(scope="module")
def gateway(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    stack = Stack(redis_server.url, f"conv-{secrets.token_hex(4)}", tmp_path_factory.mktemp("c"))
    try:
        stack.synthetic(tokens_per_s=400)
        yield stack.gateway(TOKENSPOUT_MAX_CONVERSATIONS="4")
    finally:
        stack.stop()


@pytest.fixture
async def browser(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    """A client that keeps cookies, as a browser does: one owner."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        yield client


async def create(client: httpx.AsyncClient, **body: Any) -> Session:
    response = await client.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return Session(str(client.base_url).rstrip("/"), response.json()["session_id"], "")


async def turn(client: httpx.AsyncClient, session: Session, path: str, **body: Any) -> str:
    """Post a turn with the owner cookie alone and read its reply to the end."""
    response = await client.post(f"/v1/sessions/{session.session_id}/{path}", json=body)
    assert response.status_code == 202, response.text
    gid = str(response.json()["generation_id"])
    await read_events(client, session, until_final_of=gid)
    return gid


async def history(client: httpx.AsyncClient, session: Session) -> list[tuple[str, str]]:
    response = await client.get(f"/v1/sessions/{session.session_id}")
    assert response.status_code == 200, response.text
    return [(m["role"], m["content"]) for m in response.json()["messages"]]


async def test_the_owner_cookie_is_set_once_strict_and_http_only_and_authorises_its_sessions(
    browser: httpx.AsyncClient, gateway: Gateway
) -> None:
    first = await browser.post("/v1/sessions")
    cookie = first.headers["set-cookie"]
    assert cookie.startswith(f"{OWNER}=")
    lowered = cookie.lower()
    assert "httponly" in lowered and "samesite=strict" in lowered and "path=/" in lowered
    assert "secure" not in lowered  # plain http here
    again = await browser.post("/v1/sessions")
    assert "set-cookie" not in again.headers  # it has one now
    session = Session(gateway.url, first.json()["session_id"], "")
    # Events with the cookie alone: no ?token= in the URL.
    gid = await turn(browser, session, "messages", content="cookie only", max_tokens=3)
    assert gid.startswith("g")
    assert await history(browser, session) == [
        ("user", "cookie only"),
        ("assistant", synthetic_text("cookie only", 3)),
    ]
    # Another owner (no cookie, or someone else's) is refused; the token still works.
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as stranger:
        refused = await stranger.get(f"/v1/sessions/{session.session_id}")
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "bad_session_token"
        token = first.json()["token"]
        allowed = await stranger.get(f"/v1/sessions/{session.session_id}?token={token}")
        assert allowed.status_code == 200
    https = await browser.post("/v1/sessions", headers={"X-Forwarded-Proto": "https"})
    assert "set-cookie" not in https.headers
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as proxied:
        behind_tls = await proxied.post("/v1/sessions", headers={"X-Forwarded-Proto": "https"})
        assert "secure" in behind_tls.headers["set-cookie"].lower()


async def test_the_list_is_the_owners_newest_first_with_title_model_and_settings(
    browser: httpx.AsyncClient, gateway: Gateway
) -> None:
    older = await create(browser, title="Older one")
    newer = await create(browser, system="Be brief.", temperature=0.2, max_tokens=5)
    await turn(browser, older, "messages", content="bump the older one", max_tokens=2)
    listed = (await browser.get("/v1/sessions")).json()["sessions"]
    assert [c["session_id"] for c in listed] == [older.session_id, newer.session_id]
    assert listed[0]["title"] == "Older one"  # a given title stays after the first message
    assert listed[0]["model"] == "synthetic"
    assert listed[0]["updated"] > listed[1]["updated"]
    assert listed[1]["title"] == ""
    assert (listed[1]["system"], listed[1]["temperature"], listed[1]["max_tokens"]) == (
        "Be brief.",
        0.2,
        5,
    )
    await turn(browser, newer, "messages", content="A title from the first message\nnot this")
    listed = (await browser.get("/v1/sessions")).json()["sessions"]
    assert listed[0]["title"] == "A title from the first message"
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as stranger:
        assert (await stranger.get("/v1/sessions")).json() == {"sessions": []}


async def test_settings_apply_to_every_turn_the_request_leaves_them_to(
    browser: httpx.AsyncClient, gateway: Gateway
) -> None:
    session = await create(browser, max_tokens=4, system="You are a test.")
    gid = await turn(browser, session, "messages", content="short by setting")
    assert (await history(browser, session))[-1] == (
        "assistant",
        synthetic_text("short by setting", 4),
    )
    reading = await read_events(browser, session, until_final_of=gid)
    started = next(e.json() for e in reading.of(gid) if e.event == "started")
    # The system prompt reached the engine: its words count in the prompt.
    assert started["prompt_tokens"] == 7  # "You are a test." and "short by setting"
    await turn(browser, session, "messages", content="own limit", max_tokens=2)
    assert (await history(browser, session))[-1] == ("assistant", synthetic_text("own limit", 2))
    changed = await browser.patch(
        f"/v1/sessions/{session.session_id}", json={"max_tokens": 6, "system": None}
    )
    assert changed.status_code == 200, changed.text
    assert changed.json()["max_tokens"] == 6 and changed.json()["system"] == ""
    await turn(browser, session, "messages", content="six now")
    assert (await history(browser, session))[-1] == ("assistant", synthetic_text("six now", 6))


async def test_rename_and_change_refuse_what_they_cannot_take_naming_the_field(
    browser: httpx.AsyncClient,
) -> None:
    session = await create(browser)
    path = f"/v1/sessions/{session.session_id}"
    renamed = await browser.patch(path, json={"title": "  Renamed  "})
    assert renamed.status_code == 200 and renamed.json()["title"] == "Renamed"
    cases: list[tuple[dict[str, Any], int, str | None, str]] = [
        ({"title": "x" * 121}, 422, "title", "120"),
        ({"title": " "}, 422, "title", "1 to 120"),
        ({"temperature": 3}, 422, "temperature", "<= 2"),
        ({"max_tokens": 10**6}, 422, "max_tokens", "TOKENSPOUT_MAX_TOKENS_LIMIT"),
        ({"model": "no-such-model"}, 404, None, "no-such-model"),
        ({}, 422, None, "nothing to change"),
        ({"colour": "red"}, 422, None, "colour"),
    ]
    for body, status, field, words in cases:
        response = await browser.patch(path, json=body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert words in error["message"], (body, error)
        if field is not None:
            assert error.get("field") == field, (body, error)
    assert (await browser.get(path)).json()["title"] == "Renamed"


async def test_delete_stops_the_reply_and_the_conversation_is_gone(
    browser: httpx.AsyncClient,
) -> None:
    session = await create(browser)
    path = f"/v1/sessions/{session.session_id}"
    running = await browser.post(f"{path}/messages", json={"content": "[[stall]] forever"})
    assert running.status_code == 202
    deleted = await browser.delete(path)
    assert deleted.status_code == 204
    assert (await browser.get(path)).status_code == 404
    assert (await browser.delete(path)).status_code == 404
    listed = (await browser.get("/v1/sessions")).json()["sessions"]
    assert session.session_id not in [c["session_id"] for c in listed]


async def test_an_owner_lists_a_bounded_number_of_conversations_and_is_never_refused(
    browser: httpx.AsyncClient,
) -> None:
    """Past TOKENSPOUT_MAX_CONVERSATIONS (4 here) the conversation updated least recently
    leaves the list; creating one never fails (an API client whose HTTP client keeps
    cookies is an owner too: the chaos run made hundreds of sessions through one). The one
    that left the list still opens."""
    kept = [await create(browser) for _ in range(4)]
    await browser.post(f"/v1/sessions/{kept[0].session_id}/messages", json={"content": "hi"})
    fifth = await create(browser)  # kept[1] is now the least recently updated
    listed = [c["session_id"] for c in (await browser.get("/v1/sessions")).json()["sessions"]]
    assert sorted(listed) == sorted(
        [kept[0].session_id, kept[2].session_id, kept[3].session_id, fifth.session_id]
    )
    assert listed[0] == fifth.session_id
    left = await browser.get(f"/v1/sessions/{kept[1].session_id}", headers=kept[1].headers)
    assert left.status_code == 200, left.text
    for _ in range(6):
        await create(browser)
    assert len((await browser.get("/v1/sessions")).json()["sessions"]) == 4


async def test_edit_cuts_the_history_back_to_the_edited_message(
    browser: httpx.AsyncClient,
) -> None:
    session = await create(browser, max_tokens=3)
    for content in ("one", "two", "three"):
        await turn(browser, session, "messages", content=content)
    await turn(browser, session, "messages", content="TWO", edit=2)
    assert await history(browser, session) == [
        ("user", "one"),
        ("assistant", synthetic_text("one", 3)),
        ("user", "TWO"),
        ("assistant", synthetic_text("TWO", 3)),
    ]
    for index in (1, 4, 99):  # an assistant message, past the end
        response = await browser.post(
            f"/v1/sessions/{session.session_id}/messages", json={"content": "x", "edit": index}
        )
        assert response.status_code == 422, response.text
        assert response.json()["error"]["field"] == "edit"
    assert len(await history(browser, session)) == 4


async def test_regenerate_answers_the_last_message_again_in_place(
    browser: httpx.AsyncClient,
) -> None:
    session = await create(browser)
    empty = await browser.post(f"/v1/sessions/{session.session_id}/regenerate")
    assert empty.status_code == 409
    assert empty.json()["error"]["code"] == "nothing_to_regenerate"
    await turn(browser, session, "messages", content="again please", max_tokens=2)
    await turn(browser, session, "regenerate", max_tokens=5)
    assert await history(browser, session) == [
        ("user", "again please"),
        ("assistant", synthetic_text("again please", 5)),
    ]


async def test_continue_extends_the_last_reply_as_one_longer_reply(
    browser: httpx.AsyncClient,
) -> None:
    session = await create(browser)
    refused = await browser.post(f"/v1/sessions/{session.session_id}/continue")
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "nothing_to_continue"
    await turn(browser, session, "messages", content="go on and on", max_tokens=4)
    gid = await turn(browser, session, "continue", max_tokens=5)
    # The synthetic engine goes on with its script: the reply reads as one of 9 tokens,
    # kept as one message.
    assert await history(browser, session) == [
        ("user", "go on and on"),
        ("assistant", synthetic_text("go on and on", 9)),
    ]
    reading = await read_events(browser, session, until_final_of=gid)
    streamed = reading.text(gid)
    assert synthetic_text("go on and on", 4) + streamed == synthetic_text("go on and on", 9)
    # A second continue extends the same message again.
    await turn(browser, session, "continue", max_tokens=1)
    assert (await history(browser, session))[-1] == (
        "assistant",
        synthetic_text("go on and on", 10),
    )


async def view(client: httpx.AsyncClient, session: Session) -> dict[str, Any]:
    response = await client.get(f"/v1/sessions/{session.session_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def ending(record: dict[str, Any]) -> tuple[int, str, str]:
    """A reply record's place, final event and how it ended."""
    final = record["final"]
    how = final.get("finish_reason") or final.get("reason") or final.get("code")
    return record["at"], final["type"], how


async def test_each_replys_ending_is_kept_with_the_conversation(
    browser: httpx.AsyncClient,
) -> None:
    """GET answers how each reply ended, at its message's index (a reply that left no
    message: one past the last), with its model, tokens and time: what a page shows under
    it after a reload. A reply that failed is over once the next message comes."""
    session = await create(browser, max_tokens=3)
    await turn(browser, session, "messages", content="to the limit")
    await turn(browser, session, "messages", content="then [[fail:1]] fails")
    record = await view(browser, session)
    assert [ending(r) for r in record["replies"]] == [
        (1, "done", "length"),
        (3, "error", "engine_error"),  # no message of its own: len(messages) == 3
    ]
    first = record["replies"][0]
    assert first["model"] == "synthetic" and first["turn"] == ""
    assert first["final"]["usage"]["completion_tokens"] == 3 and first["seconds"] > 0
    assert record["running"] is None and record["last_event_id"]
    stopped = await browser.post(
        f"/v1/sessions/{session.session_id}/messages", json={"content": "[[stall]] stop me"}
    )
    gid = stopped.json()["generation_id"]
    cancel = f"/v1/sessions/{session.session_id}/generations/{gid}/cancel"
    assert (await browser.post(cancel)).status_code == 200
    record = await view(browser, session)
    assert [ending(r) for r in record["replies"]] == [
        (1, "done", "length"),
        (4, "cancelled", "user"),  # the failed one's record left with it
    ]


async def test_the_running_reply_is_named_with_where_its_events_begin(
    browser: httpx.AsyncClient,
) -> None:
    """Read after ``running.after``, the stream gives the running reply from its first
    event; the messages hold the question, not the reply yet."""
    session = await create(browser)
    await turn(browser, session, "messages", content="before", max_tokens=2)
    path = f"/v1/sessions/{session.session_id}"
    sent = await browser.post(f"{path}/messages", json={"content": "[[stall:5]] now"})
    gid = sent.json()["generation_id"]
    record = await view(browser, session)
    assert record["running"]["generation_id"] == gid and record["running"]["turn"] == ""
    assert [m["content"] for m in record["messages"]][-1] == "[[stall:5]] now"
    reading = await read_events(
        browser, session, until_event="token", last_event_id=record["running"]["after"]
    )
    assert [(e.event, e.json()["generation_id"]) for e in reading.events][:2] == [
        ("queued", gid),
        ("started", gid),
    ]
    await browser.post(f"{path}/generations/{gid}/cancel")


async def test_regenerate_and_edit_keep_what_they_replaced_and_the_title_follows(
    browser: httpx.AsyncClient,
) -> None:
    """A regenerate keeps the reply it replaces as an earlier version of its message, an
    edit the edited message and all after it; a version of a branch an edit cut goes with
    it. The title follows an edited first message, unless a person gave it."""
    session = await create(browser, max_tokens=2)
    await turn(browser, session, "messages", content="first words")
    await turn(browser, session, "continue", max_tokens=2)
    await turn(browser, session, "regenerate")
    record = await view(browser, session)
    assert [(v["at"], v["turn"]) for v in record["versions"]] == [(1, "regenerate")]
    earlier = record["versions"][0]
    assert earlier["messages"] == [
        {"role": "assistant", "content": synthetic_text("first words", 4)}
    ]
    assert [ending(r) for r in earlier["replies"]] == [(1, "done", "length")]
    assert earlier["replies"][0]["turn"] == "continue"
    assert record["title"] == "first words"

    await turn(browser, session, "messages", content="first, edited", edit=0)
    record = await view(browser, session)
    assert record["title"] == "first, edited"
    assert [(v["at"], v["turn"]) for v in record["versions"]] == [(0, "edit 0")]
    assert [m["content"] for m in record["versions"][0]["messages"]] == [
        "first words",
        synthetic_text("first words", 2),
    ]
    assert [ending(r) for r in record["replies"]] == [(1, "done", "length")]

    path = f"/v1/sessions/{session.session_id}"
    assert (await browser.patch(path, json={"title": "Named"})).status_code == 200
    await turn(browser, session, "messages", content="edited again", edit=0)
    record = await view(browser, session)
    assert record["title"] == "Named" and len(record["versions"]) == 2


async def test_a_websocket_turn_on_a_conversation_keeps_its_own_sampling_fields(
    browser: httpx.AsyncClient, gateway: Gateway
) -> None:
    made = await browser.post("/v1/sessions", json={"max_tokens": 4})
    session_id, token = made.json()["session_id"], made.json()["token"]
    ws = await open_ws(gateway.url, token)
    try:
        await ws.generate("own", "its own limit", session_id=session_id, max_tokens=2)
        assert (await ws.final_of("own"))["type"] == "done"
        assert ws.text("own") == synthetic_text("its own limit", 2)
        await ws.generate("set", "the conversation's", session_id=session_id)
        assert (await ws.final_of("set"))["type"] == "done"
        assert ws.text("set") == synthetic_text("the conversation's", 4)
    finally:
        await ws.conn.close()


@pytest.mark.cluster
async def test_an_owners_conversations_on_a_redis_cluster(cluster_stack: Stack) -> None:
    """The owner's index lives in a slot of its own, apart from its sessions' slots: the
    list, a continue and a delete still hold."""
    cluster_stack.synthetic(tokens_per_s=400)
    gateway = cluster_stack.gateway()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        sessions = [await create(client, title=f"chat {n}") for n in range(3)]
        await turn(client, sessions[0], "messages", content="on a cluster", max_tokens=3)
        await turn(client, sessions[0], "continue", max_tokens=2)
        assert await history(client, sessions[0]) == [
            ("user", "on a cluster"),
            ("assistant", synthetic_text("on a cluster", 5)),
        ]
        listed = (await client.get("/v1/sessions")).json()["sessions"]
        assert [c["title"] for c in listed] == ["chat 0", "chat 2", "chat 1"]
        assert (await client.delete(f"/v1/sessions/{sessions[1].session_id}")).status_code == 204
        listed = (await client.get("/v1/sessions")).json()["sessions"]
        assert [c["title"] for c in listed] == ["chat 0", "chat 2"]
