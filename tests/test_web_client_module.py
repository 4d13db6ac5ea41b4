"""web/tokenspout.js, the chat's client module, as docs/web.md shows it: its example page
(web/example.html, the docs' code verbatim) in headless Chromium against a real gateway,
Redis and synthetic engines: a reply that streams, survives a reload and a killed engine
worker (it says so), and stops."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page

from stack import processes
from tests.support.browser import DESKTOP
from tests.support.oracle import synthetic_text
from tests.support.stack import Stack

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = re.compile(r'<script type="module">\n(.*?)</script>', re.DOTALL)
ANSWER = synthetic_text("Name three colours.", 64)


def test_the_docs_show_the_example_page_s_code_verbatim() -> None:
    page = SCRIPT.search((ROOT / "web" / "example.html").read_text())
    assert page is not None
    assert f"```js\n{page.group(1)}```" in (ROOT / "docs" / "web.md").read_text()


async def shown(page: Page) -> str:
    return await page.text_content("#out") or ""


async def wait_shown(page: Page, needle: str, timeout_s: float = 30) -> None:
    await page.wait_for_function(
        f"() => document.getElementById('out').textContent.includes({needle!r})",
        timeout=timeout_s * 1000,
    )


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
    # A reload: the page starts empty and the reply goes on right after its last event.
    # What it showed is noted as it goes away (the old page applies events until then).
    async with page.expect_navigation():
        await page.evaluate(
            """() => {
            addEventListener("pagehide", () =>
                sessionStorage.setItem("shown", document.getElementById("out").textContent));
            location.reload();
        }"""
        )
    before = await page.evaluate("sessionStorage.getItem('shown')")
    await page.wait_for_function("() => document.getElementById('out').textContent.length > 0")
    # Another engine takes over from a killed one: the reply goes on, and says so.
    stack.synthetic(tokens_per_s=8)
    processes.kill(doomed)
    await wait_shown(page, "[done]", timeout_s=60)
    after = await shown(page)
    assert "[another engine took over]" in after
    rest = after.split("\n[done]")[0].replace(" [another engine took over] ", "")
    assert before + rest == ANSWER, (before, rest)  # no word lost or repeated
    # Stop: the reply ends `cancelled`, long before its 64 tokens.
    await page.click("#ask")
    await page.wait_for_function(
        "() => document.getElementById('out').textContent.split('[done]')[1]?.length > 12"
    )
    await page.click("#stop")
    await wait_shown(page, "[cancelled]")
    stopped = (await shown(page)).split("[done]\n")[1]
    assert len(stopped) < len(ANSWER)
    assert errors == []
    await context.close()
