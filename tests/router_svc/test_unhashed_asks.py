"""No route ask decided blind: an internal caller's request sent as text alone (no ids, no block
hashes) is tokenized and hashed by the router before its decision, so the router's cost rule
splits it across a prefill and a busy decode worker as it would the gateway's hashed request, and
it is answered as the same prompt served aggregated."""

from __future__ import annotations

import asyncio
import contextlib

from infermesh.pb import common_pb2
from telemetry import metrics
from tests.helpers import MODEL
from tests.helpers.inprocess import eventually, running_router, running_worker, sim_engine
from tests.helpers.worker_client import WorkerClient, worker_client

V3 = {"model": "DeepSeek-V3", "gpu": "H200"}
# D a hundred times slower than P: a 256-token chunk of its prefill (0.16 s) stalls its decoding
# streams past the 0.1 s objective, while P prefills the prompt in ms
_SLOW_D = 100.0
_STREAMS = 4


async def _decode_long(client: WorkerClient, address: str, i: int) -> None:
    request = common_pb2.GenerateRequest(
        model=MODEL, prompt=f"stream {i}", sampling=common_pb2.SamplingParams(max_tokens=30_000)
    )
    async for _ in client.generate(address, request):
        pass


async def test_an_internal_callers_text_beside_busy_decodes_is_split_as_aggregated(redis_server):
    async with (
        running_router(redis_url=redis_server.url) as router,
        running_worker(sim_engine(**V3), router, "p", role="prefill"),
        running_worker(sim_engine(**V3, time_scale=_SLOW_D), router, "d", role="decode") as d,
        worker_client() as client,
    ):
        address = d.servicer.info.address
        streams = [asyncio.create_task(_decode_long(client, address, i)) for i in range(_STREAMS)]
        try:
            fleet = router.resources.registry.fleet
            d_entry = fleet.get("d")
            assert d_entry is not None
            await eventually(lambda: fleet.busy[d_entry.slot] >= _STREAMS)
            request = common_pb2.GenerateRequest(
                model=MODEL,
                messages=[common_pb2.ChatMessage(role="user", content="split me " * 200)],
                sampling=common_pb2.SamplingParams(temperature=0, max_tokens=2),
            )
            split = metrics.ROUTER_PHASE_PLANS.labels("split", "stall")
            pulled = metrics.KV_PULL_BLOCKS.labels("p", "d")
            split_before, pulled_before = split._value.get(), pulled._value.get()
            chunks = [chunk async for chunk in router.stub.Generate(request)]
            # the decision planned P's prefill, and D took the prompt's blocks from P
            assert split._value.get() - split_before == 1
            assert pulled._value.get() - pulled_before > 0
            assert chunks[0].route.worker_id == "d"
            aggregated = await client.complete(address, request)
        finally:
            for stream in streams:
                stream.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*streams)
    assert "".join(chunk.text for chunk in chunks) == aggregated.text
    assert [t for chunk in chunks for t in chunk.token_ids] == list(aggregated.token_ids)
