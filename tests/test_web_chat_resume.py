"""A reply in progress, shown whole wherever the chat is opened: a new tab from the list, a
link in a fresh browser (its owner cookie, nothing else), another device; each reloaded
mid-reply, and compared with the server's own record of the reply, word for word. Then
what a reply was (its ending, its Continue, its figures) after a reload, and the network
coming back. One gateway and synthetic engine shared by the module (every test its own
browser profile: an owner of its own); headless Chromium."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.async_api import Browser, BrowserContext

from stack.redis_server import EmbeddedRedis
from tests.support.browser import PHONE_DEVICE, ChatPage
from tests.support.oracle import synthetic_text
from tests.support.redis_probes import session_events
from tests.support.reset_proxy import ResettingProxy
from tests.support.stack import Gateway, Stack, synthetic_stack

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]
LONG = 240
"""Tokens of the reply each test opens mid-way: 20 s at 12 tokens/s, its middle 10 s in.
Opening it in a fresh browser context, then reloading it, took up to 7 s in the suite's
two processes (with 90 tokens the reply was once past its middle by then)."""


@pytest.fixture(scope="module")
def shared(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, Gateway]]:
    with synthetic_stack(redis_server.url, tmp_path_factory.mktemp("r"), 12) as shared:
        yield shared


async def server_words(stack: Stack, session_id: str, generation_id: str) -> list[str]:
    """The reply as the server has it now: its token events in Redis, in order."""
    events = await session_events(stack.redis_url, stack.prefix, session_id)
    mine = [
        data for kind, data in events if kind == "token" and data["generation_id"] == generation_id
    ]
    return "".join(str(token["text"]) for token in mine).split()


async def shows_the_whole_reply(chat: ChatPage, stack: Stack, session_id: str) -> None:
    """The page shows every word the server had of the running reply, from its first, in
    order (the replay catches up within seconds), and then the whole of it."""
    await chat.wait_connected()
    row = chat.last_reply
    generation_id = await row.get_attribute("data-generation-id")
    assert generation_id, "the page shows no running reply"
    had = await server_words(stack, session_id, generation_id)
    assert 0 < len(had) < LONG // 2, f"no longer mid-reply: {len(had)} words"
    await chat.page.wait_for_function(
        """(n) => [...document.querySelectorAll('li.msg.assistant .content')].at(-1)
            .textContent.split(/\\s+/).filter(Boolean).length >= n""",
        arg=len(had),
    )
    shown = await chat.reply_words()
    now = await server_words(stack, session_id, generation_id)
    assert shown == now[: len(shown)], (shown, now)  # none lost at the start, none doubled
    assert await chat.reply_state() in ("queued", "streaming")


async def way_in(
    browser: Browser, shared: tuple[Stack, Gateway], question: str, context_of: Any
) -> ChatPage:
    """A reply running in a first tab; the chat opened mid-reply by ``context_of(first)``
    (a page of some context, at the conversation), then reloaded: both times it shows the
    server's words. Returns the other page."""
    stack, gateway = shared
    first = await ChatPage.open(browser, gateway.url, max_tokens=LONG)
    await first.send(question)
    await first.wait_words(3)
    session_id = await first.session_id()
    other = ChatPage.on(await context_of(first, session_id))
    await shows_the_whole_reply(other, stack, session_id)
    await other.page.reload()
    await shows_the_whole_reply(other, stack, session_id)
    await other.wait_reply_state("done")
    assert await other.reply_text() == synthetic_text(question, LONG)
    assert await other.user_texts() == [question]
    assert other.errors == [] and first.errors == []
    return other


async def test_a_new_tab_opened_from_the_list_and_reloaded_shows_the_running_reply_whole(
    browser: Browser, shared: tuple[Stack, Gateway]
) -> None:
    async def from_the_list(first: ChatPage, session_id: str) -> Any:
        page = await first.page.context.new_page()
        await page.goto(shared[1].url + "/")
        await page.click(f'#conversations [data-session-id="{session_id}"] a')
        return page

    await way_in(browser, shared, "a story for another tab", from_the_list)


async def test_a_link_in_a_fresh_browser_context_and_a_reload_show_the_running_reply_whole(
    browser: Browser, shared: tuple[Stack, Gateway]
) -> None:
    contexts: list[BrowserContext] = []

    async def by_link(first: ChatPage, session_id: str) -> Any:
        contexts.append(await browser.new_context(storage_state=await first.owner_only()))
        page = await contexts[0].new_page()
        await page.goto(f"{shared[1].url}/#{session_id}")
        return page

    await way_in(browser, shared, "a story for a reopened browser", by_link)
    await contexts[0].close()


