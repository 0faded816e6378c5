"""Pages from the Jinja2 templates beside this module, with the headers every console answer
carries: nothing cached, no framing, scripts off, forms only to the console itself."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any, TypeVar

import jinja2
from aiohttp import web

from gateway.console.state import SESSION

R = TypeVar("R", bound=web.StreamResponse)

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
)
_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _utc(unix_s: float | None) -> str:
    if unix_s is None:
        return ""
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _utc_date(unix_s: float | None) -> str:
    return _utc(unix_s)[:10]


_ENV.filters["utc"] = _utc
_ENV.filters["utc_date"] = _utc_date


def render(request: web.Request, template: str, status: int = 200, **context: Any) -> web.Response:
    """The page ``template`` with ``context``; the session's CSRF token for its forms."""
    session = request.get(SESSION)
    page = _ENV.get_template(template).render(
        csrf=session.csrf if session else "",
        signed_in=session is not None,
        path=request.path,
        **context,
    )
    return web.Response(
        text=page, status=status, content_type="text/html", charset="utf-8", headers=_HEADERS
    )


def secure(response: R) -> R:
    """The console's headers on an answer that is no page (a redirect, a CSV file)."""
    response.headers.update(_HEADERS)
    return response


def redirect(location: str) -> web.Response:
    """303 to ``location``: where a form's change is shown (the page is not posted again)."""
    return secure(web.Response(status=303, headers={"Location": location}))
