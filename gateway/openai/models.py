"""Serving ``GET /v1/models`` and ``GET /v1/models/{id}`` from the router's ListModels, in
OpenAI's shape or, for an Anthropic client (Claude Code asks at start), in Anthropic's.

The list holds the served models and the aliases that stand for them ([models] aliases, glob
patterns as they are written). Both count as requests against the key's limits; a key restricted
to some models sees only those and their aliases."""

from __future__ import annotations

import datetime
from typing import Any

from aiohttp import web

from gateway.accounts.auth import API_KEY
from gateway.accounts.limits import LIMITER, mesh_failed
from gateway.accounts.usage import TokenUsage
from gateway.api.generation import MODELS_CONFIG, admit
from gateway.http.errors import ModelNotFoundError
from gateway.http.middleware import is_anthropic_client
from gateway.mesh.client import MESH
from gateway.openai.chat_protocol import model_list, model_object

Listed = tuple[str, str, int]  # (the name clients ask for, the served model, created unix time)


async def list_models(request: web.Request) -> web.Response:
    models, headers = await _visible_models(request)
    if is_anthropic_client(request):
        body = {
            "data": [_anthropic_model(m) for m in models],
            "has_more": False,
            "first_id": models[0][0] if models else None,
            "last_id": models[-1][0] if models else None,
        }
        return web.json_response(body, headers=headers)
    return web.json_response(
        model_list([model_object(name, created) for name, _, created in models]), headers=headers
    )


async def retrieve_model(request: web.Request) -> web.Response:
    wanted = request.match_info["model"]
    models, headers = await _visible_models(request)
    served = request.app[MODELS_CONFIG].resolve(wanted)
    for listed in models:
        if listed[0] == served:
            found = (wanted, served, listed[2])
            if is_anthropic_client(request):
                return web.json_response(_anthropic_model(found), headers=headers)
            return web.json_response(model_object(wanted, listed[2]), headers=headers)
    names = ", ".join(sorted(name for name, target, _ in models if name == target)) or "none"
    raise ModelNotFoundError(
        f"model '{wanted}' is not served; served models: {names}", param="model", headers=headers
    )


def _anthropic_model(listed: Listed) -> dict[str, Any]:
    name, served, created = listed
    return {
        "type": "model",
        "id": name,
        "display_name": name if name == served else f"{name} ({served})",
        "created_at": datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat(),
    }


async def _visible_models(request: web.Request) -> tuple[list[Listed], dict[str, str]]:
    """The served models the key may use, then the aliases of those, as (name, served, created)."""
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
    created = {m.id: m.created for m in models if key.allows(m.id)}
    aliases = request.app[MODELS_CONFIG].aliases
    listed = [(name, name, when) for name, when in created.items()]
    listed += [
        (alias, target, created[target]) for alias, target in aliases.items() if target in created
    ]
    return listed, admission.headers