async def test_another_device_and_a_reload_show_the_running_reply_whole(
    browser: Browser, shared: tuple[Stack, Gateway]
) -> None:
    contexts: list[BrowserContext] = []

    async def on_a_phone(first: ChatPage, session_id: str) -> Any:
        state = await first.owner_only()
        contexts.append(await browser.new_context(**PHONE_DEVICE, storage_state=state))
        page = await contexts[0].new_page()
        await page.goto(f"{shared[1].url}/#{session_id}")
        return page

    phone = await way_in(browser, shared, "a story for a phone", on_a_phone)
    assert await phone.page.evaluate("navigator.maxTouchPoints") > 0
    assert await phone.page.evaluate("innerWidth") == PHONE_DEVICE["viewport"]["width"]
    await contexts[0].close()


async def test_what_a_reply_was_is_shown_after_a_reload(
    browser: Browser, shared: tuple[Stack, Gateway]
) -> None:
    """Its ending (its token limit, stopped, failed), its Continue and Retry, and its
    figures come back with the conversation (the server's record), in any tab."""
    chat = await ChatPage.open(browser, shared[1].url, max_tokens=3)
    page = chat.page
    await chat.send("to the limit")
    await chat.wait_reply_state("done")
    await page.reload()
    await chat.wait_connected()
    assert await chat.status() == "The reply reached its token limit."
    await (await chat.action("Reply details")).click()
    figures = (await chat.stats())["text"] or ""
    assert "Modelsynthetic" in figures and "Tokens3" in figures and "Time" in figures
    await (await chat.action("Continue the reply")).click()  # offered after the reload
    await chat.wait_reply_state("done")
    assert await chat.reply_text() == synthetic_text("to the limit", 6)

    await chat.send("stop me [[stall]]")
    await chat.wait_reply_state("streaming")
    await page.click("#stop")
    await chat.wait_reply_state("cancelled")
    await chat.send("and [[fail:1]] fail")
    await chat.wait_reply_state("error")
    failed = await chat.status()
    assert failed.startswith("The engine could not finish this reply:")

    other = ChatPage.on(await page.context.new_page())
    await other.page.goto(page.url)
    await other.wait_connected()
    assert [await other.reply_state(i) for i in range(3)] == ["done", "cancelled", "error"]
    statuses = [await chat.status(i) for i in range(3)]  # as the tab that watched them
    assert statuses == ["The reply reached its token limit.", "Stopped", failed]
    assert [await other.status(i) for i in range(3)] == statuses
    assert await other.reply_text(0) == synthetic_text("to the limit", 6)
    retry = other.last_reply.get_by_role("button", name="Retry", exact=True)
    await retry.click()  # answers the failing message again, in place
    await other.wait_reply_state("error")
    assert await other.replies.count() == 3
    assert chat.errors == [] and other.errors == []


async def test_the_badge_says_offline_while_the_network_is_down_and_connected_once_back(
    browser: Browser, shared: tuple[Stack, Gateway]
) -> None:
    """The network drops while a reply streams (the browser says it is offline, and nothing
    comes): the badge says Offline, and stays so while the reply goes on at the server; it
    says Connected once the network is back, and the reply is whole. (Chromium's offline
    mode alone keeps an open stream flowing, and events that flow say the network is back:
    the page went straight back to Connected.)"""
    async with ResettingProxy(shared[1].port) as network:
        chat = await ChatPage.open(browser, network.http_url, max_tokens=40)
        await chat.send("through a flaky network")
        await chat.wait_words(3)
        network.cut()
        await chat.page.context.set_offline(True)
        await chat.page.wait_for_selector('#conn[data-state="offline"]')
        shown = await chat.reply_words()
        await asyncio.sleep(1.0)  # 12 more tokens at the server meanwhile
        assert await chat.conn_state() == "offline"
        assert await chat.reply_words() == shown
        await chat.page.context.set_offline(False)
        network.mend()
        await chat.page.wait_for_selector('#conn[data-state="connected"]', timeout=15_000)
        await chat.wait_reply_state("done")
        assert await chat.reply_text() == synthetic_text("through a flaky network", 40)
        assert await chat.conn_state() == "connected"
        assert chat.errors == []
