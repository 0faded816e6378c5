"""The session a request belongs to, as one affinity key for the router.

Coding agents resend their whole, growing history every turn, so a session's turns should land on
the worker that already holds its prefix. Clients name their session in different ways: OpenAI's
``prompt_cache_key`` body field, Codex's ``session-id`` header, Claude Code's
``X-Claude-Code-Session-Id``; on ``/v1/responses`` a ``previous_response_id`` continues the session
its stored response belonged to. Whichever came is scoped by the API key (two tenants who chose the
same session name are not sent together) and hashed, so that no client string travels past the
gateway and the key's length is fixed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

# Most specific first: the headers agents send with every request of a session.
SESSION_HEADERS = ("x-claude-code-session-id", "session-id")


def session_name(headers: Mapping[str, str], hint: str | None = None) -> str:
    """The session a request names: ``hint`` (a body field that names it) or else the first
    session header present; ``""`` when none is."""
    return hint or next((headers[h] for h in SESSION_HEADERS if headers.get(h)), "")


def affinity_key(key_id: str, headers: Mapping[str, str], hint: str | None = None) -> str:
    """The router's affinity key for a request of ``key_id`` in the session it names
    (``session_name``); ``""`` when it names none."""
    session = session_name(headers, hint)
    if not session:
        return ""
    return hashlib.blake2b(f"{key_id}\x00{session}".encode(), digest_size=16).hexdigest()
