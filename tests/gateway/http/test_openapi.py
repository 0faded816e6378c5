"""GET /openapi.json: valid OpenAPI 3, every route the gateway serves in it, request bodies
from the models the handlers validate with."""

from __future__ import annotations

import pytest
from aiohttp import web
from openapi_spec_validator import validate

from gateway.openai.chat_protocol import ChatCompletionRequest
from tests.helpers.gateway import make_config, start_gateway


def _routes(app: web.Application) -> set[tuple[str, str]]:
    """(method, path) of every route of the app and its sub-apps, as aiohttp's router has them;
    but the console's pages (/console), which are no API."""
    found = set()
    for resource in app.router.resources():
        if isinstance(resource, web.PrefixedSubAppResource):
            if resource.canonical != "/console":
                found |= _routes(resource.get_info()["app"])
        else:
            found |= {
                (route.method.lower(), resource.canonical)
                for route in resource
                if route.method != "HEAD"
            }  # implied by GET
    return found


@pytest.mark.parametrize("alias", ["", "/api"])
async def test_the_document_is_valid_openapi_3_and_has_every_route(redis_server, alias):
    gateway = await start_gateway(make_config(redis_server.url, alias_base=alias))
    try:
        response = await gateway.get("/openapi.json")
        assert response.status == 200
        document = await response.json()
        routes = _routes(gateway.server.app)
    finally:
        await gateway.close()
    validate(document)
    documented = {(method, path) for path, item in document["paths"].items() for method in item}
    assert documented == routes
    assert ("post", "/v1/chat/completions") in routes and (
        "get",
        "/admin/keys/{id}/usage",
    ) in routes
    if alias:
        assert ("post", f"{alias}/chat/completions") in documented
    ids = [op["operationId"] for item in document["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))


async def test_operations_are_described_as_openai_clients_call_them(gateway):
    document = await (await gateway.get("/openapi.json")).json()
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["operationId"] == "createChatCompletion"
    assert chat["security"] == [{"apiKey": []}]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    schema = document["components"]["schemas"]["ChatCompletionRequest"]
    assert set(schema["properties"]) == set(ChatCompletionRequest.model_fields)
    assert schema["properties"]["model"]["maxLength"] == 256
    error = chat["responses"]["default"]["content"]["application/json"]["schema"]["$ref"]
    assert error.endswith("/ErrorBody")
    usage = document["paths"]["/admin/keys/{id}/usage"]["get"]
    days = next(p for p in usage["parameters"] if p["name"] == "days")
    assert days["in"] == "query" and days["schema"]["maximum"] == 400
