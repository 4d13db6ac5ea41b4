"""The web chat's features in headless Chromium, each at a desktop width in the light theme
and at a phone width in the dark one, against one real gateway, Redis and synthetic engine
shared by the module (every test is a fresh browser profile: an owner of its own). Each
test leaves a screenshot (docs/screenshots/ with ``python -m tests.screenshots``) and runs
axe-core on what it shows: no serious or critical violation."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page

from stack.redis_server import EmbeddedRedis
from tests.support.browser import DESKTOP, PHONE, ChatPage
from tests.support.oracle import synthetic_text
from tests.support.redis_probes import async_client
from tests.support.stack import Gateway, Stack, synthetic_stack
from wire import ChatMessage, Keys, encode

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]
MAX_CHARS = 1500
"""The gateway's TOKENSPOUT_MAX_MESSAGE_CHARS here: a longer message is refused."""
VIEWS = [
    pytest.param(("desktop", "light"), id="desktop-light"),
    pytest.param(("phone", "dark"), id="phone-dark"),
]


@pytest.fixture(scope="module")
def shared(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, Gateway]]:
    logs = tmp_path_factory.mktemp("w")
    env = {"TOKENSPOUT_MAX_MESSAGE_CHARS": str(MAX_CHARS)}
    with synthetic_stack(redis_server.url, logs, 60, **env) as shared:
        yield shared


@pytest.fixture(params=VIEWS)
async def chat(
    request: pytest.FixtureRequest, shared: tuple[Stack, Gateway], browser: Browser
) -> AsyncIterator[ChatPage]:
    width, scheme = request.param
    page = await ChatPage.open(
        browser,
        shared[1].url,
        max_tokens=4,
        viewport=DESKTOP if width == "desktop" else PHONE,
        color_scheme=scheme,
    )
    page.view = f"{width}-{scheme}"
    yield page
    assert page.errors == []


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """Where screenshots go: TOKENSPOUT_SCREENSHOTS (tests/screenshots.py), else the test's."""
    return Path(os.environ.get("TOKENSPOUT_SCREENSHOTS") or tmp_path)


async def shoot(chat: ChatPage, shots: Path, feature: str) -> None:
    await chat.page.screenshot(path=str(shots / f"chat-{feature}-{chat.view}.png"))


async def accessible(chat: ChatPage) -> None:
    violations = await chat.axe()
    assert violations == [], violations


async def show_list(chat: ChatPage) -> None:
    """The conversation list: always there on a desktop, a drawer on a phone."""
    if await chat.page.is_visible("#open-sidebar"):
        await chat.page.click("#open-sidebar")
        await chat.page.wait_for_selector('.app[data-sidebar="open"] #sidebar', state="visible")


async def reply_done(chat: ChatPage, text: str) -> None:
    await chat.send(text)
    await chat.wait_reply_state("done")


async def test_conversations_are_kept_on_the_server_renamed_and_deleted(
    chat: ChatPage, shots: Path
) -> None:
    page = chat.page
    await reply_done(chat, "first chat")
    first = await chat.session_id()
    await show_list(chat)
    assert await chat.wait_conversations(["first chat"]) == ["first chat"]
    await page.click("#new-chat")  # the old one stays in the list
    await reply_done(chat, "second chat")
    await show_list(chat)
    assert await chat.wait_conversations(["second chat", "first chat"]) == [
        "second chat",
        "first chat",
    ]

    # Another tab of the same browser (its owner cookie) opens the first one from its link.
    other = await page.context.new_page()
    await other.goto(f"{page.url.split('#')[0]}#{first}")
    await other.wait_for_selector("li.msg.assistant .content p")
    assert await other.locator("li.msg.user .content").all_text_contents() == ["first chat"]
    await other.close()

    # A reload shows the same conversation and list.
    await page.reload()
    await chat.wait_connected()
    assert await chat.user_texts() == ["second chat"]
    await show_list(chat)
    # Rename, with the keyboard: the rename button, a title, Enter.
    item = page.locator(f'#conversations [data-session-id="{first}"]')
    await item.get_by_role("button", name="Rename “first chat”").focus()
    await page.keyboard.press("Enter")
    await page.keyboard.type("Renamed chat")
    await page.keyboard.press("Enter")
    await page.wait_for_function(
        "() => [...document.querySelectorAll('#conversations a')]"
        ".some((a) => a.textContent === 'Renamed chat')"
    )
    await shoot(chat, shots, "conversations")
    await accessible(chat)
    # Delete asks first, in a dialog; the list and the server lose it.
    await item.get_by_role("button", name="Delete “Renamed chat”").click()
    assert await page.is_visible("#confirm-delete")
    await accessible(chat)
    await page.click("#delete-confirm")
    await page.wait_for_function(
        "() => document.querySelectorAll('#conversations .conversation').length === 1"
    )
    assert await chat.conversations() == ["second chat"]
    assert (await page.request.get(f"{page.url.split('#')[0]}v1/sessions/{first}")).status == 404


