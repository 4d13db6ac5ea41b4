"""The web chat (web/) in headless Chromium against a real gateway, Redis and engine: the
page itself: keys, the keyboard, a phone screen, what it requests, refused storage, the
model picker."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from playwright.async_api import Browser

from tests.support.browser import ChatPage
from tests.support.oracle import synthetic_text
from tests.support.stack import Stack

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


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
    # The key stays with the tab: a new chat starts without asking again, and a reload too.
    await page.click("#new-chat")
    await chat.wait_connected()
    await page.reload()
    await chat.wait_connected()
    assert await page.is_hidden("#key-form")
    assert await page.is_hidden("#key-form")
    await chat.send("second chat")
    await chat.wait_reply_state("done")
    assert await chat.user_texts() == ["second chat"]
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
    for _ in range(10):
        await keyboard.press("Tab")
        reached.append(await focused())
    assert {"new-chat", "open-settings", "input"} <= set(reached), reached
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
        "() => document.getElementById('model-picker').value === 'synthetic'", timeout=15_000
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
    # The owner cookie authorises the page's session: no token in any URL (nor proxy logs).
    assert [url for url in requests if "token=" in url] == []
    paths = {urlsplit(url).path for url in requests if url.startswith(gateway.url)}
    session_id = await chat.session_id()
    assert {
        "/",
        "/app.js",
        "/tokenspout.js",
        "/vendor/marked/marked.esm.js",
        "/vendor/dompurify/purify.es.mjs",
        "/vendor/highlight/highlight.min.js",
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
    """Nothing about a conversation is kept in the browser (the server keeps it): with
    storage refusing every write, a reload mid-reply still shows the reply whole, and no
    warning; only keeping settings for new chats, which needs storage, says it failed."""
    stack.synthetic(tokens_per_s=20)
    gateway = stack.gateway()
    # Storage that refuses writes, and every EventSource kept where the test can reach it.
    full = """Storage.prototype.setItem = function () {
        throw new DOMException("the quota has been exceeded", "QuotaExceededError");
    };
    window.__sources = [];
    const Native = window.EventSource;
    window.EventSource = class extends Native {
        constructor(...args) { super(...args); window.__sources.push(this); }
    };"""
    chat = await ChatPage.open(browser, gateway.url, max_tokens=30, init_script=full)
    await chat.send("no storage")
    await chat.wait_words(3)
    await chat.page.reload()
    await chat.wait_connected()
    await chat.wait_reply_state("done")
    assert await chat.reply_text() == synthetic_text("no storage", 30)
    assert await chat.banner() is None
    await chat.page.click("#open-settings")
    await chat.page.check("#set-for-new-chats")
    await chat.page.click("#settings-save")
    banner = await chat.wait_banner()  # shown by the dialog's close event, a task later
    assert "refused to save" in banner and "settings for new chats" in banner
    await chat.page.click("#banner-close")

    # An event whose data is not JSON (as a broken proxy might deliver it): a visible note.
    await chat.page.evaluate(
        """window.__sources.at(-1).dispatchEvent(
            new MessageEvent("token", { data: "{not json", lastEventId: "" }))"""
    )
    banner = await chat.wait_banner()
    assert "could not read" in banner and "token" in banner
    assert await chat.replies.count() == 1
    assert chat.errors == []


async def test_with_two_models_the_picker_sets_the_conversations_model(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(200, "--served-model-name", "alpha")
    stack.synthetic(200, "--served-model-name", "beta")
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=4)
    picker = chat.page.locator("#model-picker")
    assert await picker.is_enabled()
    assert await picker.locator("option").all_text_contents() == ["alpha", "beta"]
    await chat.send("first")
    await chat.wait_reply_state("done")
    await (await chat.action("Reply details")).click()
    assert "Modelalpha" in ((await chat.stats())["text"] or "")

    await picker.select_option("beta")  # the conversation's next replies come from beta
    await chat.page.wait_for_function(
        "() => document.getElementById('announcer').textContent.includes('beta')"
    )
    await chat.send("second")
    await chat.wait_reply_state("done")
    assert await chat.user_texts() == ["first", "second"]
    await (await chat.action("Reply details")).click()
    assert "Modelbeta" in ((await chat.stats())["text"] or "")
    await chat.page.reload()
    await chat.wait_connected()
    await chat.page.wait_for_function(
        "() => document.getElementById('model-picker').value === 'beta'"
    )
    assert chat.errors == []


async def test_with_one_model_the_picker_names_it_and_offers_no_choice(
    stack: Stack, browser: Browser
) -> None:
    stack.synthetic(200)
    gateway = stack.gateway()
    chat = await ChatPage.open(browser, gateway.url, max_tokens=4)
    await chat.send("only one")
    await chat.wait_reply_state("done")
    assert await chat.page.locator("#model-picker").is_disabled()
    assert (await chat.stats())["model"] == "synthetic"
