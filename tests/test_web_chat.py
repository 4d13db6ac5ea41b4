"""The web chat (web/) in headless Chromium against a real gateway, Redis and engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
import pytest
import redis.asyncio as aioredis
from playwright.async_api import Browser

from stack import processes
from tests.support.browser import ChatPage, chromium
from tests.support.http import create_session, send
from tests.support.oracle import synthetic_text
from tests.support.stack import Stack, VllmStack
from wire import Keys

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with chromium() as browser:
        yield browser


async def session_events(stack: Stack, session_id: str) -> list[tuple[str, dict[str, object]]]:
    """The session's events as Redis holds them: (type, data)."""
    client = aioredis.Redis.from_url(stack.redis_url)
    try:
        entries = await client.xrange(Keys(stack.prefix).events(session_id))
    finally:
        await client.aclose()
    return [(fields[b"t"].decode(), json.loads(fields[b"d"])) for _id, fields in entries]


async def test_a_reply_grows_token_by_token_then_completes_with_its_stats(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(tokens_per_s=12)
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=24)
    await chat.send("hello browser")
    assert await chat.page.is_visible("#stop")
    seen: list[str] = []
    while await chat.reply_state() not in ("done", "cancelled", "error"):
        text = await chat.reply_text()
        if text and (not seen or text != seen[-1]):
            seen.append(text)
        await asyncio.sleep(0.03)
    final = await chat.reply_text()
    assert final == synthetic_text("hello browser", 24)
    assert len(seen) >= 3, seen
    assert all(final.startswith(step) for step in seen), seen
    assert [len(step) for step in seen] == sorted({len(step) for step in seen})
    assert await chat.user_texts() == ["hello browser"]
    stats = await chat.stats()
    assert stats["model"] == "synthetic"
    assert stats["ttft_ms"] is not None and stats["tokens_per_s"] is not None
    assert "s to first token" in (stats["text"] or "")
    assert "24 tokens" in (stats["text"] or "")
    # The reply is over: Send is back and Enter sends the next turn.
    assert await chat.page.is_visible("#send") and not await chat.page.is_visible("#stop")
    await chat.send("second turn")
    await chat.wait_reply_state("done")
    assert await chat.reply_text() == synthetic_text("second turn", 24)
    assert await chat.user_texts() == ["hello browser", "second turn"]
    assert chat.errors == []


async def test_shift_enter_makes_a_new_line_and_enter_sends(stack: Stack, browser: Browser) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=6)
    await chat.page.focus("#input")
    await chat.page.keyboard.type("first line")
    await chat.page.keyboard.press("Shift+Enter")
    await chat.page.keyboard.type("second line")
    assert await chat.page.input_value("#input") == "first line\nsecond line"
    assert await chat.replies.count() == 0
    await chat.page.keyboard.press("Enter")
    await chat.wait_reply_state("done")
    assert await chat.user_texts() == ["first line\nsecond line"]
    assert await chat.page.input_value("#input") == ""


async def test_stop_ends_the_reply_in_the_page_and_in_the_engine(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(tokens_per_s=10)
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=200)
    await chat.send("please stop me")
    await chat.wait_words(4)
    await chat.page.click("#stop")
    await chat.wait_reply_state("cancelled", timeout_s=15)
    badge = await chat.last_reply.locator(".badge").text_content()
    assert badge == "Stopped"
    stopped = await chat.reply_text()
    # No more text appears (the engine made 10 tokens a second before the stop).
    await asyncio.sleep(1.5)
    assert await chat.reply_text() == stopped
    assert await chat.page.is_visible("#send")

    events = await session_events(stack, (await chat.saved())["id"])
    kinds = [kind for kind, _ in events]
    assert kinds[-1] == "cancelled" and kinds.count("cancelled") == 1
    cancelled = events[-1][1]
    assert cancelled["reason"] == "user"
    tokens = [data["text"] for kind, data in events if kind == "token"]
    usage = cancelled["usage"]
    assert isinstance(usage, dict)
    # The worker ended it (it reports the tokens it made), long before max_tokens.
    assert usage["completion_tokens"] == len(tokens) < 200
    assert "".join(str(t) for t in tokens) == stopped


