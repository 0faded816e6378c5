"""The HTTP plumbing's request and app keys: what its middlewares put on a request or read from
the app, for every room above to read."""

from __future__ import annotations

from aiohttp import web

from gateway.http.loopback import Loopback

REQUEST_ID = web.RequestKey[str]("request_id")
TRACE_ID = web.RequestKey[str]("trace_id")
MODEL = web.RequestKey[str]("model")  # the model asked for, once the body is read
# Path prefixes of the API bases ("/v1/" and the configured alias) that need a key.
API_PREFIXES = web.AppKey[tuple[str, ...]]("api_prefixes")
LOOPBACK = web.AppKey[Loopback]("loopback")  # this process's own socket (the batch runner's)
