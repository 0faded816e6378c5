"""Fair queueing on Router.RouteStream when every eligible worker is full: a real router
with a real (simulated-engine) worker of one slot, whose slot the test frees by reporting
the routed request finished, as the gateway does."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from infermesh.config import ConfigError
from infermesh.pb import common_pb2, router_pb2
from router_svc.config import FairQueueSection
from router_svc.config import load as load_router_config
from tests.helpers import MODEL
from tests.helpers.inprocess import running_router, running_worker, sim_engine

_Call = grpc.aio.StreamStreamCall[router_pb2.RouteStreamRequest, router_pb2.RouteStreamResponse]
_QUEUE = FairQueueSection(enabled=True, max_per_tenant=8, max_total=32, max_wait_s=10)


def _ask(
    ask_id: int, tenant: str, weight: int = 1, priority: int = 0, timeout_ms: int = 0
) -> router_pb2.RouteAsk:
    return router_pb2.RouteAsk(
        id=ask_id,
        request=common_pb2.GenerateRequest(
            model=MODEL,
            prompt="hi",
            sampling=common_pb2.SamplingParams(max_tokens=4),
            tenant=tenant,
            weight=weight,
            priority=priority,
            tier="test",
        ),
        timeout_ms=timeout_ms,
    )


async def _read(call: _Call) -> router_pb2.RouteStreamResponse:
    response = await asyncio.wait_for(call.read(), 5)
    assert isinstance(response, router_pb2.RouteStreamResponse), response
    return response


async def _full_stream(router) -> _Call:
    """A route stream whose first ask took the worker's one slot."""
    call: _Call = router.stub.RouteStream()
    await call.write(router_pb2.RouteStreamRequest(asks=[_ask(1, "first")]))
    response = await _read(call)
    assert [d.workers[0].worker_id for d in response.decisions] == ["w"]
    return call


async def _release_and_read(call: _Call) -> list[int]:
    """Frees the slot; the ids of the decisions the router then sends."""
    await call.write(router_pb2.RouteStreamRequest(finished=["w"]))
    response = await _read(call)
    return [d.id for d in response.decisions]


async def _nothing_more(call: _Call) -> None:
    """Nothing was decided: an ask the router answers at once (a model nobody serves) comes
    back alone, where any decision made before it would have come first."""
    probe = _ask(99, "probe")
    probe.request.model = "nope"
    await call.write(router_pb2.RouteStreamRequest(asks=[probe]))
    response = await _read(call)
    assert [(d.id, d.code) for d in response.decisions] == [
        (99, grpc.StatusCode.NOT_FOUND.value[0])
    ]


@pytest.fixture
async def full_router():
    async with (
        running_router(fair_queue=_QUEUE) as router,
        running_worker(sim_engine(max_parallel=1), router, "w", max_parallel=1),
    ):
        yield router


async def test_queued_asks_are_served_in_weighted_fair_order(full_router):
    call = await _full_stream(full_router)
    light = [_ask(10 + i, "light", weight=1) for i in range(6)]
    heavy = [_ask(20 + i, "heavy", weight=3) for i in range(6)]
    await call.write(router_pb2.RouteStreamRequest(asks=light + heavy))
    await _nothing_more(call)  # the worker is full: every ask waits
    served = []
    for _ in range(8):
        served += await _release_and_read(call)
    # start-time fair queueing: three of heavy's for each of light's, each in arrival order
    assert [i for i in served if i >= 20] == [20, 21, 22, 23, 24, 25]
    assert [i for i in served if i < 20] == [10, 11]
    call.cancel()


async def test_a_request_without_a_weight_weighs_its_tiers():
    tiers = FairQueueSection(enabled=True, tier_weights={"gold": 3})
    async with (
        running_router(fair_queue=tiers) as router,
        running_worker(sim_engine(max_parallel=1), router, "w", max_parallel=1),
    ):
        call = await _full_stream(router)
        free = [_ask(10 + i, "free", weight=0) for i in range(2)]
        gold = [_ask(20 + i, "gold", weight=0) for i in range(6)]
        for ask in gold:
            ask.request.tier = "gold"
        await call.write(router_pb2.RouteStreamRequest(asks=free + gold))
        served = []
        for _ in range(8):
            served += await _release_and_read(call)
        assert served == [10, 20, 21, 22, 11, 23, 24, 25]  # as weights 1 and 3 would
        call.cancel()


async def test_priority_orders_a_tenants_own_queue(full_router):
    call = await _full_stream(full_router)
    asks = [_ask(10, "t", priority=0), _ask(11, "t", priority=5), _ask(12, "t", priority=1)]
    await call.write(router_pb2.RouteStreamRequest(asks=asks))
    served = []
    for _ in range(3):
        served += await _release_and_read(call)
    assert served == [11, 12, 10]
    call.cancel()