async def test_another_tab_sees_a_running_reply_and_ends_with_all_of_it(
    chat: ChatPage, shared: tuple[Stack, Gateway]
) -> None:
    page = chat.page
    await reply_done(chat, "short first")
    session_id = await chat.session_id()
    longer = await page.request.patch(
        f"{shared[1].url}/v1/sessions/{session_id}", data={"max_tokens": 240}
    )
    assert longer.ok
    await chat.send("a longer one")
    await chat.wait_words(4)
    # Opened mid-reply (it runs 4 s), the other tab follows it from then on, and shows it
    # whole once it ends.
    other = await page.context.new_page()
    await other.goto(f"{shared[1].url}/#{session_id}")
    whole = synthetic_text("a longer one", 240)
    await other.wait_for_function(
        "(whole) => [...document.querySelectorAll('li.msg.assistant .content')]"
        ".at(-1)?.textContent.trim() === whole",
        arg=whole,
        timeout=60_000,
    )
    assert await other.locator("li.msg.assistant").count() == 2
    await chat.wait_reply_state("done")
    await other.close()


async def test_a_resume_point_redis_lost_shows_the_history_and_goes_on(
    shared: tuple[Stack, Gateway], browser: Browser
) -> None:
    """Redis lost the session's events (a restart without its data) and the connection
    broke: the page's place in the stream is ahead of it, the gateway says so
    (``events_lost``), and the page shows the saved history again, says what happened, and
    the next reply streams as usual."""
    keep_sources = """window.__sources = [];
    const Native = window.EventSource;
    window.EventSource = class extends Native {
        constructor(...args) { super(...args); window.__sources.push(this); }
    };"""
    chat = await ChatPage.open(browser, shared[1].url, max_tokens=4, init_script=keep_sources)
    page = chat.page
    await reply_done(chat, "before the loss")
    client = async_client(shared[0].redis_url)
    try:
        await client.delete(Keys(shared[0].prefix).events(await chat.session_id()))
    finally:
        await client.aclose()
    await page.evaluate(
        """() => { const source = window.__sources.at(-1);
                   source.close(); source.dispatchEvent(new Event("error")); }"""
    )
    await page.wait_for_function(
        "() => document.getElementById('banner-text').textContent.includes('lost part')"
    )
    await chat.wait_connected()
    assert await chat.user_texts() == ["before the loss"]
    assert await chat.replies.count() == 1
    await reply_done(chat, "after the loss")
    assert await chat.user_texts() == ["before the loss", "after the loss"]
    assert await chat.reply_text() == synthetic_text("after the loss", 4)
    assert chat.errors == []


