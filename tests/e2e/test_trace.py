"""One request is one trace across gateway, router and worker."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.accounts.keys import key_id
from tests.helpers import MODEL

_SERVICES = {"infermesh-gateway", "infermesh-router", "infermesh-worker"}


async def chat(mesh, api_key: str, headers: dict[str, str] | None = None, **body) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{mesh.spec.base_url}/chat/completions",
            headers={"Authorization": f"Bearer {api_key}", **(headers or {})},
            json={"model": MODEL, "messages": [{"role": "user", "content": "trace me"}], **body},
        ) as response,
    ):
        assert response.status == 200
        if headers and "traceparent" in headers:
            assert response.headers["x-trace-id"] == headers["traceparent"].split("-")[1]
        return await response.text()


async def _exported(receiver, trace_id: bytes, done: Callable[[list[Any]], bool]) -> list[Any]:
    """The trace's spans once ``done(spans)`` holds, or as they are after 10 s (each service
    exports in its own batches); the caller asserts on them."""
    deadline = time.monotonic() + 10
    while not done(receiver.spans(trace_id)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return receiver.spans(trace_id)


async def test_one_trace_spans_all_three_services(mesh, api_key, otlp_receiver):
    receiver, _ = otlp_receiver
    trace_id, parent_id = secrets.token_bytes(16), secrets.token_bytes(8)
    text = await chat(
        mesh,
        api_key,
        {"traceparent": f"00-{trace_id.hex()}-{parent_id.hex()}-01"},
        max_tokens=4,
        stream=True,
    )
    assert text.endswith("data: [DONE]\n\n")

    def complete(spans) -> bool:
        """Every service reported and every parent arrived: each service exports in its
        own batches, so the gateway's root can come after the worker's spans."""
        ids = {span.span_id for _, span in spans}
        return {service for service, _ in spans} == _SERVICES and all(
            span.parent_span_id in ids | {parent_id} for _, span in spans
        )

    spans = await _exported(receiver, trace_id, complete)
    assert {service for service, _ in spans} == _SERVICES

    by_id = {span.span_id: (service, span) for service, span in spans}
    roots = [span for _, span in spans if span.parent_span_id not in by_id]
    assert [span.parent_span_id for span in roots] == [parent_id], (
        "one root, under the caller's span"
    )
    assert by_id[roots[0].span_id][0] == "infermesh-gateway"

    def service_chain(span) -> list[str]:
        chain = []
        while span.parent_span_id in by_id:
            service, span = by_id[span.parent_span_id]
            chain.append(service)
        return chain

    # the request's span on the worker: its own, in the request's trace, linked to the span of
    # the long-lived stream it travelled on (a trace of its own), not one span per message
    worker_server = next(
        span
        for service, span in spans
        if service == "infermesh-worker" and span.name == "infermesh.v1.Worker/Serve request"
    )
    assert [link.trace_id != trace_id for link in worker_server.links] == [True]
    # the router chose (Route), the gateway streamed from the worker: both under the gateway
    router_server = next(
        span
        for service, span in spans
        if service == "infermesh-router" and span.name.endswith("Router/Route")
    )
    for server_span in (worker_server, router_server):
        assert set(service_chain(server_span)) == {"infermesh-gateway"}
    route = {a.key: a.value for a in router_server.attributes}
    assert route["infermesh.route.worker_id"].string_value.startswith("worker-")
    assert route["infermesh.route.policy"].string_value == "balanced"
    assert len(route["infermesh.route.order"].array_value.values) >= 1

    call = next(span for service, span in spans if span.name == f"chat {MODEL}")
    attributes = {a.key: a.value for a in call.attributes}
    assert attributes["gen_ai.operation.name"].string_value == "chat"
    assert attributes["gen_ai.request.model"].string_value == MODEL
    assert attributes["gen_ai.request.max_tokens"].int_value == 4
    assert attributes["gen_ai.usage.output_tokens"].int_value == 4
    assert attributes["gen_ai.usage.input_tokens"].int_value > 0
    assert attributes["gen_ai.response.id"].string_value
    assert [
        v.string_value for v in attributes["gen_ai.response.finish_reasons"].array_value.values
    ] == ["length"]
    phases = {span.name: span for service, span in spans if service == "infermesh-worker"}
    assert {phases[p].parent_span_id for p in ("queue", "prefill", "decode")} == {
        worker_server.span_id
    }
    assert phases["queue"].end_time_unix_nano == phases["prefill"].start_time_unix_nano
    assert phases["prefill"].end_time_unix_nano == phases["decode"].start_time_unix_nano
    assert [e.name for e in worker_server.events] == ["first_token"]


async def test_no_key_material_in_spans(mesh, api_key, otlp_receiver):
    trace_id, parent_id = secrets.token_bytes(16), secrets.token_bytes(8)
    await chat(
        mesh, api_key, {"traceparent": f"00-{trace_id.hex()}-{parent_id.hex()}-01"}, max_tokens=2
    )
    # this request's spans have arrived from every service
    await _exported(
        otlp_receiver[0], trace_id, lambda spans: {service for service, _ in spans} == _SERVICES
    )
    exported = "".join(str(span) for _, span in otlp_receiver[0].spans())
    assert exported and api_key not in exported and api_key[3:15] not in exported


async def scrape(port: int | str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        assert response.status == 200
        return {f.name: f for f in text_string_to_metric_families(await response.text())}


async def test_metrics_move_and_logs_are_json_without_keys(mesh, api_key, served_precision):
    async def requests_served() -> float:
        families = await scrape(mesh.spec.gateway_port)
        ttft = families["gen_ai_server_time_to_first_token_seconds"]
        assert any(s.name.endswith("_count") and s.value > 0 for s in ttft.samples)
        return sum(
            s.value
            for s in families["infermesh_requests"].samples
            if s.name == "infermesh_requests_total"
            and s.labels["model"] == MODEL
            and s.labels["status"] == "200"
        )

    async def key_tokens() -> dict[tuple[str, str, str], float]:
        assert "infermesh_gateway_key_tokens" not in await scrape(mesh.spec.gateway_port)
        families = await scrape(mesh.spec.env["INFERMESH_GATEWAY_METRICS_PORT"])
        return {
            (s.labels["key"], s.labels["tier"], s.labels["type"]): s.value
            for s in families["infermesh_gateway_key_tokens"].samples
            if s.name == "infermesh_gateway_key_tokens_total"
        }

    await chat(mesh, api_key, max_tokens=1)
    before, tokens_before = await requests_served(), await key_tokens()
    await chat(mesh, api_key, max_tokens=1)
    assert await requests_served() == before + 1
    # billed to the key by its name ("e2e", tests/helpers/e2e.py), never by the key or its hash
    tokens = await key_tokens()
    assert tokens["e2e", "default", "output"] == tokens_before["e2e", "default", "output"] + 1
    assert tokens["e2e", "default", "input"] > tokens_before["e2e", "default", "input"]
    assert not any(
        key_id(api_key) in label or api_key in label for labels in tokens for label in labels
    )

    router = await scrape(mesh.spec.env["INFERMESH_ROUTER_METRICS_PORT"])
    assert [
        (s.labels["precision"], s.value) for s in router["infermesh_router_workers"].samples
    ] == [(served_precision, 1)]
    worker = await scrape(mesh.spec.env["INFERMESH_WORKER_METRICS_PORT"])
    assert worker["infermesh_worker_running_sequences"].samples[0].value == 0
    assert any(
        s.value > 0
        for s in worker["gen_ai_server_time_to_first_token_seconds"].samples
        if s.name.endswith("_count")
    )

    for service in ("gateway", "router", "worker0"):
        for line in mesh.log(service).splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                assert record["level"] and record["message"]
            assert api_key not in line and api_key[3:15] not in line


def test_heartbeats_and_health_checks_are_not_traced(mesh, otlp_receiver):
    names = {span.name for _, span in otlp_receiver[0].spans()}
    assert not any(name.endswith(("/Heartbeat", "/Check")) for name in names), names
