"""Serving ``GET /v1/models`` and ``GET /v1/models/{id}`` from the router's ListModels.

Both count as requests against the key's limits; a key restricted to some models
sees only those."""

from __future__ import annotations

from aiohttp import web

from gateway.errors import ModelNotFoundError
from gateway.generation import admit
from gateway.limits import LIMITER, mesh_failed
from gateway.mesh_client import MESH
from gateway.middleware import API_KEY
from gateway.openai_protocol import model_list, model_object
from gateway.usage import TokenUsage
from infermesh.pb import router_pb2


async def list_models(request: web.Request) -> web.Response:
    models, headers = await _visible_models(request)
    return web.json_response(
        model_list([model_object(m.id, m.created) for m in models]), headers=headers
    )


async def retrieve_model(request: web.Request) -> web.Response:
    wanted = request.match_info["model"]
    models, headers = await _visible_models(request)
    for m in models:
        if m.id == wanted:
            return web.json_response(model_object(m.id, m.created), headers=headers)
    served = ", ".join(sorted(m.id for m in models)) or "none"
    raise ModelNotFoundError(
        f"model '{wanted}' is not served; served models: {served}", param="model", headers=headers
    )


async def _visible_models(request: web.Request) -> tuple[list[router_pb2.Model], dict[str, str]]:
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
    return [m for m in models if key.allows(m.id)], admission.headers