async def test_a_gateway_restart_mid_reply_loses_and_repeats_no_token(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(tokens_per_s=8)
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=40)
    await chat.send("survive a restart")
    await chat.wait_words(4)
    processes.kill(gateway.process)
    await chat.page.wait_for_selector('#conn:not([data-state="connected"])', timeout=10_000)
    assert await chat.conn_state() in ("reconnecting", "offline")
    await asyncio.sleep(1.0)  # the engine goes on writing into Redis meanwhile
    stack.gateway(port=gateway.port)
    await chat.wait_connected(timeout_s=30)
    await chat.wait_reply_state("done", timeout_s=30)
    assert await chat.reply_text() == synthetic_text("survive a restart", 40)
    assert "40 tokens" in ((await chat.stats())["text"] or "")
    assert chat.errors == []


async def test_an_engine_worker_killed_mid_reply_is_continued_and_said_quietly(
    stack: Stack, browser: Browser
) -> None:
    """A `resumed` event (docs/reliability.md, takeover) is no ending: the reply goes on in
    the same bubble, whole, and its stats line says it continued on another engine."""
    doomed = stack.synthetic(tokens_per_s=8)
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=30)
    await chat.send("survive an engine")
    await chat.wait_words(4)
    stack.synthetic(tokens_per_s=8)
    processes.kill(doomed)
    await chat.wait_reply_state("done", timeout_s=30)
    assert await chat.reply_text() == synthetic_text("survive an engine", 30)
    stats = (await chat.stats())["text"] or ""
    assert "continued on another engine" in stats and "30 tokens" in stats
    assert await chat.banner() is None
    assert chat.errors == []


async def test_a_reload_mid_conversation_brings_back_history_and_the_running_reply(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(tokens_per_s=15)
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=30)
    await chat.send("first question")
    await chat.wait_reply_state("done")
    await chat.send("second question")
    await chat.wait_words(4)
    ttft_before = (await chat.stats())["ttft_ms"]
    assert ttft_before is not None
    await chat.page.reload()
    await chat.wait_connected()
    # The model is named at once, before any new event of the reply.
    assert await chat.page.text_content("#model-name") == "synthetic"
    assert await chat.user_texts() == ["first question", "second question"]
    assert await chat.reply_text(0) == synthetic_text("first question", 30)
    await chat.wait_reply_state("done")
    assert await chat.replies.count() == 2
    assert await chat.reply_text(1) == synthetic_text("second question", 30)
    # The resumed reply keeps the time to first token measured before the reload, and its
    # rate comes from the events' server times, not from how fast a replay arrived (the
    # engine makes 15 tokens a second; a replay comes in thousands).
    stats = await chat.stats()
    assert stats["ttft_ms"] == ttft_before
    assert "resumed after a reload" in (stats["text"] or "")
    assert stats["tokens_per_s"] is not None and 0 < float(stats["tokens_per_s"]) < 60, stats

    await chat.page.reload()  # and once more with nothing running
    await chat.wait_connected()
    assert await chat.page.text_content("#model-name") == "synthetic"
    assert await chat.user_texts() == ["first question", "second question"]
    assert [await chat.reply_text(i) for i in range(await chat.replies.count())] == [
        synthetic_text("first question", 30),
        synthetic_text("second question", 30),
    ]
    assert await chat.page.is_enabled("#input")


async def test_html_in_a_message_or_reply_is_shown_as_text_and_never_runs(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(tokens_per_s=100)
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=12)
    attack = '<img src=x onerror="window.__pwned=1"> <script>window.__pwned=2</script> **bold**'
    await chat.send(attack)
    await chat.wait_reply_state("done")
    assert await chat.page.evaluate("typeof window.__pwned") == "undefined"
    assert await chat.page.locator("#messages img, #messages script").count() == 0
    assert await chat.user_texts() == [attack]
    # The model "replies" with the same markup: shown literally, **bold** rendered as bold.
    expected = synthetic_text(attack, 12).replace("**bold**", "bold")
    assert await chat.reply_text() == expected
    assert '<img src=x onerror="window.__pwned=1">' in await chat.reply_text()
    assert await chat.last_reply.locator(".content strong").all_text_contents() == ["bold"]


