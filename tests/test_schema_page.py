"""``/schema`` in a real browser with no network beyond the gateway: Redoc renders the
gateway's API and searches it (the page used to load Redoc and fonts from CDNs and stayed
blank offline), and asks no other host for anything."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from playwright.async_api import Browser, Request, Route

from tests.support.stack import Stack

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]


async def test_the_schema_page_renders_offline(stack: Stack, browser: Browser) -> None:
    gateway = stack.gateway()
    own = urlsplit(gateway.url).netloc
    elsewhere: list[str] = []

    async def offline(route: Route, request: Request) -> None:
        if urlsplit(request.url).netloc in (own, ""):
            await route.continue_()
        else:
            elsewhere.append(request.url)
            await route.abort("internetdisconnected")

    context = await browser.new_context()
    try:
        await context.route("**/*", offline)
        page = await context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        await page.goto(f"{gateway.url}/schema")
        # Redoc's rendering of the session API: its tag and an operation's summary.
        await page.locator("h2", has_text="Send a message").first.wait_for(timeout=30_000)
        assert await page.locator("h1", has_text="tokenspout").count() >= 1
        # Its search runs in a worker made from a blob (the page's policy allows it).
        await page.get_by_placeholder("Search...").fill("cancel")
        found = page.locator("text=Stop a generation (idempotent) >> visible=true")
        await found.first.wait_for(timeout=10_000)
        assert elsewhere == [] and errors == []
    finally:
        await context.close()
