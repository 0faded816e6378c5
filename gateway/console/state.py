"""The console's request keys."""

from __future__ import annotations

from aiohttp import web

from gateway.console.session import Session

SESSION = web.RequestKey[Session]("console_session")  # the signed-in operator's session
