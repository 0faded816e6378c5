"""Caller identities: the role a peer's certificate names, and which roles may call what."""

from __future__ import annotations

ROLES = ("gateway", "router", "worker", "client", "admin")
_URI_PREFIX = "spiffe://infermesh/"


def role_uri(role: str, name: str = "") -> str:
    """The SAN URI naming ``role`` (and, for a client, its ``name``)."""
    return f"{_URI_PREFIX}{role}/{name}" if name else f"{_URI_PREFIX}{role}"
