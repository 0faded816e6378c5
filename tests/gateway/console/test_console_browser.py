"""The operator's console in a real browser (Playwright driving Debian's Chromium, `make
browser`): an operator signs in on the admin gateway, creates a key, sees it used through the
public gateway on the usage, fleet and recent requests pages, and revokes it.

Each page's screenshot goes to $INFERMESH_CONSOLE_SCREENSHOTS when set (docs/console/ holds
the committed ones), else to the test's temporary directory."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import prometheus_client
import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

from gateway.config import AdminSection, ConsoleSection
from infermesh.authz import role_uri
from infermesh.pb import common_pb2
from infermesh.ports import free_port
from infermesh.redis_client import redis_client
from infermesh.usage import count_usage, identity_owner
from tests.helpers.gateway import ADMIN_TOKEN, make_config, sdk, start_gateway

CHROMIUM = "/usr/bin/chromium"
_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=_ARGS)
        yield browser
        await browser.close()


@pytest.fixture
def router_metrics_url() -> Iterator[str]:
    """The in-process router's Prometheus exposition, as its [metrics] port serves it."""
    port = free_port()
    server, thread = prometheus_client.start_http_server(port, addr="127.0.0.1")
    yield f"http://127.0.0.1:{port}/metrics"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("INFERMESH_CONSOLE_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# An element's accessible name, as a screen reader would announce it (what the pages use of
# the rules: aria-labelledby, aria-label, a <label> for it or around it, a button's or link's text).
_NAME = """(e) => {
  if (!e || e === document.body) return "";
  const by = e.getAttribute("aria-labelledby");
  const text = (i) => document.getElementById(i)?.textContent ?? "";
  if (by) return by.split(/\\s+/).map(text).join(" ").trim();
  if (e.getAttribute("aria-label")) return e.getAttribute("aria-label").trim();
  if (e.labels && e.labels.length) return [...e.labels].map(l => l.textContent).join(" ").trim();
  if (["BUTTON", "A"].includes(e.tagName)) return e.textContent.trim();
  return "";
}"""


async def _focused(page: Page) -> str:
    """The accessible name of what has the keyboard's focus."""
    return str(await page.evaluate(f"({_NAME})(document.activeElement)"))


async def _tab_to(page: Page, name: str) -> None:
    """Presses Tab until the control named ``name`` has the focus; every stop on the way must
    have a name too (a keyboard user hears each)."""
    focused = await _focused(page)
    for _ in range(40):
        if focused == name:
            return
        await page.keyboard.press("Tab")
        focused = await _focused(page)
        assert focused, f"Tab reached an unnamed element on {page.url}, looking for {name!r}"
    raise AssertionError(f"Tab never reached {name!r} on {page.url}")


async def _all_named(page: Page) -> None:
    """Every form control of the page has an accessible name."""
    unnamed = await page.evaluate(
        f"""() => [...document.querySelectorAll(
              "input:not([type=hidden]), select, textarea, button")]
            .filter(e => !({_NAME})(e)).map(e => e.outerHTML)"""
    )
    assert unnamed == [], f"{page.url}: form controls without an accessible name: {unnamed}"


async def _shot(page: Page, folder: Path, name: str) -> None:
    await _all_named(page)  # each page photographed is checked
    # the plaintext key, where one is shown, is masked: the picture is published
    await page.screenshot(
        path=folder / f"{name}.png", full_page=True, mask=[page.locator("#plaintext")]
    )
    assert (folder / f"{name}.png").stat().st_size > 10_000


async def test_an_operator_manages_a_key_from_the_console(
    redis_server, router, worker, browser, screenshots, router_metrics_url
):
    config = make_config(redis_server.url, router.address)
    console = ConsoleSection(router_metrics_url=router_metrics_url)
    admin = await start_gateway(dataclasses.replace(config, console=console))
    public = await start_gateway(dataclasses.replace(config, admin=AdminSection()))
    page = await browser.new_page(viewport={"width": 1280, "height": 800})
    try:
        await page.goto(str(admin.make_url("/console")))  # not signed in: the sign-in page
        await expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
        await _shot(page, screenshots, "sign-in")
        # signed in and a key created with the keyboard alone: Tab, typing, Enter
        await _tab_to(page, "Admin token")
        await page.keyboard.type(ADMIN_TOKEN)
        await page.keyboard.press("Enter")
        await expect(page.get_by_role("heading", name="Keys")).to_be_visible()
        await _all_named(page)
        for label, value in (("Name", "team-a"), ("Tier", "gold"), ("Requests per minute", "600")):
            await _tab_to(page, label)
            await expect(page.get_by_label(label, exact=True)).to_be_focused()
            await page.keyboard.type(value)
        await _tab_to(page, "Create key")
        await page.keyboard.press("Enter")
        key = await page.locator("#plaintext").inner_text()
        assert key.startswith("sk-")
        await _shot(page, screenshots, "key-created")
        await page.get_by_role("link", name="Keys").click()
        row = page.get_by_role("row").filter(has_text="team-a")
        await expect(row).to_contain_text("active")
        await expect(row).to_contain_text("Requests per minute: 600")

        # an internal caller's request, counted as the router counts one (router_svc.caller_usage)
        async with redis_client(redis_server.url, timeout_s=3.0) as redis:
            usage = common_pb2.Usage(
                prompt_tokens=1200, cached_prompt_tokens=800, completion_tokens=90
            )
            await count_usage(redis, identity_owner(role_uri("client", "billing")), usage)
        model = worker.servicer.info.models[0]
        prompt = [{"role": "user", "content": "Name three colours of the sea at dawn. " * 4}]
        prompt_tokens = 0
        async with sdk(public, key) as client:
            for _ in range(2):  # the second one's prompt is cached on the worker
                reply = await client.chat.completions.create(
                    model=model, messages=prompt, max_tokens=4
                )
                assert reply.usage is not None
                prompt_tokens += reply.usage.prompt_tokens
        await _shot(page, screenshots, "keys")

        await page.get_by_role("link", name="Usage").click()
        per_key = page.get_by_role("row").filter(has_text="team-a").first
        await expect(per_key).to_contain_text(f"{prompt_tokens}")
        await expect(page.get_by_role("img", name="Tokens per day, by key")).to_be_visible()
        await expect(page.get_by_role("row").filter(has_text="client/billing")).to_contain_text(
            "1,200"
        )
        await _shot(page, screenshots, "usage")
        async with page.expect_download() as download:
            await page.get_by_role("link", name="Export CSV").click()
        csv = Path(await (await download.value).path()).read_text()
        assert "team-a" in csv and csv.startswith("date,kind,id,name,tier,requests")

        await page.get_by_role("link", name="Fleet").click()
        fleet = page.get_by_role("row").filter(has_text=worker.servicer.info.worker_id).first
        await expect(fleet).to_contain_text("healthy")
        await expect(fleet).to_contain_text(worker.servicer.info.models[0])
        await expect(
            page.get_by_text(re.compile(r"routed by (its prompt's|their prompts') cached prefixes"))
        ).to_be_visible()
        # the chat completion above, as the router counted its decision
        decisions = page.get_by_role("row").filter(has_text="balanced").first
        await expect(decisions).to_be_visible()
        await _shot(page, screenshots, "fleet")

        await page.get_by_role("link", name="Recent requests").click()
        recent = page.get_by_role("row").filter(has_text="/v1/chat/completions")
        await expect(recent).to_have_count(2)
        await expect(recent.first).to_contain_text("team-a")
        await expect(recent.first).to_contain_text("200")
        await _shot(page, screenshots, "recent-requests")

        await page.get_by_role("link", name="team-a").first.click()
        await page.get_by_role("button", name="Revoke for good").click()
        await expect(page.get_by_role("heading", name="Key “team-a” revoked")).to_be_visible()
        async with sdk(public, key) as client:
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(model=model, messages=prompt, max_tokens=4)
        await page.get_by_role("link", name="Its recent requests").click()
        await expect(page.get_by_role("row").filter(has_text="/v1/chat/completions")).to_have_count(
            2  # the refused one: not authenticated, not the key's
        )
        await page.get_by_role("link", name="Keys").click()
        await expect(page.get_by_role("row").filter(has_text="team-a")).to_contain_text("revoked")
        assert (await public.get("/console")).status == 404
    finally:
        await page.close()
        await admin.close()
        await public.close()