async def test_message_actions_continue_copy_regenerate_and_edit(
    chat: ChatPage, shots: Path
) -> None:
    page = chat.page
    text = "tell me more"
    await reply_done(chat, text)
    assert "token limit" in await chat.status()
    # Continue: the engine goes on with the same reply (4 more tokens: the chat's limit).
    await (await chat.action("Continue the reply")).click()
    await chat.wait_reply_state("done")
    assert await chat.reply_text() == synthetic_text(text, 8)
    assert await chat.replies.count() == 1
    await shoot(chat, shots, "actions")
    # Copy.
    await (await chat.action("Copy reply")).click()
    assert await page.evaluate("navigator.clipboard.readText()") == synthetic_text(text, 8)
    # Regenerate: the same question answered again, in place.
    await (await chat.action("Regenerate reply")).click()
    await chat.wait_reply_state("done")
    assert await chat.reply_text() == synthetic_text(text, 4)
    assert await chat.replies.count() == 1
    # Edit and resend: the history is cut back to the edited message.
    user = page.locator("li.msg.user").first
    await user.hover()
    await user.get_by_role("button", name="Edit message").click()
    box = page.get_by_role("textbox", name="Edit your message")
    await box.fill("edited question")
    await accessible(chat)
    await box.press("Enter")
    await page.wait_for_function(
        "() => document.querySelector('li.msg.user')?.textContent.startsWith('edited')"
    )
    await chat.wait_reply_state("done")
    assert await chat.user_texts() == ["edited question"]
    assert await chat.reply_text() == synthetic_text("edited question", 4)
    # The server holds what the page shows.
    await page.reload()
    await chat.wait_connected()
    assert await chat.user_texts() == ["edited question"]
    assert await chat.reply_text() == synthetic_text("edited question", 4)


async def test_earlier_versions_of_a_regenerated_or_edited_message_are_kept_and_browsable(
    chat: ChatPage, shots: Path
) -> None:
    """As in ChatGPT and Open WebUI: "1 / 2" and its arrows under a regenerated reply or an
    edited message show what it replaced, to read; the title follows an edited first
    message; a reload keeps them (the server does)."""
    page = chat.page
    text = "tell me more"
    await reply_done(chat, text)
    await (await chat.action("Continue the reply")).click()
    await chat.wait_reply_state("done")
    await (await chat.action("Regenerate reply")).click()
    await chat.wait_reply_state("done")
    reply = page.locator("li.msg.assistant:not(.earlier)").last
    await reply.locator(".page-of", has_text="2 / 2").wait_for()
    await reply.get_by_role("button", name="Previous version").click()
    earlier = page.locator("li.msg.assistant.earlier")
    assert (await earlier.locator(".content").text_content() or "").strip() == synthetic_text(
        text, 8
    )
    assert await earlier.locator(".page-of").text_content() == "1 / 2"
    assert await reply.is_hidden()
    await shoot(chat, shots, "versions")
    await accessible(chat)
    await earlier.get_by_role("button", name="Next version").click()
    assert await earlier.count() == 0 and await reply.is_visible()
    assert (await reply.locator(".content").text_content() or "").strip() == synthetic_text(text, 4)

    user = page.locator("li.msg.user").first
    await user.hover()
    await user.get_by_role("button", name="Edit message").click()
    await page.get_by_role("textbox", name="Edit your message").fill("what else?")
    await page.keyboard.press("Enter")
    await page.wait_for_function(
        "() => document.querySelector('li.msg.user .content').textContent === 'what else?'"
    )
    await chat.wait_reply_state("done")
    await page.wait_for_function(
        "() => document.getElementById('chat-title').textContent === 'what else?'"
    )
    await page.reload()
    await chat.wait_connected()
    edited = page.locator("li.msg.user").first
    await edited.locator(".page-of", has_text="2 / 2").wait_for()
    await edited.get_by_role("button", name="Previous version").click()
    assert await page.locator("li.msg.user.earlier .content").all_text_contents() == [text]
    shown = await page.locator("li.msg.assistant.earlier .content").all_text_contents()
    assert [t.strip() for t in shown] == [synthetic_text(text, 4)]
    assert await page.text_content("#chat-title") == "what else?"


