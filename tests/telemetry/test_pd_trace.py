"""One request, one trace across P and D: when the router splits a request's phases, the decode
worker asks the prefill worker for the prompt's blocks (Worker.KVBlocks) with the request's trace
context, so P's prefill is a span of the request's trace, under D's pull; the spans read back
from a real OTLP receiver, exported by the router and workers running in this process."""

from __future__ import annotations

import asyncio

from opentelemetry import trace

from infermesh.pb import common_pb2
from router_svc.config import RoutingSection
from tests.helpers import MODEL
from tests.helpers.inprocess import running_router, running_worker, sim_engine
from tests.helpers.otlp import exporting_in_process, serving_receiver

V3 = {"model": "DeepSeek-V3", "gpu": "H200"}


async def test_p_prefill_is_in_the_requests_trace(redis_server):
    with serving_receiver() as (receiver, port):
        with exporting_in_process(port):
            async with (
                running_router(
                    redis_url=redis_server.url, routing=RoutingSection(phase_split="always")
                ) as router,
                running_worker(sim_engine(**V3), router, "p", role="prefill"),
                running_worker(sim_engine(**V3), router, "d", role="decode"),
            ):
                request = common_pb2.GenerateRequest(
                    model=MODEL,
                    messages=[common_pb2.ChatMessage(role="user", content="trace me " * 60)],
                    sampling=common_pb2.SamplingParams(max_tokens=2),
                )
                with trace.get_tracer(__name__).start_as_current_span("caller") as caller:
                    await router.stub.Complete(request)
                trace_id = caller.get_span_context().trace_id.to_bytes(16, "big")
        await asyncio.sleep(0)
        spans = [span for _, span in receiver.spans(trace_id)]
    by_id = {span.span_id: span for span in spans}
    assert [span.name for span in spans if span.parent_span_id not in by_id] == ["caller"]

    def worker_of(span) -> str:
        return next(
            (a.value.string_value for a in span.attributes if a.key == "infermesh.worker_id"), ""
        )

    def ancestors(span) -> list[str]:
        names = []
        while span.parent_span_id in by_id:
            span = by_id[span.parent_span_id]
            names.append(f"{span.name}@{worker_of(span)}" if worker_of(span) else span.name)
        return names

    # P served Worker.KVBlocks in the request's trace: its span under D's pull, under the
    # request's span on D, under the router's, under the caller's
    p_server = next(s for s in spans if s.name.endswith("Worker/KVBlocks") and worker_of(s) == "p")
    assert ancestors(p_server) == [
        "/infermesh.v1.Worker/KVBlocks",  # D's client span
        "infermesh.kv_pull",
        "infermesh.v1.Worker/Serve request@d",
        "/infermesh.v1.Router/Complete",  # the router's server span
        "/infermesh.v1.Router/Complete",  # the caller's client span
        "caller",
    ]
    # P's prefill of the prompt is one of its phases there
    p_phases = {s.name for s in spans if s.parent_span_id == p_server.span_id}
    assert "prefill" in p_phases
