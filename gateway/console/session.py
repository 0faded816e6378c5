"""Sign-in to the console: the admin token, exchanged for a session in Redis.

The browser holds only a random session id, in a cookie that is HttpOnly, SameSite=Strict,
Secure over TLS (the request's own, a proxy's ``X-Forwarded-Proto: https``, or always with
``[console] secure_cookie``), and expires with the session (``[console] session_ttl_s``); the
admin token never leaves the sign-in request. Redis keeps the session's CSRF token under the id's
SHA-256 (``infermesh:console:session:<digest>``), so a copy of Redis holds no usable
session. Every change is a POST carrying that CSRF token in a form field.

A new key's plaintext, made by a POST (create, rotate), is shown by the page that POST redirects
to (Post/Redirect/Get: a browser's refresh reloads the page, never makes a second key), once: it
waits in Redis (``infermesh:console:secret:<digest>``, ``_SECRET_TTL_S``) encrypted with a key
derived from the session id, which Redis never holds, and the page that shows it deletes it.

Wrong tokens are counted (``infermesh_console_sign_in_failures_total``) and, per client
address, in Redis (``infermesh:console:failures:<address>``, for the failure window):
past ``sign_in_failures_free`` each sign-in from that address waits first, doubling per
failure up to ``sign_in_max_delay_s``, right tokens included, so that guessing is slow
whatever an answer's timing would tell. While one waits, any other sign-in from that address
is refused at once (429, its token unread), so guesses from one address go one at a time.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import hmac
import math
import secrets

import prometheus_client
from aiohttp import web
from cryptography.fernet import Fernet, InvalidToken

from gateway.config import ConsoleSection
from infermesh.redis_client import RedisClient

COOKIE = "infermesh_console"
COOKIE_PATH = "/console"
_SESSION_PREFIX = "infermesh:console:session:"
_FAILURES_PREFIX = "infermesh:console:failures:"
_WAITING_PREFIX = "infermesh:console:waiting:"
_SECRET_PREFIX = "infermesh:console:secret:"
_SECRET_TTL_S = 300  # a redirect is followed at once; a secret left unread goes soon

SIGN_IN_FAILURES = prometheus_client.Counter(
    "infermesh_console_sign_in_failures",
    "Console sign-ins refused for a wrong admin token",
)


@dataclasses.dataclass(frozen=True)
class Session:
    """A signed-in operator's session: what the pages need of it."""

    digest: str  # SHA-256 of the session id: its Redis key
    csrf: str  # the token every change must carry


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()


def token_matches(presented: str, admin_sha256: str) -> bool:
    return hmac.compare_digest(_digest(presented), admin_sha256)


async def start(
    redis: RedisClient, config: ConsoleSection, request: web.Request, response: web.Response
) -> None:
    """A new session, its cookie set on ``response``."""
    session_id = secrets.token_urlsafe(32)
    await redis.set(
        _SESSION_PREFIX + _digest(session_id), secrets.token_urlsafe(32), ex=config.session_ttl_s
    )
    response.set_cookie(
        COOKIE,
        session_id,
        max_age=config.session_ttl_s,
        path=COOKIE_PATH,
        httponly=True,
        secure=config.secure_cookie or over_tls(request),
        samesite="Strict",
    )


def over_tls(request: web.Request) -> bool:
    """Whether the browser reached us over TLS: its own connection, or the proxy's that ends it."""
    forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    return request.secure or forwarded == "https"


async def find(redis: RedisClient, request: web.Request) -> Session | None:
    """The request's session, None when it has none or it expired."""
    session_id = request.cookies.get(COOKIE)
    if not session_id:
        return None
    digest = _digest(session_id)
    csrf = await redis.get(_SESSION_PREFIX + digest)
    if csrf is None:
        return None
    return Session(digest, csrf.decode() if isinstance(csrf, bytes) else csrf)


async def end(redis: RedisClient, session: Session, response: web.StreamResponse) -> None:
    await redis.delete(_SESSION_PREFIX + session.digest)
    response.del_cookie(COOKIE, path=COOKIE_PATH)


def csrf_matches(session: Session, presented: str) -> bool:
    return hmac.compare_digest(session.csrf.encode(), presented.encode("utf-8", "surrogateescape"))


class SignInPending(Exception):
    """Another sign-in from this address is still waiting out its delay."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(retry_after_s)
        self.retry_after_s = retry_after_s


async def wait_out_failures(redis: RedisClient, config: ConsoleSection, address: str) -> None:
    """Waits before a sign-in from ``address`` once it failed past the free attempts.

    The wait is claimed in Redis (``infermesh:console:waiting:<address>``, for its length), so
    that while it lasts any other sign-in from ``address``, on any admin gateway, raises
    SignInPending at once: the caller refuses it unread, and one address's guesses cannot
    overlap."""
    failures = int(await redis.get(_FAILURES_PREFIX + address) or 0)
    past = failures - config.sign_in_failures_free
    if past < 0:
        return
    delay = min(2.0**past, config.sign_in_max_delay_s)
    key = _WAITING_PREFIX + address
    if not await redis.set(key, "1", px=max(1, int(delay * 1000)), nx=True):
        left_ms = await redis.pttl(key)
        raise SignInPending(max(1, math.ceil(left_ms / 1000)))
    await asyncio.sleep(delay)


async def count_failure(redis: RedisClient, config: ConsoleSection, address: str) -> None:
    SIGN_IN_FAILURES.inc()
    key = _FAILURES_PREFIX + address
    async with redis.pipeline(transaction=True) as pipe:
        pipe.incr(key)
        pipe.expire(key, config.sign_in_failure_window_s)
        await pipe.execute()


async def forget_failures(redis: RedisClient, address: str) -> None:
    await redis.delete(_FAILURES_PREFIX + address)


def _secret_cipher(request: web.Request) -> Fernet:
    session_id = request.cookies.get(COOKIE, "")
    key = hashlib.sha256(b"console secret:" + session_id.encode("utf-8", "surrogateescape"))
    return Fernet(base64.urlsafe_b64encode(key.digest()))


async def keep_secret(
    redis: RedisClient, request: web.Request, session: Session, owner: str, secret: str
) -> None:
    """Keeps ``secret`` (of the key ``owner``) for the session's next page, encrypted."""
    token = _secret_cipher(request).encrypt(f"{owner}:{secret}".encode())
    await redis.set(_SECRET_PREFIX + session.digest, token, ex=_SECRET_TTL_S)


async def take_secret(
    redis: RedisClient, request: web.Request, session: Session, owner: str
) -> str:
    """The secret kept for ``owner``'s page, once; "" when there is none."""
    token = await redis.getdel(_SECRET_PREFIX + session.digest)
    if token is None:
        return ""
    try:
        kept_for, _, secret = _secret_cipher(request).decrypt(token).decode().partition(":")
    except InvalidToken:
        return ""
    return secret if kept_for == owner else ""