async def test_new_chats_start_from_the_defaults_and_a_system_prompt_in_force_is_shown(
    chat: ChatPage, shared: tuple[Stack, Gateway], shots: Path
) -> None:
    """A conversation's settings stay its own (a system prompt became every new chat's);
    kept for new chats only when asked; one in force is said above the messages."""
    page = chat.page
    await page.click("#open-settings")
    await page.keyboard.type("Talk like a pirate.")
    await page.click("#settings-save")
    note = page.locator("#system-note")
    assert await note.is_visible()
    assert await page.text_content("#system-text") == "Talk like a pirate."
    await reply_done(chat, "ahoy")
    await shoot(chat, shots, "system")
    await accessible(chat)

    async def new_chat_settings() -> tuple[str, bool]:
        await page.keyboard.press("Control+Shift+O")
        await page.wait_for_function("() => !location.hash && !document.querySelector('li.msg')")
        await page.click("#open-settings")
        settings = (
            await page.input_value("#set-system"),
            await page.is_checked("#set-temperature-default"),
        )
        return settings

    assert await new_chat_settings() == ("", True)  # the documented defaults
    await page.click("#settings-cancel")
    assert await note.is_hidden()
    await reply_done(chat, "count from one to three")
    assert (await session_view(chat, shared))["system"] == ""

    await page.click("#open-settings")
    await page.fill("#set-system", "Be brief.")
    await page.check("#set-for-new-chats")
    await page.click("#settings-save")
    assert await new_chat_settings() == ("Be brief.", True)
    await page.click("#settings-cancel")
    assert await page.text_content("#system-text") == "Be brief."
    await reply_done(chat, "a kept default")
    assert (await session_view(chat, shared))["system"] == "Be brief."


async def session_view(chat: ChatPage, shared: tuple[Stack, Gateway]) -> dict[str, object]:
    answer = await chat.page.request.get(f"{shared[1].url}/v1/sessions/{await chat.session_id()}")
    assert answer.ok
    body: dict[str, object] = await answer.json()
    return body


async def test_a_long_paste_is_kept_whole_and_refused_with_the_limit(
    shared: tuple[Stack, Gateway], browser: Browser
) -> None:
    """More than the box's old 32,000 characters, pasted: all of them stay (they were cut
    without a word), and the gateway's refusal names its limit."""
    chat = await ChatPage.open(browser, shared[1].url, max_tokens=4)
    page = chat.page
    pasted = "forty thousand " * 2667  # 40,005 characters
    await page.evaluate("(text) => navigator.clipboard.writeText(text)", pasted)
    await page.focus("#input")
    await page.keyboard.press("Control+V")
    assert await page.input_value("#input") == pasted
    await page.press("#input", "Enter")
    await chat.wait_reply_state("refused")
    assert str(MAX_CHARS) in await chat.status()
    assert await chat.user_texts() == [pasted]
    assert chat.errors == []


async def test_settings_give_the_conversation_a_system_prompt_temperature_and_limit(
    chat: ChatPage, shared: tuple[Stack, Gateway], shots: Path
) -> None:
    page = chat.page
    await page.click("#open-settings")
    assert await page.is_visible("#settings")
    assert await page.evaluate("document.activeElement.id") == "set-system"
    await page.keyboard.type("Answer in one line.")
    await page.fill("#set-max-tokens", "3")
    assert await page.is_checked("#set-temperature-default")  # a new chat's: the model's
    await page.uncheck("#set-temperature-default")
    await page.locator("#set-temperature").fill("0.3")
    await shoot(chat, shots, "settings")
    await accessible(chat)
    await page.click("#settings-save")
    await reply_done(chat, "set up")
    assert await chat.reply_text() == synthetic_text("set up", 3)
    session = await page.request.get(f"{shared[1].url}/v1/sessions/{await chat.session_id()}")
    body = await session.json()
    assert (body["system"], body["temperature"], body["max_tokens"]) == (
        "Answer in one line.",
        0.3,
        3,
    )
    events = await session_started(shared[0], await chat.session_id())
    # The engine got the system prompt first: its words count in the prompt.
    assert events["prompt_tokens"] == 6  # "Answer in one line." and "set up"
    # A change applies to the next reply.
    await page.click("#open-settings")
    await page.fill("#set-max-tokens", "5")
    await page.click("#settings-save")
    await reply_done(chat, "now five")
    assert await chat.reply_text() == synthetic_text("now five", 5)


