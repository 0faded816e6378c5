"""Serving ``GET /v1/models`` and ``GET /v1/models/{id}`` from the router's ListModels, in
OpenAI's shape or, for an Anthropic client (Claude Code asks at start), in Anthropic's.

The list's ``data`` holds the served models only, so that a client taking the first model gets
one; the aliases that stand for them (``[models] aliases``, glob patterns as they are written)
come in a field of their own, ``aliases``: alias -> served model. ``GET /v1/models/{id}`` answers
an alias too (the name it was asked by, standing for its served model). Both count as requests
against the key's limits; a key restricted to some models sees only those and their aliases."""

from __future__ import annotations

import datetime
from typing import Any

from aiohttp import web

from gateway.accounts.limits import mesh_failed
from gateway.accounts.state import API_KEY, LIMITER
from gateway.accounts.usage import TokenUsage
from gateway.api.generation import admit
from gateway.config import CONFIG
from gateway.http.errors import ModelNotFoundError
from gateway.http.middleware import is_anthropic_client
from gateway.mesh.state import MESH
from gateway.openai.chat_protocol import model_list, model_object


async def list_models(request: web.Request) -> web.Response:
    created, headers = await _visible_models(request)
    aliases = _visible_aliases(request, created)
    if is_anthropic_client(request):
        names = list(created)
        body = {
            "data": [_anthropic_model(name, name, when) for name, when in created.items()],
            "has_more": False,
            "first_id": names[0] if names else None,
            "last_id": names[-1] if names else None,
            "aliases": aliases,
        }
        return web.json_response(body, headers=headers)
    body = model_list([model_object(name, when) for name, when in created.items()])
    return web.json_response({**body, "aliases": aliases}, headers=headers)


async def retrieve_model(request: web.Request) -> web.Response:
    wanted = request.match_info["model"]
    created, headers = await _visible_models(request)
    served = request.app[CONFIG].models.resolve(wanted)
    if served in created:
        if is_anthropic_client(request):
            body = _anthropic_model(wanted, served, created[served])
            return web.json_response(body, headers=headers)
        return web.json_response(model_object(wanted, created[served]), headers=headers)
    names = ", ".join(sorted(created)) or "none"
    raise ModelNotFoundError(
        f"model '{wanted}' is not served; served models: {names}", param="model", headers=headers
    )


def _anthropic_model(name: str, served: str, created: int) -> dict[str, Any]:
    return {
        "type": "model",
        "id": name,
        "display_name": name if name == served else f"{name} ({served})",
        "created_at": datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat(),
    }


def _visible_aliases(request: web.Request, created: dict[str, int]) -> dict[str, str]:
    """The configured aliases of the models the key may use: alias -> served model."""
    aliases = request.app[CONFIG].models.aliases
    return {alias: target for alias, target in aliases.items() if target in created}


async def _visible_models(request: web.Request) -> tuple[dict[str, int], dict[str, str]]:
    """The served models the key may use (name -> created unix time), and the response's
    headers."""
    admission = await admit(request, None, 0)
    served = True
    try:
        models = await request.app[MESH].list_models()
    except Exception as e:
        served = not mesh_failed(e)
        raise
    finally:
        request.app[LIMITER].settle_soon(admission, TokenUsage(), served=served)
    key = request[API_KEY]
    return {m.id: m.created for m in models if key.allows(m.id)}, admission.headers
