"""The operator's console at ``/console``: keys, usage, the fleet and recent requests, as
server-rendered pages (Jinja2; charts drawn by matplotlib as inline SVG; no scripts).

Mounted only on a gateway holding the admin credential (``[admin]``): a public gateway has no
``/console``. Every page but sign-in needs a session (``gateway.console.session``), and every
change a CSRF token. Errors are pages too: a Redis outage is a 503 page saying so, and nothing
is shown or changed without Redis (fail closed).
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.accounts.state import ADMIN_SHA256, REDIS
from gateway.config import CONFIG
from gateway.console import keys_pages, monitor_pages, session, usage_pages
from gateway.console.render import redirect, render
from gateway.console.state import SESSION
from gateway.http.errors import GatewayError
from gateway.http.openapi import mark_pages
from infermesh.redis_client import REDIS_ERRORS

logger = logging.getLogger(__name__)

SIGN_IN = "/console/sign-in"


def create_console_app(admin_sha256: str) -> web.Application:
    app = web.Application(middlewares=[_guard])
    app[ADMIN_SHA256] = admin_sha256
    mark_pages(app)
    app.router.add_get("/", _home)
    app.router.add_get("/sign-in", sign_in_page)
    app.router.add_post("/sign-in", sign_in)
    app.router.add_post("/sign-out", sign_out)
    keys_pages.add_routes(app.router)
    usage_pages.add_routes(app.router)
    monitor_pages.add_routes(app.router)
    return app


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Sessions and CSRF tokens checked, and every failure answered as a page."""
    try:
        if request.path != SIGN_IN:
            found = await session.find(request.config_dict[REDIS], request)
            reading = request.method in ("GET", "HEAD")
            if found is None:
                if reading:
                    return redirect(SIGN_IN)
                return _refused(request, "You are not signed in (or your session expired).")
            request[SESSION] = found
            if not reading:  # a change
                presented = (await request.post()).get("csrf", "")
                if not isinstance(presented, str) or not session.csrf_matches(found, presented):
                    return _refused(request, "The form's CSRF token is missing or wrong.")
        return await handler(request)
    except GatewayError as e:
        return render(request, "error.html", e.status, title="Error", message=e.message)
    except REDIS_ERRORS as e:
        logger.warning("console: Redis unavailable: %s", type(e).__name__)
        return render(
            request,
            "error.html",
            503,
            title="Redis unavailable",
            message="Redis, which holds the keys, their usage and the console's sessions, "
            "cannot be reached. Nothing can be shown or changed until it is back.",
        )
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return render(request, "error.html", e.status, title=e.reason, message=e.text or "")


def _refused(request: web.Request, why: str) -> web.Response:
    return render(request, "error.html", 403, title="Refused", message=f"{why} Sign in again.")


async def _home(request: web.Request) -> web.StreamResponse:
    return redirect("/console/keys")


async def sign_in_page(request: web.Request) -> web.Response:
    return render(request, "sign_in.html", title="Sign in", error="")


async def sign_in(request: web.Request) -> web.StreamResponse:
    redis, config = request.config_dict[REDIS], request.config_dict[CONFIG].console
    address = request.remote or "unknown"
    try:
        await session.wait_out_failures(redis, config, address)
    except session.SignInPending as pending:  # refused unread: one guess at a time
        response = render(
            request,
            "sign_in.html",
            429,
            title="Sign in",
            error="Another sign-in from your address is still waiting out the delay that "
            f"wrong tokens earned it. Try again in {pending.retry_after_s} s.",
        )
        response.headers["Retry-After"] = str(pending.retry_after_s)
        return response
    token = (await request.post()).get("token", "")
    if not isinstance(token, str) or not session.token_matches(token, request.app[ADMIN_SHA256]):
        await session.count_failure(redis, config, address)
        return render(
            request, "sign_in.html", 401, title="Sign in", error="That is not the admin token."
        )
    await session.forget_failures(redis, address)
    response = redirect("/console/keys")
    await session.start(redis, config, request, response)
    return response


async def sign_out(request: web.Request) -> web.StreamResponse:
    response = redirect(SIGN_IN)
    await session.end(request.config_dict[REDIS], request[SESSION], response)
    return response