async def session_started(stack: Stack, session_id: str) -> dict[str, object]:
    client = async_client(stack.redis_url)
    try:
        entries = await client.xrange(Keys(stack.prefix).events(session_id))
    finally:
        await client.aclose()
    return next(json.loads(f[b"d"]) for _id, f in entries if f[b"t"] == b"started")


MARKDOWN = """## A heading

- one item
- two **items**

| name | value |
| --- | --- |
| a | 1 |

A [link](https://example.com/docs) and `inline code`.

```python
def hello(name):
    return f"hello {name}"
```

<img src=x onerror="window.__pwned=1"> <script>window.__pwned=2</script> ![pic](https://example.com/x.png)
"""


async def test_markdown_is_rendered_sanitised_and_its_code_highlighted(
    chat: ChatPage, shared: tuple[Stack, Gateway], shots: Path
) -> None:
    page = chat.page
    await reply_done(chat, "show markdown")
    # The synthetic engine writes words only: the conversation gets a Markdown reply of
    # a real model's shape straight into its history, and the page opens it again.
    client = async_client(shared[0].redis_url)
    try:
        history = Keys(shared[0].prefix).history(await chat.session_id())
        await client.rpush(history, encode(ChatMessage("user", "and a document?")))
        await client.rpush(history, encode(ChatMessage("assistant", MARKDOWN)))
    finally:
        await client.aclose()
    await page.reload()
    await chat.wait_connected()
    reply = chat.last_reply.locator(".content")
    await reply.locator("pre code.hljs").wait_for()
    assert await reply.locator("h2").all_text_contents() == ["A heading"]
    assert await reply.locator("ul li").all_text_contents() == ["one item", "two items"]
    assert await reply.locator("table td").all_text_contents() == ["a", "1"]
    link = reply.locator("a", has_text="link")
    assert await link.get_attribute("href") == "https://example.com/docs"
    assert await link.get_attribute("rel") == "noopener noreferrer"
    assert await reply.locator("pre code .hljs-keyword").count() >= 1
    assert await reply.get_by_role("button", name="Copy code").count() == 1
    # Raw HTML is text; an image is only a link: nothing runs, nothing loads.
    assert await page.locator("#messages img, #messages script").count() == 0
    assert await page.evaluate("typeof window.__pwned") == "undefined"
    assert 'onerror="window.__pwned=1"' in await reply.text_content()
    await chat.last_reply.scroll_into_view_if_needed()
    await shoot(chat, shots, "markdown")
    await accessible(chat)


async def test_long_messages_collapse_and_the_figures_are_one_click_away(
    chat: ChatPage, shots: Path
) -> None:
    page = chat.page
    long = "\n".join(f"line {n} of a long paste" for n in range(40))
    await reply_done(chat, long)
    user = page.locator("li.msg.user").first
    toggle = user.get_by_role("button", name="Show more")
    assert await toggle.get_attribute("aria-expanded") == "false"
    collapsed = await user.locator(".bubble").bounding_box()
    assert collapsed is not None and collapsed["height"] < 300
    details = chat.last_reply.locator(".details")
    assert await details.is_hidden()
    info = await chat.action("Reply details")
    await info.click()
    assert await info.get_attribute("aria-expanded") == "true"
    stats = await chat.stats()
    assert stats["ttft_ms"] is not None and float(stats["ttft_ms"]) > 0
    assert "Speed" in (stats["text"] or "") and "Tokens4" in (stats["text"] or "")
    await shoot(chat, shots, "details")
    await accessible(chat)
    await toggle.click()
    shown = user.get_by_role("button", name="Show less")
    assert await shown.get_attribute("aria-expanded") == "true"
    expanded = await user.locator(".bubble").bounding_box()
    assert expanded is not None and expanded["height"] > collapsed["height"] * 2


