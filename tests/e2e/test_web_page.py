"""The chat page in a real browser (Debian's chromium, headless, driven by playwright): the key typed
once, a message sent, the reply seen streaming in before it is complete, and the conversation back
after a reload."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from playwright.async_api import Page, async_playwright

from support import SessionEnv
from web_support import Web, web_fixture

CHROMIUM = "/usr/bin/chromium"
LAST_REPLY = "[...document.querySelectorAll('.msg.assistant')].pop()"
FINAL = "Here it comes, word by word, until the end."


@pytest.fixture(scope="module")
async def web(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Web]:
    async for running in web_fixture(test_env, tmp_path_factory):
        yield running


@pytest.fixture
async def page() -> AsyncIterator[Page]:
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield await browser.new_page()
        finally:
            await browser.close()


async def test_the_page_streams_a_reply_and_shows_the_conversation_after_a_reload(
    web: Web, page: Page
) -> None:
    await page.goto(web.url + "/")
    await page.fill("#key", web.key)
    await page.click("#save-key")
    await page.wait_for_function("document.querySelector('#agent').value === 'default'")
    await page.fill("#input", "please stream a little")
    await page.click("#send")

    # Part of the reply is shown while the rest is still being generated.
    partial = await (
        await page.wait_for_function(
            f"(() => {{ const m = {LAST_REPLY}; return m && m.dataset.state === 'streaming'"
            " && m.textContent.length > 0 && m.textContent; })()",
            timeout=30_000,
        )
    ).json_value()
    await page.wait_for_function(f"{LAST_REPLY}.dataset.state === 'done'", timeout=30_000)
    final = await page.eval_on_selector_all(".msg.assistant", "ms => ms[ms.length - 1].textContent")
    assert final == FINAL
    assert FINAL.startswith(partial)
    assert len(partial) < len(FINAL)

    # The key and the user stay in the browser; the conversation comes back from the runtime.
    await page.reload()
    await page.wait_for_function("document.querySelectorAll('.msg').length >= 2", timeout=30_000)
    shown = await page.eval_on_selector_all(
        ".msg", "ms => ms.map(m => [m.classList.contains('user') ? 'user' : 'assistant', m.textContent])"
    )
    assert shown[-2:] == [["user", "please stream a little"], ["assistant", FINAL]]
    assert await page.evaluate("localStorage.getItem('parley.key')") == web.key