async def test_a_cancelled_ask_leaves_the_queue(full_router):
    call = await _full_stream(full_router)
    await call.write(router_pb2.RouteStreamRequest(asks=[_ask(10, "a"), _ask(11, "b")]))
    await call.write(router_pb2.RouteStreamRequest(cancel=[10]))
    assert await _release_and_read(call) == [11]
    await call.write(router_pb2.RouteStreamRequest(finished=["w"]))
    await _nothing_more(call)  # 10 got no decision, ever
    call.cancel()


async def test_a_closed_stream_frees_its_slots_and_leaves_the_queue(full_router):
    call = await _full_stream(full_router)
    await call.write(router_pb2.RouteStreamRequest(asks=[_ask(10, "a")]))
    call.cancel()  # its caller went away, a request routed and one queued with it
    other = full_router.stub.RouteStream()
    await other.write(router_pb2.RouteStreamRequest(asks=[_ask(20, "b")]))
    response = await _read(other)
    assert [(d.id, d.workers[0].worker_id) for d in response.decisions] == [(20, "w")]
    other.cancel()


async def test_full_queues_answer_resource_exhausted_and_unavailable_with_retry_after():
    bounds = FairQueueSection(enabled=True, max_per_tenant=2, max_total=3, max_wait_s=10)
    async with (
        running_router(fair_queue=bounds) as router,
        running_worker(sim_engine(max_parallel=1), router, "w", max_parallel=1),
    ):
        call = await _full_stream(router)
        await call.write(router_pb2.RouteStreamRequest(asks=[_ask(10, "a"), _ask(11, "a")]))
        await call.write(router_pb2.RouteStreamRequest(asks=[_ask(12, "a")]))
        (tenant_full,) = (await _read(call)).decisions
        assert tenant_full.id == 12
        assert tenant_full.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert tenant_full.retry_after_ms > 0 and "this tenant" in tenant_full.details
        await call.write(router_pb2.RouteStreamRequest(asks=[_ask(20, "b"), _ask(30, "c")]))
        (fleet_full,) = (await _read(call)).decisions
        assert fleet_full.id == 30
        assert fleet_full.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert fleet_full.retry_after_ms > 0 and "every worker is busy" in fleet_full.details
        # the queued ones are still served, fairly: a's first, then b's, then a's second
        served = []
        for _ in range(3):
            served += await _release_and_read(call)
        assert served == [10, 20, 11]
        call.cancel()


async def test_an_ask_whose_deadline_passes_in_the_queue_is_refused(full_router):
    call = await _full_stream(full_router)
    started = time.monotonic()
    await call.write(router_pb2.RouteStreamRequest(asks=[_ask(10, "a", timeout_ms=300)]))
    (expired,) = (await _read(call)).decisions
    assert time.monotonic() - started >= 0.25
    assert expired.id == 10 and expired.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert expired.retry_after_ms > 0 and not expired.workers
    # it left the queue: the freed slot goes to the next ask at once
    await call.write(router_pb2.RouteStreamRequest(finished=["w"], asks=[_ask(11, "b")]))
    assert [d.id for d in (await _read(call)).decisions] == [11]
    call.cancel()


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_per_tenant = 0", "need 1 <= max_per_tenant <= max_total"),
        ("max_per_tenant = 10\nmax_total = 5", "need 1 <= max_per_tenant <= max_total"),
        ("max_wait_s = 0", "max_wait_s: must be positive"),
        ("default_retry_after_ms = 0", "default_retry_after_ms: must be >= 1"),
        ("enabled = 1", "enabled: expected bool"),
        ("tier_weights = { gold = 0 }", "tier_weights.gold: must be an integer 1..1000"),
    ],
)
def test_a_bad_fair_queue_config_names_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "router.toml"
    path.write_text(f"[fair_queue]\n{text}\n")
    with pytest.raises(ConfigError) as e:
        load_router_config(str(path))
    assert str(path) in str(e.value) and "[fair_queue]" in str(e.value)
    assert message in str(e.value)


async def test_relayed_requests_queue_too_and_never_overfill_the_worker():
    bounds = FairQueueSection(enabled=True, max_per_tenant=3, max_total=8, max_wait_s=10)
    async with (
        running_router(fair_queue=bounds) as router,
        running_worker(sim_engine("V100", max_parallel=1), router, "w", max_parallel=1),
    ):
        request = _ask(0, "caller").request
        request.sampling.max_tokens = 8
        peak = 0

        async def generate() -> int:
            chunks = [c async for c in router.stub.Generate(request)]
            return sum(len(c.token_ids) for c in chunks)

        async def sample() -> None:
            nonlocal peak
            while True:
                reply = await router.stub.ListWorkers(router_pb2.ListWorkersRequest())
                peak = max(peak, *(s.load.running + s.load.waiting for s in reply.workers))
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        relayed = [asyncio.create_task(generate()) for _ in range(4)]  # one runs, three wait
        await asyncio.sleep(0.1)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await router.stub.Complete(request)  # the tenant's queue is full
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        retry_after = dict(refused.value.trailing_metadata() or ())["retry-after-ms"]
        assert int(retry_after) > 0
        assert await asyncio.gather(*relayed) == [8, 8, 8, 8]
        sampler.cancel()
        assert peak == 1
