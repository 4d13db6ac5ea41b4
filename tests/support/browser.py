"""Drive the web chat (web/) in Debian's headless Chromium through Playwright's async API.

Nothing here downloads a browser: Playwright launches /usr/bin/chromium (``make browser``
installs it). Shared by tests/test_web_chat_*.py and tests/screenshots.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from playwright.async_api import Browser, Locator, Page, async_playwright
from playwright.async_api import TimeoutError as PlaywrightTimeout

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DEFAULTS_STORE = "tokenspout.defaults.v1"
"""Where the page keeps the settings a new chat starts with (max tokens, say)."""
AXE = Path(__file__).resolve().parent.parent / "data" / "axe-core" / "axe.min.js"
DESKTOP = {"width": 1100, "height": 760}
PHONE = {"width": 375, "height": 740}
PHONE_DEVICE: dict[str, Any] = {
    "viewport": {"width": 412, "height": 839},
    "device_scale_factor": 2.625,
    "is_mobile": True,
    "has_touch": True,
    "user_agent": (
        "Mozilla/5.0 (Linux; Android 14; Pixel 7) AppleWebKit/537.36 (KHTML, like Gecko) "
        "Chrome/131.0.0.0 Mobile Safari/537.36"
    ),
}
"""Another device: a phone's screen, touch and user agent (Playwright's "Pixel 7")."""


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield browser
        finally:
            await browser.close()


@dataclass
class ChatPage:
    """The chat page as a person sees it: type, press Enter, read the replies."""

    page: Page
    errors: list[str]
    """Uncaught exceptions of the page's scripts (a test asserts there are none)."""
    view: str = "desktop-light"
    """Its width and theme, for the names of its screenshots."""

    @classmethod
    async def open(
        cls,
        browser: Browser,
        url: str,
        max_tokens: int | None = None,
        viewport: dict[str, int] | None = None,
        connected: bool = True,
        requests: list[str] | None = None,
        init_script: str | None = None,
        color_scheme: Literal["light", "dark"] = "light",
        path: str = "/",
    ) -> ChatPage:
        """The page at ``url`` (a fresh browser profile: a new owner); with ``connected``,
        once it can send. ``max_tokens``: the settings a new chat starts with (the page's
        own, kept in localStorage). Every URL the page requests is appended to
        ``requests``; ``init_script`` runs before the page's own scripts."""
        context = await browser.new_context(viewport=viewport or DESKTOP, color_scheme=color_scheme)
        await context.grant_permissions(["clipboard-read", "clipboard-write"])
        page = await context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        if requests is not None:
            page.on("request", lambda request: requests.append(request.url))
        if max_tokens:
            defaults = json.dumps({"max_tokens": max_tokens})
            await page.add_init_script(
                f"localStorage.getItem({json.dumps(DEFAULTS_STORE)}) ?? "
                f"localStorage.setItem({json.dumps(DEFAULTS_STORE)}, {json.dumps(defaults)})"
            )
        if init_script is not None:
            await page.add_init_script(init_script)
        await page.goto(f"{url}{path}")
        chat = cls(page, errors)
        if connected:
            await chat.wait_connected()
        return chat

    @classmethod
    def on(cls, page: Page) -> ChatPage:
        """The chat in a page the test opened itself (another tab, another profile)."""
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        return cls(page, errors)

    async def wait_connected(self, timeout_s: float = 30) -> None:
        await self.page.wait_for_selector('#conn[data-state="connected"]', timeout=timeout_s * 1000)

    async def send(self, text: str) -> None:
        await self.page.fill("#input", text)
        await self.page.press("#input", "Enter")

    @property
    def replies(self) -> Locator:
        return self.page.locator("li.msg.assistant")

    @property
    def last_reply(self) -> Locator:
        return self.replies.last

    async def reply_text(self, index: int = -1) -> str:
        reply = self.replies.nth(index) if index >= 0 else self.last_reply
        # Markdown's blocks end in a line break (text between the elements): not the text.
        return (await reply.locator(".content").text_content() or "").strip()

    async def reply_state(self, index: int = -1) -> str:
        reply = self.replies.nth(index) if index >= 0 else self.last_reply
        return await reply.get_attribute("data-state") or ""

    async def wait_reply_state(self, *states: str, timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.replies.count():
                state = await self.reply_state()
                if state in states:
                    return state
            await asyncio.sleep(0.05)
        raise TimeoutError(f"the last reply never reached {states}")

    async def wait_words(self, words: int, timeout_s: float = 30) -> str:
        """Wait until the streaming reply shows at least ``words`` words."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.replies.count():
                text = await self.reply_text()
                if len(text.split()) >= words:
                    return text
            await asyncio.sleep(0.03)
        raise TimeoutError(f"the reply never showed {words} words")

    async def owner_only(self) -> Any:
        """What a reopened browser (or another device of the same person) keeps of this
        one: its persistent cookies, the owner's among them; no tab's storage."""
        state = await self.page.context.storage_state()
        return {"cookies": state["cookies"], "origins": []}

    async def reply_words(self) -> list[str]:
        """The last reply's words as shown."""
        return (await self.reply_text()).split()

    async def banner(self) -> str | None:
        """The banner's text while it is shown, else None."""
        if not await self.page.is_visible("#banner"):
            return None
        return await self.page.text_content("#banner-text")

    async def wait_banner(self, timeout_s: float = 10) -> str:
        """The banner's text once it is shown (what shows it may run a task later: a
        dialog's ``close`` event is queued after the dialog closes)."""
        await self.page.wait_for_selector("#banner", state="visible", timeout=timeout_s * 1000)
        return await self.page.text_content("#banner-text") or ""

    async def user_texts(self) -> list[str]:
        return await self.page.locator("li.msg.user .bubble").all_text_contents()

    async def conn_state(self) -> str:
        return await self.page.get_attribute("#conn", "data-state") or ""

    async def session_id(self) -> str:
        """The open conversation's session (the page's address names it)."""
        session_id = str(await self.page.evaluate("location.hash.slice(1)"))
        assert session_id.startswith("s_"), session_id
        return session_id

    async def status(self, index: int = -1) -> str:
        """The line under a reply (stopped, failed, its limit reached), "" for none."""
        reply = self.replies.nth(index) if index >= 0 else self.last_reply
        status = reply.locator(".status")
        return "" if await status.is_hidden() else await status.text_content() or ""

    async def stats(self) -> dict[str, str | None]:
        """The last reply's figures (in its details, one click away)."""
        details = self.last_reply.locator(".details")
        return {
            "text": await details.text_content(),
            "ttft_ms": await details.get_attribute("data-ttft-ms"),
            "tokens_per_s": await details.get_attribute("data-tokens-per-s"),
            "model": await self.page.input_value("#model-picker"),
        }

    async def action(self, name: str, index: int = -1) -> Locator:
        """A message's action button by its label (Copy reply, Regenerate reply, ...)."""
        row = (
            self.page.locator("li.msg").nth(index)
            if index >= 0
            else self.page.locator("li.msg").last
        )
        return row.get_by_role("button", name=name, exact=True)

    async def conversations(self) -> list[str]:
        """The titles in the conversation list, as shown (newest first)."""
        return await self.page.locator("#conversations .conversation-link").all_text_contents()

    async def wait_conversations(self, titles: list[str]) -> list[str]:
        """The list's titles once they are ``titles``: the page reads the list from the
        server after a turn is sent and after a reply ends, so it comes a round trip after
        the reply's state (a read at that moment found it still empty). After 10 s, the
        titles as they are, for the caller's assertion to show."""
        with contextlib.suppress(PlaywrightTimeout):
            await self.page.wait_for_function(
                """(titles) => JSON.stringify([...document.querySelectorAll(
                    "#conversations .conversation-link")].map((a) => a.textContent))
                    === JSON.stringify(titles)""",
                arg=titles,
                timeout=10_000,
            )
        return await self.conversations()

    async def axe(self) -> list[dict[str, Any]]:
        """axe-core's violations of serious or critical impact on the page as it is now."""
        if not await self.page.evaluate("typeof window.axe === 'object'"):
            # Evaluated by the DevTools protocol: the page's CSP (no inline script) stays on.
            await self.page.evaluate(AXE.read_text() + "\n;undefined")
        found = await self.page.evaluate(
            """async () => (await axe.run(document, {resultTypes: ["violations"]})).violations
                .filter((v) => v.impact === "serious" || v.impact === "critical")
                .map((v) => ({id: v.id, impact: v.impact, help: v.help,
                              nodes: v.nodes.map((n) => n.target.join(" ")).slice(0, 5)}))"""
        )
        assert isinstance(found, list)
        return found
