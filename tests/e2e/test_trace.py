"""One request is one trace across gateway, router and worker."""
from __future__ import annotations

import asyncio
import secrets
import time

import aiohttp

from tests.e2e.conftest import MODEL

_SERVICES = {"infermesh-gateway", "infermesh-router", "infermesh-worker"}


async def chat(mesh, api_key: str, headers: dict[str, str] | None = None, **body) -> str:
    async with aiohttp.ClientSession() as session, session.post(
            f"{mesh.spec.base_url}/chat/completions",
            headers={"Authorization": f"Bearer {api_key}", **(headers or {})},
            json={"model": MODEL, "messages": [{"role": "user", "content": "trace me"}],
                  **body}) as response:
        assert response.status == 200
        return await response.text()


async def test_one_trace_spans_all_three_services(mesh, api_key, otlp_receiver):
    receiver, _ = otlp_receiver
    trace_id, parent_id = secrets.token_bytes(16), secrets.token_bytes(8)
    text = await chat(mesh, api_key, {"traceparent": f"00-{trace_id.hex()}-{parent_id.hex()}-01"},
                      max_tokens=4, stream=True)
    assert text.endswith("data: [DONE]\n\n")

    deadline = time.monotonic() + 10
    while {s for s, _ in receiver.spans(trace_id)} != _SERVICES and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    spans = receiver.spans(trace_id)
    assert {service for service, _ in spans} == _SERVICES

    by_id = {span.span_id: (service, span) for service, span in spans}
    roots = [span for _, span in spans if span.parent_span_id not in by_id]
    assert [span.parent_span_id for span in roots] == [parent_id], "one root, under the caller's span"
    assert by_id[roots[0].span_id][0] == "infermesh-gateway"

    def service_chain(span) -> list[str]:
        chain = []
        while span.parent_span_id in by_id:
            service, span = by_id[span.parent_span_id]
            chain.append(service)
        return chain

    worker_server = next(span for service, span in spans if service == "infermesh-worker"
                         and span.name.endswith("Worker/Generate"))
    assert "infermesh-router" in service_chain(worker_server)
    assert service_chain(worker_server)[-1] == "infermesh-gateway"


async def test_no_key_material_in_spans(mesh, api_key, otlp_receiver):
    await chat(mesh, api_key, max_tokens=2)
    await asyncio.sleep(0.5)
    exported = "".join(str(span) for _, span in otlp_receiver[0].spans())
    assert exported and api_key not in exported and api_key[3:15] not in exported
