"""What end-to-end tests share besides their fixtures."""

from __future__ import annotations

import asyncio

from gateway.accounts.keys import create_key_at


def new_key(redis_url: str) -> str:
    """An API key in the mesh's Redis, made from outside an event loop."""
    return asyncio.run(create_key_at(redis_url, "e2e"))