async def test_a_too_long_message_offers_edit_not_retry_and_stays_above_the_composer(
    chat: ChatPage, shots: Path
) -> None:
    page = chat.page
    await chat.send("x " * MAX_CHARS)
    await chat.wait_reply_state("refused")
    status = await chat.status()
    assert str(MAX_CHARS) in status, status
    actions = chat.last_reply.locator(".actions button")
    assert await actions.evaluate_all("(buttons) => buttons.map((b) => b.textContent)") == [
        "Edit message"
    ]
    row = await chat.last_reply.bounding_box()
    composer = await page.locator("#composer").bounding_box()
    assert row is not None and composer is not None
    assert row["y"] + row["height"] <= composer["y"], (row, composer)
    await shoot(chat, shots, "error")
    await accessible(chat)
    await (await chat.action("Edit message")).click()
    box = page.get_by_role("textbox", name="Edit your message")
    await box.fill("a shorter one")
    await box.press("Enter")
    await page.wait_for_function(
        "() => document.querySelectorAll('li.msg.user').length === 1"
        " && document.querySelector('li.msg.user').textContent.startsWith('a shorter')"
    )
    await chat.wait_reply_state("done")
    assert await chat.user_texts() == ["a shorter one"]
    assert await chat.reply_text() == synthetic_text("a shorter one", 4)


async def announcements(page: Page) -> list[str]:
    return list(await page.evaluate("window.__announced ?? []"))


async def wait_announced(page: Page, start: str) -> None:
    """Until the last announcement starts with ``start``: the page announces on the frame
    after the change (page.js ``announce``), so a reply's state comes a frame before it."""
    await page.wait_for_function(
        "(start) => (window.__announced ?? []).at(-1)?.startsWith(start)", arg=start
    )


async def test_keyboard_only_with_a_polite_live_region_for_the_reply(
    chat: ChatPage, shots: Path
) -> None:
    page = chat.page
    await page.evaluate(
        """() => {
        window.__announced = [];
        new MutationObserver(() => {
            const text = document.getElementById("announcer").textContent;
            if (text) window.__announced.push(text);
        }).observe(document.getElementById("announcer"), {childList: true, subtree: true,
                                                          characterData: true});
    }"""
    )
    await accessible(chat)  # the empty page
    assert await page.get_attribute("#announcer", "aria-live") == "polite"
    assert await page.evaluate("document.activeElement.id") == "input"
    await page.keyboard.type("keys only [[stall:3]]")
    await page.keyboard.press("Enter")
    await chat.wait_words(3)
    # A reply that streams is announced when it starts, not token by token.
    assert await announcements(page) == ["The assistant is replying."]
    assert await chat.last_reply.get_attribute("aria-live") is None
    await page.keyboard.press("Escape")
    await chat.wait_reply_state("cancelled")
    assert await chat.status() == "Stopped"
    assert await page.evaluate("document.activeElement.id") == "input"
    await wait_announced(page, "Stopped")
    assert (await announcements(page))[-1] == "Stopped"
    # Tab reaches the reply's actions; Enter on one works.
    await page.keyboard.press("Shift+Tab")
    reached = []
    for _ in range(6):
        reached.append(await page.evaluate("document.activeElement.ariaLabel ?? ''"))
        if reached[-1] == "Regenerate reply":
            break
        await page.keyboard.press("Shift+Tab")
    assert "Regenerate reply" in reached, reached
    await page.keyboard.press("Enter")
    await chat.wait_words(2)
    await page.keyboard.press("Escape")
    await chat.wait_reply_state("cancelled")
    # Ctrl+Shift+O starts a new chat; the old one is in the list.
    await page.keyboard.press("Control+Shift+O")
    await page.wait_for_function("() => !location.hash && !document.querySelector('li.msg')")
    assert await page.evaluate("document.activeElement.id") == "input"
    await reply_done(chat, "a second one")
    await wait_announced(page, "Reply finished.")
    assert (await announcements(page))[-1].startswith("Reply finished. You said: a second")
    await show_list(chat)
    await shoot(chat, shots, "keyboard")
    await accessible(chat)