async def test_an_engine_error_is_shown_in_words_with_a_retry(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(tokens_per_s=2000)  # the error lands in the frame of the last token
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=20)
    await chat.send("break [[fail:3]] now")
    await chat.wait_reply_state("error")
    error = await chat.last_reply.locator(".error-text").text_content()
    assert error and error.startswith("The engine could not finish this reply:")
    retry = chat.last_reply.get_by_role("button", name="Retry")
    await retry.click()
    await chat.wait_reply_state("error")
    assert await chat.replies.count() == 2
    assert await chat.user_texts() == ["break [[fail:3]] now"] * 2


@pytest.mark.vllm
@pytest.mark.timeout(900)
async def test_a_vllm_reply_completes_in_the_page_with_ttft_and_rate(
    vllm_stack: VllmStack, browser: Browser
) -> None:
    chat = await ChatPage.open(browser, vllm_stack.gateway.url, max_tokens=48)
    await chat.send("Name three colours of the rainbow.")
    await chat.wait_words(1, timeout_s=120)
    state = await chat.wait_reply_state("done", "error", timeout_s=300)
    assert state == "done"
    text = await chat.reply_text()
    stats = await chat.stats()
    print(f"\nvLLM reply in the page: {text!r}\npage stats: {stats}")
    assert text.strip()
    assert stats["model"] and "SmolLM2" in stats["model"]
    assert stats["ttft_ms"] is not None and float(stats["ttft_ms"]) > 0
    assert stats["tokens_per_s"] is not None and float(stats["tokens_per_s"]) > 0
    assert chat.errors == []


