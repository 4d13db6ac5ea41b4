"""The web chat (web/) in headless Chromium against a real gateway, Redis and engine: a
reply as the page shows it, through stops, restarts, a killed worker, a reload, errors, a
busy gateway and a message typed while a reply runs."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from playwright.async_api import Browser

from stack import processes
from tests.support.browser import ChatPage
from tests.support.http import create_session, send
from tests.support.oracle import synthetic_text
from tests.support.redis_probes import session_events
from tests.support.stack import Stack, VllmStack
from tests.support.tokens import assert_gap_free_tokens

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


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
    # The figures are one click away (Reply details), not under every reply.
    details = chat.last_reply.locator(".details")
    assert await details.is_hidden()
    await (await chat.action("Reply details")).click()
    assert await details.is_visible()
    stats = await chat.stats()
    assert stats["model"] == "synthetic"
    assert stats["ttft_ms"] is not None and stats["tokens_per_s"] is not None
    assert "Time to first token" in (stats["text"] or "")
    assert "Tokens24" in (stats["text"] or "")
    # The reply is over: Send is back and Enter sends the next turn.
    assert await chat.page.is_visible("#send") and not await chat.page.is_visible("#stop")
    await chat.send("second turn")
    await chat.wait_reply_state("done")
    assert await chat.reply_text() == synthetic_text("second turn", 24)
    assert await chat.user_texts() == ["hello browser", "second turn"]
    assert chat.errors == []


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
    assert await chat.status() == "Stopped"
    stopped = await chat.reply_text()
    # No more text appears (the engine made 10 tokens a second before the stop).
    await asyncio.sleep(1.5)
    assert await chat.reply_text() == stopped
    assert await chat.page.is_visible("#send")

    events = await session_events(stack.redis_url, stack.prefix, await chat.session_id())
    kinds = [kind for kind, _ in events]
    assert kinds[-1] == "cancelled" and kinds.count("cancelled") == 1
    cancelled = events[-1][1]
    assert cancelled["reason"] == "user"
    tokens = [data for kind, data in events if kind == "token"]
    usage = cancelled["usage"]
    assert isinstance(usage, dict)
    # The worker ended it (it reports the tokens it made), long before max_tokens.
    assert usage["completion_tokens"] == assert_gap_free_tokens(tokens) < 200
    assert "".join(str(t["text"]) for t in tokens) == stopped


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
    assert "Tokens40" in ((await chat.stats())["text"] or "")
    assert chat.errors == []


async def test_an_engine_worker_killed_mid_reply_is_continued_and_said_quietly(
    stack: Stack, browser: Browser
) -> None:
    """A `resumed` event (docs/reliability.md, takeover) is no ending: the reply goes on in
    the same bubble, whole, and its details say it continued on another engine."""
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
    assert "continued on another engine" in stats and "Tokens30" in stats
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
    await chat.page.reload()
    await chat.wait_connected()
    assert await chat.page.input_value("#model-picker") == "synthetic"
    assert await chat.user_texts() == ["first question", "second question"]
    assert await chat.reply_text(0) == synthetic_text("first question", 30)
    # The running reply replays from its first event and goes on: no word lost or doubled.
    await chat.wait_reply_state("done")
    assert await chat.replies.count() == 2
    assert await chat.reply_text(1) == synthetic_text("second question", 30)
    await (await chat.action("Reply details")).click()
    stats = await chat.stats()
    assert "Tokens30" in (stats["text"] or "")

    await chat.page.reload()  # and once more with nothing running
    await chat.wait_connected()
    assert await chat.user_texts() == ["first question", "second question"]
    assert [await chat.reply_text(i) for i in range(await chat.replies.count())] == [
        synthetic_text("first question", 30),
        synthetic_text("second question", 30),
    ]
    assert await chat.page.is_enabled("#input")
    assert chat.errors == []


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
    assert chat.errors == []
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
    error = await chat.status()
    assert error.startswith("The engine could not finish this reply:")
    assert "(engine_error)" in error
    # Retry answers the same message again, in place of the failed reply.
    await (await chat.action("Retry")).click()
    await chat.wait_reply_state("error")
    assert await chat.replies.count() == 1
    assert await chat.user_texts() == ["break [[fail:3]] now"]
    assert chat.errors == []


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
    await (await chat.action("Reply details")).click()
    stats = await chat.stats()
    print(f"\nvLLM reply in the page: {text!r}\npage stats: {stats}")
    assert text.strip()
    assert stats["model"] and "SmolLM2" in stats["model"]
    assert stats["ttft_ms"] is not None and float(stats["ttft_ms"]) > 0
    assert stats["tokens_per_s"] is not None and float(stats["tokens_per_s"]) > 0
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
        await chat.wait_reply_state("refused")
        note = await chat.status()
        assert note == "The gateway is busy with other replies right now. Try again in 1 s."
        cancel = await client.post(
            f"{gateway.url}/v1/sessions/{other.session_id}/generations/{running}/cancel",
            headers=other.headers,
        )
        assert cancel.json()["state"] == "cancelled"
    await (await chat.action("Retry")).click()
    await chat.wait_reply_state("done")
    assert await chat.reply_text() == synthetic_text("are you busy?", 3)
    assert await chat.user_texts() == ["are you busy?"]
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
    events = await session_events(stack.redis_url, stack.prefix, await chat.session_id())
    assert [kind for kind, _ in events].count("queued") == 2
    assert chat.errors == []
