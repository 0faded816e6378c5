"""Serving ``GET /v1/models`` and ``GET /v1/models/{id}`` from the router's ListModels."""
from __future__ import annotations

from aiohttp import web

from gateway.errors import ModelNotFoundError
from gateway.protocol import model_list, model_object
from gateway.router_client import ROUTER


async def list_models(request: web.Request) -> web.Response:
    models = await request.app[ROUTER].list_models()
    return web.json_response(model_list([model_object(m.id, m.created) for m in models]))


async def retrieve_model(request: web.Request) -> web.Response:
    wanted = request.match_info["model"]
    models = await request.app[ROUTER].list_models()
    for m in models:
        if m.id == wanted:
            return web.json_response(model_object(m.id, m.created))
    served = ", ".join(sorted(m.id for m in models)) or "none"
    raise ModelNotFoundError(f"model '{wanted}' is not served; served models: {served}",
                             param="model")
