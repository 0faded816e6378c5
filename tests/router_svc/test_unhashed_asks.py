"""No route ask decided blind: an internal caller's request sent as text alone (no ids, no block
hashes) is tokenized and hashed by the router before its decision, so it is split across a
prefill and a decode worker as the gateway's hashed requests are, and answered as the same
prompt served aggregated."""

from __future__ import annotations

from infermesh.pb import common_pb2
from router_svc.config import RoutingSection
from telemetry import metrics
from tests.helpers import MODEL
from tests.helpers.inprocess import running_router, running_worker, sim_engine
from tests.helpers.worker_client import worker_client

V3 = {"model": "DeepSeek-V3", "gpu": "H200"}


async def test_an_internal_callers_text_is_split_and_answered_as_aggregated(redis_server):
    # "always": a decode worker hands every hashed prompt to a prefill worker; an ask without
    # hashes was served aggregated on D whatever the rule
    async with (
        running_router(
            redis_url=redis_server.url, routing=RoutingSection(phase_split="always")
        ) as router,
        running_worker(sim_engine(**V3), router, "p", role="prefill"),
        running_worker(sim_engine(**V3), router, "d", role="decode") as d,
    ):
        request = common_pb2.GenerateRequest(
            model=MODEL,
            messages=[common_pb2.ChatMessage(role="user", content="split me " * 60)],
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4),
        )
        split = metrics.ROUTER_PHASE_PLANS.labels("split", "always")
        pulled = metrics.KV_PULL_BLOCKS.labels("p", "d")
        split_before, pulled_before = split._value.get(), pulled._value.get()
        chunks = [chunk async for chunk in router.stub.Generate(request)]
        # the decision planned P's prefill, and D took the prompt's blocks from P
        assert split._value.get() - split_before == 1
        assert pulled._value.get() - pulled_before > 0
        assert chunks[0].route.worker_id == "d"
        async with worker_client() as client:
            aggregated = await client.complete(d.servicer.info.address, request)
    assert "".join(chunk.text for chunk in chunks) == aggregated.text
    assert [t for chunk in chunks for t in chunk.token_ids] == list(aggregated.token_ids)
