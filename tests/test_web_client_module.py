"""web/tokenspout.js, the chat's client module, as docs/web.md shows it: its example page
(web/example.html, the docs' code verbatim) in headless Chromium against a real gateway,
Redis and synthetic engines: a reply that streams, is shown whole after a reload (from the
server's record, word for word), survives a killed engine worker (it says so), and
stops."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page

from stack import processes
from tests.support.browser import DESKTOP
from tests.support.oracle import synthetic_text
from tests.support.redis_probes import session_events
from tests.support.stack import Stack

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = re.compile(r'<script type="module">\n(.*?)</script>', re.DOTALL)
ANSWER = synthetic_text("Name three colours.", 64)


def test_the_docs_show_the_example_page_s_code_verbatim() -> None:
    page = SCRIPT.search((ROOT / "web" / "example.html").read_text())
    assert page is not None
    assert f"```js\n{page.group(1)}```" in (ROOT / "docs" / "web.md").read_text()


async def wait_shown(page: Page, needle: str, timeout_s: float = 30) -> None:
    await page.wait_for_function(
        f"() => document.getElementById('out').textContent.includes({needle!r})",
        timeout=timeout_s * 1000,
    )


async def server_text(stack: Stack, page: Page) -> str:
    """What the server has of the example's replies so far: its session's token events."""
    session_id = await page.evaluate("sessionStorage.getItem('example')")
    events = await session_events(stack.redis_url, stack.prefix, session_id)
    return "".join(str(data["text"]) for kind, data in events if kind == "token")


async def test_the_example_resumes_after_a_reload_sees_a_takeover_and_stops(
    stack: Stack, browser: Browser
) -> None:
    doomed = stack.synthetic(tokens_per_s=8)
    gateway = stack.gateway()
    context = await browser.new_context(viewport=DESKTOP)
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(f"{gateway.url}/example.html")
    await page.click("#ask")
    await wait_shown(page, " colours.")
    # A reload mid-reply: the page shows the reply from its first word (the server's
    # record), word for word what the server has, and goes on.
    await page.reload()
    had = await server_text(stack, page)
    await page.wait_for_function(
        "(n) => document.getElementById('out').textContent.length >= n", arg=len(had)
    )
    shown = await shown_text(page)
    assert shown == (await server_text(stack, page))[: len(shown)] and shown.startswith(had)
    # Another engine takes over from a killed one: the reply goes on, and says so.
    stack.synthetic(tokens_per_s=8)
    processes.kill(doomed)
    await wait_shown(page, "[done]", timeout_s=60)
    after = await shown_text(page)
    assert "[another engine took over]" in after
    whole = after.split("\n[done]")[0].replace(" [another engine took over] ", "")
    assert whole == ANSWER  # no word lost or repeated
    # Stop: the reply ends `cancelled`, long before its 64 tokens.
    await page.click("#ask")
    await page.wait_for_function(
        "() => document.getElementById('out').textContent.split('[done]')[1]?.length > 12"
    )
    await page.click("#stop")
    await wait_shown(page, "[cancelled]")
    stopped = (await shown_text(page)).split("[done]\n")[1].split("\n[cancelled]")[0]
    assert len(stopped) < len(ANSWER)
    # Reloaded once more, it shows both replies and how each ended, from the server.
    await page.reload()
    await wait_shown(page, "[cancelled]")
    assert await shown_text(page) == f"{ANSWER}\n[done]\n{stopped}\n[cancelled]\n"
    assert errors == []
    await context.close()


async def shown_text(page: Page) -> str:
    return await page.text_content("#out") or ""