async def test_with_api_keys_the_page_asks_for_one_and_says_when_it_is_wrong(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(tokens_per_s=500)
    gateway = stack.gateway(TOKENSPOUT_API_KEYS="web-key-41c7e2")
    chat = await ChatPage.open(browser, gateway.url, max_tokens=4, connected=False)
    page = chat.page
    await page.wait_for_selector("#key-form", state="visible", timeout=15_000)
    assert await page.get_attribute("#api-key", "type") == "password"
    assert await page.is_hidden("#key-error")
    assert await chat.conn_state() == "locked"
    assert await page.is_disabled("#send") or await page.is_hidden("#send")

    await page.fill("#api-key", "not-the-key")
    await page.press("#api-key", "Enter")
    await page.wait_for_selector("#key-error", state="visible", timeout=15_000)
    assert "not accepted" in (await page.text_content("#key-error") or "")
    assert await page.is_visible("#key-form")
    assert await page.evaluate("sessionStorage.getItem('tokenspout.apiKey.v1')") is None

    await page.fill("#api-key", "web-key-41c7e2")
    await page.click("#key-submit")
    await chat.wait_connected()
    assert await page.is_hidden("#key-form")
    assert await page.input_value("#api-key") == ""
    stored = await page.evaluate("sessionStorage.getItem('tokenspout.apiKey.v1')")
    assert stored == "web-key-41c7e2"
    await chat.send("keyed page")
    await chat.wait_reply_state("done")
    assert await chat.reply_text() == synthetic_text("keyed page", 4)
    # The key stays with the tab: a new chat starts without asking again.
    await page.click("#new-chat")
    await chat.wait_connected()
    assert await page.is_hidden("#key-form")
    await chat.send("second chat")
    await chat.wait_reply_state("done")
    assert await chat.user_texts() == ["second chat"]
    assert chat.errors == []


async def test_a_busy_gateway_is_shown_in_words_and_retry_sends_once_there_is_room(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(5, "--capacity", "1")
    gateway = stack.gateway(TOKENSPOUT_MAX_INFLIGHT="1")
    chat = await ChatPage.open(browser, gateway.url, max_tokens=3)
    async with httpx.AsyncClient(timeout=30) as client:
        other = await create_session(client, gateway.url)
        running = await send(client, other, "hold the only slot", max_tokens=200)
        await chat.send("are you busy?")
        await chat.wait_reply_state("error")
        badge = await chat.last_reply.locator(".badge").text_content()
        assert badge == "Not sent"
        note = await chat.last_reply.locator(".error-text").text_content()
        assert note == "The gateway is busy with other replies right now. Try again in 1 s."
        cancel = await client.post(
            f"{gateway.url}/v1/sessions/{other.session_id}/generations/{running}/cancel",
            headers=other.headers,
        )
        assert cancel.json()["state"] == "cancelled"
    await chat.last_reply.get_by_role("button", name="Retry").click()
    await chat.wait_reply_state("done")
    assert await chat.reply_text() == synthetic_text("are you busy?", 3)
    assert chat.errors == []


async def test_a_message_typed_while_a_reply_runs_is_kept_and_sent_after_it(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(tokens_per_s=12)
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=24)
    await chat.send("first one")
    await chat.wait_words(3)
    # The box stays editable; Enter (or a submit) while the reply runs starts nothing.
    await chat.send("typed while busy")
    await chat.page.evaluate("document.getElementById('composer').requestSubmit()")
    assert await chat.page.is_hidden("#send") and await chat.page.is_visible("#stop")
    assert await chat.page.input_value("#input") == "typed while busy"
    assert await chat.user_texts() == ["first one"] and await chat.replies.count() == 1
    await chat.wait_reply_state("done")
    assert await chat.page.input_value("#input") == "typed while busy"
    assert await chat.page.is_enabled("#send")
    await chat.page.press("#input", "Enter")
    await chat.wait_reply_state("done")
    assert await chat.user_texts() == ["first one", "typed while busy"]
    assert await chat.reply_text() == synthetic_text("typed while busy", 24)
    assert await chat.page.input_value("#input") == ""
    events = await session_events(stack, (await chat.saved())["id"])
    assert [kind for kind, _ in events].count("queued") == 2
    assert chat.errors == []


async def test_on_a_phone_screen_nothing_scrolls_sideways_and_the_controls_work(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(tokens_per_s=10)
    gateway = stack.gateway()
    width, height = 375, 740
    chat = await ChatPage.open(
        browser, gateway.url, max_tokens=200, viewport={"width": width, "height": height}
    )
    page = chat.page

    async def on_screen(selector: str) -> None:
        assert await page.is_visible(selector), selector
        box = await page.locator(selector).bounding_box()
        assert box is not None, selector
        assert box["x"] >= 0 and box["x"] + box["width"] <= width, (selector, box)
        assert box["y"] >= 0 and box["y"] + box["height"] <= height, (selector, box)

    async def no_sideways_scroll() -> None:
        sideways = await page.evaluate(
            """() => [document.documentElement, document.body, document.getElementById("log")]
                .filter((el) => el.scrollWidth > el.clientWidth)
                .map((el) => el.id || el.tagName)"""
        )
        assert sideways == [], sideways

    await page.fill("#input", "a phone")
    await on_screen("#input")
    await on_screen("#send")
    # A long unbroken word, in the message and in the reply that repeats it.
    await chat.send("phone " + "x" * 160 + " `" + "y" * 120 + "`")
    await chat.wait_words(6)
    await on_screen("#stop")
    await on_screen("#input")
    await no_sideways_scroll()
    await page.click("#stop")
    await chat.wait_reply_state("cancelled", timeout_s=15)
    await page.fill("#input", "next")
    await on_screen("#send")
    assert await page.is_enabled("#send")
    await page.click("#send")
    await chat.wait_words(3)
    await no_sideways_scroll()
    assert await chat.user_texts() == ["phone " + "x" * 160 + " `" + "y" * 120 + "`", "next"]
    assert chat.errors == []


async def test_keyboard_only_tab_reaches_the_controls_enter_sends_escape_stops(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(tokens_per_s=10)
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=200)
    page = chat.page
    keyboard = page.keyboard

    async def focused() -> str:
        return str(await page.evaluate("document.activeElement?.id ?? ''"))

    assert await focused() == "input"  # the page opens ready to type
    await page.evaluate("document.activeElement.blur()")
    reached = []
    for _ in range(8):
        await keyboard.press("Tab")
        reached.append(await focused())
    assert {"new-chat", "input"} <= set(reached), reached
    await page.focus("#input")
    await keyboard.type("only keys")
    await keyboard.press("Tab")
    assert await focused() == "send"
    await keyboard.press("Shift+Tab")
    assert await focused() == "input"
    await keyboard.press("Enter")
    await chat.wait_words(4)
    await keyboard.press("Tab")
    assert await focused() == "stop"
    await keyboard.press("Escape")
    await chat.wait_reply_state("cancelled", timeout_s=15)
    # Stop went away with the reply: the focus is back in the box, ready for the next one.
    assert await focused() == "input"
    assert await chat.user_texts() == ["only keys"]
    assert chat.errors == []


async def test_the_page_requests_nothing_but_the_gateway(stack: Stack, browser: Browser) -> None:
    stack.synthetic(tokens_per_s=100)
    gateway = stack.gateway()
    requests: list[str] = []
    chat = await ChatPage.open(browser, gateway.url, max_tokens=12, requests=requests)
    # Before any reply the top bar names the model the workers serve (GET /v1/models).
    await chat.page.wait_for_function(
        "document.getElementById('model-name').textContent === 'synthetic'", timeout=15_000
    )
    await chat.send("where do you go?")
    await chat.wait_reply_state("done")
    assert await chat.reply_text() == synthetic_text("where do you go?", 12)
    elsewhere = [
        url
        for url in requests
        if not url.startswith(f"{gateway.url}/") and urlsplit(url).scheme != "data"
    ]
    assert elsewhere == [], elsewhere
    paths = {urlsplit(url).path for url in requests if url.startswith(gateway.url)}
    session_id = (await chat.saved())["id"]
    assert {
        "/",
        "/app.js",
        "/style.css",
        "/v1/sessions",
        "/v1/models",
        f"/v1/sessions/{session_id}/events",
        f"/v1/sessions/{session_id}/messages",
    } <= paths, paths
    assert chat.errors == []


async def test_storage_refusals_and_unreadable_events_are_shown_not_fatal(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    full = """Storage.prototype.setItem = function () {
        throw new DOMException("the quota has been exceeded", "QuotaExceededError");
    };"""
    chat = await ChatPage.open(browser, gateway.url, max_tokens=6, init_script=full)
    banner = await chat.banner()
    assert banner and "cannot save the conversation" in banner
    await chat.send("no storage")
    await chat.wait_reply_state("done")
    assert await chat.reply_text() == synthetic_text("no storage", 6)

    # An event whose data is not JSON (as a broken proxy might deliver it): a visible note.
    await chat.page.evaluate(
        """chat.source.dispatchEvent(
            new MessageEvent("token", { data: "{not json", lastEventId: "" }))"""
    )
    banner = await chat.banner()
    assert banner and "could not read" in banner and "token" in banner
    assert await chat.replies.count() == 1
    assert chat.errors == []


async def test_with_two_models_the_page_offers_a_picker_and_each_chat_keeps_its_model(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(200, "--served-model-name", "alpha")
    stack.synthetic(200, "--served-model-name", "beta")
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=4)
    picker = chat.page.locator("#model-picker")
    assert await picker.is_visible()
    assert await picker.locator("option").all_text_contents() == ["alpha", "beta"]
    await chat.send("first")
    await chat.wait_reply_state("done")
    assert (await chat.stats())["model"] == "alpha"

    await picker.select_option("beta")  # a new conversation with the other model
    await chat.wait_connected()
    await chat.send("second")
    await chat.wait_reply_state("done")
    assert await chat.user_texts() == ["second"]
    assert (await chat.stats())["model"] == "beta"
    await chat.page.reload()
    await chat.wait_connected()
    assert await picker.input_value() == "beta"


async def test_with_one_model_there_is_no_picker(stack: Stack, browser: Browser) -> None:
    stack.synthetic(200)
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=4)
    await chat.send("only one")
    await chat.wait_reply_state("done")
    assert not await chat.page.locator("#model-picker").is_visible()
    assert (await chat.stats())["model"] == "synthetic"
