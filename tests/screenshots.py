"""Take the web chat's screenshots (README.md, docs/web.md): mid-reply, after Stop, and the
conversation opened on a phone while a reply runs, then one per feature at a desktop width
in light and a phone width in dark.

    python -m tests.screenshots [--out docs/screenshots]

The first two come from here; the features' from tests/test_web_chat_features.py, run with
TOKENSPOUT_SCREENSHOTS pointing at ``--out`` (each test takes its own). Everything runs its
own Redis, gateway and synthetic engine (the same real parts the tests use) and drives
Debian's headless Chromium; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import tempfile
from pathlib import Path

import pytest
from playwright.async_api import Browser

from stack.redis_server import EmbeddedRedis
from tests.support.browser import PHONE_DEVICE, ChatPage, chromium
from tests.support.stack import Stack

FIRST = "What makes **tokenspout** different from other gateways?"
SECOND = "Explain how Stop works, in a few words."
THIRD = "And a reload, in another tab or on a phone?"
VIEWPORT = {"width": 1000, "height": 640}


async def take(stack: Stack, out: Path) -> None:
    stack.synthetic(tokens_per_s=14)
    gateway = stack.gateway()
    async with chromium() as browser:
        chat = await ChatPage.open(browser, gateway.url, max_tokens=34, viewport=VIEWPORT)
        await chat.send(FIRST)
        await chat.wait_reply_state("done")
        await chat.send(SECOND)
        await chat.wait_words(14)
        await chat.page.screenshot(path=str(out / "chat-streaming.png"))
        await chat.wait_words(20)
        await chat.page.click("#stop")
        await chat.wait_reply_state("cancelled")
        await chat.page.focus("#input")
        await chat.page.screenshot(path=str(out / "chat-stopped.png"))
        await resumed_elsewhere(browser, chat, gateway.url, out)


async def resumed_elsewhere(browser: Browser, chat: ChatPage, url: str, out: Path) -> None:
    """The conversation opened on a phone (the same owner) while a reply runs: the reply
    whole, from its first word."""
    await chat.send(THIRD)
    await chat.wait_words(12)
    phone = await browser.new_context(
        **PHONE_DEVICE, color_scheme="dark", storage_state=await chat.owner_only()
    )
    page = await phone.new_page()
    await page.goto(f"{url}/#{await chat.session_id()}")
    await page.wait_for_function(
        """() => [...document.querySelectorAll('li.msg.assistant .content')].at(-1)
            ?.textContent.split(/\\s+/).filter(Boolean).length >= 16"""
    )
    await page.screenshot(path=str(out / "chat-resumed-phone.png"))
    await phone.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as logs:
        stack = Stack(server.url, f"shot-{secrets.token_hex(4)}", Path(logs))
        try:
            asyncio.run(take(stack, args.out))
        finally:
            stack.stop()
    os.environ["TOKENSPOUT_SCREENSHOTS"] = str(args.out.resolve())
    features = Path(__file__).with_name("test_web_chat_features.py")
    if pytest.main([str(features), "-q", "-p", "no:randomly"]) != 0:
        raise SystemExit("a feature test failed: its screenshot may be missing")
    print(f"wrote the screenshots in {args.out}")


if __name__ == "__main__":
    main()
