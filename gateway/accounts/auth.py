"""API key authentication: ``auth_middleware`` requires a valid key on the API's routes and
refuses keys sent in the URL anywhere; the request's key is ``request[API_KEY]``."""

from __future__ import annotations

import dataclasses

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.accounts.keys import ApiKey
from gateway.accounts.state import API_KEY, KEY_STORE
from gateway.config import CONFIG
from gateway.http.errors import AuthenticationError, InvalidRequestError
from gateway.http.loopback import BATCH_KEY_HEADER, LOOPBACK_HEADER
from gateway.http.middleware import QUERY_KEY_NAMES, single_header
from gateway.http.state import API_PREFIXES, LOOPBACK

BATCH_TIER = "batch"


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuses keys in the URL anywhere; requires a valid key on the API's known routes."""
    if QUERY_KEY_NAMES & {name.lower() for name in request.query}:
        raise InvalidRequestError(
            "API keys are not accepted in the URL query string (URLs end up in logs); "
            "send the key in the Authorization header: 'Authorization: Bearer sk-...'",
            code="api_key_in_query",
        )
    if (
        request.path.startswith(request.config_dict[API_PREFIXES])
        and request.match_info.http_exception is None
    ):
        request[API_KEY] = await _authenticate(request)
    return await handler(request)


async def _authenticate(request: web.Request) -> ApiKey:
    """The key from ``Authorization: Bearer`` or (Anthropic's clients) ``x-api-key``, or a
    batch line's (``_batch_key``). A Redis failure propagates: the error middleware answers 503,
    never 401."""
    if LOOPBACK_HEADER in request.headers:
        return await _batch_key(request)
    header = single_header(request, "Authorization")
    if header:
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise AuthenticationError(
                "The Authorization header must use Bearer auth ('Authorization: Bearer sk-...')."
            )
    else:
        presented = single_header(request, "x-api-key") or ""
        if not presented.strip():
            raise AuthenticationError(
                "You didn't provide an API key. Send it in the Authorization header "
                "('Authorization: Bearer sk-...')."
            )
    key = await request.config_dict[KEY_STORE].authenticate(presented.strip())
    if key is None:
        raise AuthenticationError("Incorrect API key provided, or the key is disabled or expired.")
    return key


async def _batch_key(request: web.Request) -> ApiKey:
    """The key a batch line of this process's runner acts for, at the batch tier; refused
    unless the request came over this process's own socket with its token."""
    if not request.config_dict[LOOPBACK].admits(request):
        raise AuthenticationError("Incorrect API key provided, or the key is disabled or expired.")
    key = await request.config_dict[KEY_STORE].by_id(request.headers.get(BATCH_KEY_HEADER, ""))
    if key is None:
        raise AuthenticationError("The batch's API key is disabled, revoked or expired.")
    weight = request.config_dict[CONFIG].batches.weight
    return dataclasses.replace(key, tier=BATCH_TIER, weight=weight, batch=True)
