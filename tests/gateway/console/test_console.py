"""The operator's console's guards, over HTTP against a real gateway app and a real Redis:
sessions, CSRF tokens, sign-in failures and their delay, Redis outages, the public gateway.
(The pages themselves are driven in a real browser:
tests/gateway/console/test_console_browser.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time

import prometheus_client
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.accounts.keys import get_key, key_id
from gateway.accounts.recent import RecentRequest, RecentRequests
from gateway.batches.records import new_record
from gateway.batches.state import BATCH_RECORDS
from gateway.config import AdminSection, BatchesSection, ConsoleSection
from tests.helpers.gateway import ADMIN_TOKEN, make_config, start_gateway


async def _sign_in(gateway) -> str:
    """Signs the client's cookie jar in; the session's CSRF token."""
    response = await gateway.post(
        "/console/sign-in", data={"token": ADMIN_TOKEN}, allow_redirects=False
    )
    assert response.status == 303, await response.text()
    cookie = response.cookies["infermesh_console"]
    assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["max-age"]
    assert ADMIN_TOKEN not in response.headers.getone("Set-Cookie")
    page = await (await gateway.get("/console/keys")).text()
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match, page
    return match.group(1)


def _failures() -> float:
    value = prometheus_client.REGISTRY.get_sample_value("infermesh_console_sign_in_failures_total")
    return value or 0.0


async def test_no_session_no_console(gateway, redis_client):
    response = await gateway.get("/console/keys", allow_redirects=False)
    assert response.status == 303 and response.headers["Location"] == "/console/sign-in"
    response = await gateway.post("/console/keys", data={"name": "x", "csrf": "x"})
    assert response.status == 403 and "not signed in" in await response.text()
    gateway.session.cookie_jar.update_cookies({"infermesh_console": "made-up"})
    assert (await gateway.post("/console/keys", data={"name": "x"})).status == 403
    assert await redis_client.scard("infermesh:keys") == 0


async def test_a_change_needs_the_sessions_csrf_token(gateway, redis_client):
    csrf = await _sign_in(gateway)
    altered = csrf[:-1] + ("B" if csrf.endswith("A") else "A")  # one character off, never the same
    for forged in ({}, {"csrf": ""}, {"csrf": altered}):
        response = await gateway.post("/console/keys", data={"name": "x", **forged})
        assert response.status == 403 and "CSRF" in await response.text()
    assert await redis_client.scard("infermesh:keys") == 0
    response = await gateway.post("/console/keys", data={"name": "made", "csrf": csrf})
    assert response.status == 200 and "shown this once" in await response.text()
    assert await redis_client.scard("infermesh:keys") == 1


async def test_a_new_key_is_shown_once_on_the_page_its_form_redirects_to(gateway, redis_client):
    """Post/Redirect/Get: refreshing the page a creation ended on shows the key, without its
    secret, and creates no second key."""
    csrf = await _sign_in(gateway)
    posted = await gateway.post(
        "/console/keys", data={"name": "once", "csrf": csrf}, allow_redirects=False
    )
    assert posted.status == 303 and posted.headers["Location"].startswith("/console/keys/")
    first = await (await gateway.get(posted.headers["Location"])).text()
    refreshed = await (await gateway.get(posted.headers["Location"])).text()
    secret = re.search(r'<code id="plaintext">(sk-[^<]+)</code>', first)
    assert secret and "shown this once" not in refreshed and secret.group(1) not in refreshed
    assert await redis_client.scard("infermesh:keys") == 1
    assert _key_id(first) == key_id(secret.group(1))
    keys_in_redis = [k async for k in redis_client.scan_iter("infermesh:console:secret:*")]
    assert keys_in_redis == [], "the secret is gone once shown"


async def test_a_keys_page_shows_its_batches(gateway, redis_client):
    csrf = await _sign_in(gateway)
    page = await (await gateway.post("/console/keys", data={"name": "b", "csrf": csrf})).text()
    kid = _key_id(page)
    assert "No batches." in page
    record = new_record("anthropic", "msgbatch_shown", kid, "/v1/messages", "", 0, BatchesSection())
    await gateway.app[BATCH_RECORDS].create(record, [])
    page = await (await gateway.get(f"/console/keys/{kid}")).text()
    assert "<code>msgbatch_shown</code></td><td>anthropic</td>" in page


async def test_a_bad_form_is_a_readable_error(gateway):
    csrf = await _sign_in(gateway)
    response = await gateway.post("/console/keys", data={"name": "x", "rpm": "ten", "csrf": csrf})
    assert response.status == 400
    assert "Requests per minute must be a whole number" in await response.text()
    assert response.headers["Content-Type"].startswith("text/html")


async def test_sign_out_ends_the_session(gateway):
    csrf = await _sign_in(gateway)
    response = await gateway.post("/console/sign-out", data={"csrf": csrf}, allow_redirects=False)
    assert response.status == 303
    assert (await gateway.get("/console/keys", allow_redirects=False)).status == 303


async def test_wrong_tokens_are_refused_counted_and_slowed(redis_server, config):
    console = ConsoleSection(sign_in_failures_free=2, sign_in_max_delay_s=1.0)
    gateway = await start_gateway(dataclasses.replace(config, console=console))

    async def attempt(token: str) -> tuple[int, float, str, str]:
        started = time.monotonic()
        response = await gateway.post(
            "/console/sign-in", data={"token": token}, allow_redirects=False
        )
        page = await response.text()
        return (
            response.status,
            time.monotonic() - started,
            response.headers.get("Retry-After", ""),
            page,
        )

    try:
        before = _failures()
        for _ in range(2):
            response = await gateway.post("/console/sign-in", data={"token": "wrong-token-12345"})
            assert response.status == 401 and "not the admin token" in await response.text()
        assert _failures() == before + 2
        assert "infermesh_console" not in response.cookies

        # two guesses at once past the free ones: one waits, then is checked; the other is
        # refused at once, its token unread and uncounted
        checked, refused = sorted(
            await asyncio.gather(attempt("wrong-again-12345"), attempt("wrong-too-123456"))
        )
        assert checked[0] == 401 and checked[1] >= 1.0 and "not the admin token" in checked[3]
        assert refused[0] == 429 and refused[1] < 0.5 and refused[2] == "1"
        assert "still waiting out the delay" in refused[3]
        assert _failures() == before + 3

        # a right token while a wrong one waits is refused too, then signs in once it is done
        waiting = asyncio.create_task(attempt("wrong-third-12345"))
        await asyncio.sleep(0.3)
        status, took, retry_after, _ = await attempt(ADMIN_TOKEN)
        assert status == 429 and took < 0.5 and retry_after == "1"
        assert (await waiting)[0] == 401 and _failures() == before + 4
        started = time.monotonic()  # a right token waits too, then clears the count
        await _sign_in(gateway)
        assert time.monotonic() - started >= 1.0
        started = time.monotonic()
        await gateway.post("/console/sign-in", data={"token": ADMIN_TOKEN})
        assert time.monotonic() - started < 1.0
    finally:
        await gateway.close()


async def test_the_session_cookie_is_secure_over_tls(gateway, redis_server, config):
    """TLS ends at a proxy: the cookie is Secure when it says the browser used https, or always
    with [console] secure_cookie; over plain HTTP it is not (or the browser would drop it)."""

    async def secure(client, headers: dict[str, str]) -> bool:
        response = await client.post(
            "/console/sign-in",
            data={"token": ADMIN_TOKEN},
            headers=headers,
            allow_redirects=False,
        )
        assert response.status == 303, await response.text()
        return bool(response.cookies["infermesh_console"]["secure"])

    assert not await secure(gateway, {})
    assert not await secure(gateway, {"X-Forwarded-Proto": "http"})
    assert await secure(gateway, {"X-Forwarded-Proto": "https"})
    assert await secure(gateway, {"X-Forwarded-Proto": "HTTPS, http"})  # the first proxy's
    always = ConsoleSection(secure_cookie=True)
    pinned = await start_gateway(dataclasses.replace(config, console=always))
    try:
        assert await secure(pinned, {})
    finally:
        await pinned.close()


async def test_a_redis_outage_is_a_page_saying_so(gateway, redis_server):
    await _sign_in(gateway)
    redis_server.stop()
    response = await gateway.get("/console/keys")
    assert response.status == 503
    page = await response.text()
    assert "Redis unavailable" in page and "cannot be reached" in page


async def test_the_public_gateway_has_no_console(redis_server, config):
    public = await start_gateway(dataclasses.replace(config, admin=AdminSection()))
    try:
        for path in ("/console", "/console/sign-in", "/console/keys"):
            assert (await public.get(path, allow_redirects=False)).status == 404
        response = await public.post("/console/sign-in", data={"token": ADMIN_TOKEN})
        assert response.status == 404
    finally:
        await public.close()


def _key_id(page: str) -> str:
    match = re.search(r"<code>([0-9a-f]{64})</code>", page)
    assert match, page
    return match.group(1)


async def test_a_key_is_edited_disabled_enabled_and_rotated(gateway, redis_client):
    csrf = await _sign_in(gateway)
    created = await gateway.post(
        "/console/keys", data={"name": "edit-me", "rpm": "60", "models": "a, b", "csrf": csrf}
    )
    kid = _key_id(await created.text())
    response = await gateway.post(
        f"/console/keys/{kid}",
        data={"name": "edited", "tpm": "5000", "expires": "2999-01-01", "csrf": csrf},
    )
    assert response.status == 200  # the key's page, after the redirect
    record = await get_key(redis_client, kid)
    assert record is not None and record.name == "edited"
    assert record.limits == {"tpm": 5000} and record.models == ()  # empty fields cleared
    assert record.expires_at == 32472144000

    for action, status in (("disable", "disabled"), ("enable", "active")):
        response = await gateway.post(f"/console/keys/{kid}/{action}", data={"csrf": csrf})
        assert f'class="status-{status}">{status}</span>' in await response.text()
    rotated = await gateway.post(f"/console/keys/{kid}/rotate", data={"csrf": csrf})
    page = await rotated.text()
    assert rotated.status == 200 and "shown this once" in page and "Rotated from" in page
    old = await get_key(redis_client, kid)
    assert old is not None and old.revoked and old.rotated_to == _key_id(page)
    response = await gateway.post(f"/console/keys/{kid}/rotate", data={"csrf": csrf})
    assert response.status == 400 and "can be rotated" in await response.text()
    response = await gateway.get(f"/console/keys/{'0' * 64}")
    assert response.status == 404 and "No API key" in await response.text()


async def test_recent_requests_are_capped_and_link_to_jaeger(redis_server, config, redis_client):
    console = ConsoleSection(recent_per_key=2, jaeger_url="http://jaeger.example:16686/")
    gateway = await start_gateway(dataclasses.replace(config, console=console))
    try:
        recent = RecentRequests(redis_client, console)
        for i in range(3):  # in order, the last two in one round trip
            recent.record(
                RecentRequest(
                    i, "a" * 64, "k", "/v1/chat", "m", 200, 1, 0, 1, 5, 9, f"{i:032x}", f"req-{i}"
                )
            )
        await recent.drain()
        assert [e.request_id for e in await recent.read("a" * 64, 10)] == ["req-2", "req-1"]
        await _sign_in(gateway)
        page = await (await gateway.get(f"/console/requests?key_id={'a' * 64}")).text()
        assert f'href="http://jaeger.example:16686/trace/{2:032x}"' in page
        assert "req-0" not in page and f"{0:032x}" not in page
        response = await gateway.get("/console/requests?key_id=not-an-id")
        assert response.status == 400
    finally:
        await gateway.close()


async def test_the_fleet_page_shows_the_router_metrics_url_without_its_credentials(
    redis_server, router, caplog
):
    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=500)

    app = web.Application()
    app.router.add_get("/metrics", refuse)
    metrics_server = TestServer(app, host="127.0.0.1")
    await metrics_server.start_server()
    url = f"http://ops:s3cret@127.0.0.1:{metrics_server.port}/metrics?token=s3cret"
    config = make_config(redis_server.url, router.address)
    gateway = await start_gateway(
        dataclasses.replace(config, console=ConsoleSection(router_metrics_url=url))
    )
    try:
        await _sign_in(gateway)
        page = await (await gateway.get("/console/fleet")).text()
        shown = f"http://ops:***@127.0.0.1:{metrics_server.port}/metrics?token=***"
        assert f"metrics at {shown} could not be read" in page
        assert "500" in page
        # nor the Authorization header aiohttp made of it (an error's repr shows it)
        assert "s3cret" not in page and "Authorization" not in page
        assert shown in caplog.text and "s3cret" not in caplog.text
    finally:
        await gateway.close()
        await metrics_server.close()
