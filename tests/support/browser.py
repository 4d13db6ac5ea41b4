"""Drive the web chat (web/) in Debian's headless Chromium through Playwright's async API.

Nothing here downloads a browser: Playwright launches /usr/bin/chromium (``make browser``
installs it). Shared by tests/test_web_chat_*.py and tests/screenshots.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from playwright.async_api import Browser, Locator, Page, async_playwright

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
STORE_KEY = "tokenspout.chat.v1"


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
    ) -> ChatPage:
        """The page at ``url``; with ``connected``, once its event stream is open. Every URL
        the page requests is appended to ``requests``; ``init_script`` runs before the
        page's own scripts."""
        context = await browser.new_context(viewport=viewport or {"width": 1000, "height": 760})
        page = await context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        if requests is not None:
            page.on("request", lambda request: requests.append(request.url))
        if init_script is not None:
            await page.add_init_script(init_script)
        query = f"?max_tokens={max_tokens}" if max_tokens else ""
        await page.goto(f"{url}/{query}")
        chat = cls(page, errors)
        if connected:
            await chat.wait_connected()
        return chat

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
        return await reply.locator(".content").text_content() or ""

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

    async def banner(self) -> str | None:
        """The banner's text while it is shown, else None."""
        if not await self.page.is_visible("#banner"):
            return None
        return await self.page.text_content("#banner-text")

    async def user_texts(self) -> list[str]:
        return await self.page.locator("li.msg.user .bubble").all_text_contents()

    async def conn_state(self) -> str:
        return await self.page.get_attribute("#conn", "data-state") or ""

    async def saved(self) -> dict[str, Any]:
        raw = await self.page.evaluate(f"sessionStorage.getItem({json.dumps(STORE_KEY)})")
        assert raw, "the page keeps no session in sessionStorage"
        saved: dict[str, Any] = json.loads(raw)
        return saved

    async def stats(self) -> dict[str, str | None]:
        stats = self.last_reply.locator(".stats")
        return {
            "text": await stats.text_content(),
            "ttft_ms": await stats.get_attribute("data-ttft-ms"),
            "tokens_per_s": await stats.get_attribute("data-tokens-per-s"),
            "model": await self.page.text_content("#model-name"),
        }
