"""Router.RouteStream: route decisions and failure reports for many requests over one stream,
against a real router with real (simulated-engine) workers on loopback. A router that loses its
registry ends its streams, and callers of a list of routers move to one that has its own."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from devtools.redis_server import RedisServer
from infermesh.channels import router_channel_options
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc
from router_svc.config import RoutingSection
from tests.helpers import MODEL
from tests.helpers.inprocess import (
    eventually,
    register_unreachable_worker,
    running_router,
    running_worker,
    sim_engine,
)


def _ask(ask_id: int, model: str = MODEL) -> router_pb2.RouteAsk:
    return router_pb2.RouteAsk(
        id=ask_id,
        request=common_pb2.GenerateRequest(
            model=model, prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=4)
        ),
    )


async def test_one_message_of_asks_is_answered_in_one_message_by_id():
    async with (
        running_router(routing=RoutingSection(policy="least_load")) as router,
        running_worker(sim_engine(), router, "a") as a,
        running_worker(sim_engine(), router, "b") as b,
    ):
        addresses = {"a": a.servicer.info.address, "b": b.servicer.info.address}
        call = router.stub.RouteStream()
        await call.write(
            router_pb2.RouteStreamRequest(asks=[_ask(1), _ask(2), _ask(3, model="nope"), _ask(4)])
        )
        response = await call.read()
        decisions = {d.id: d for d in response.decisions}
        assert sorted(decisions) == [1, 2, 3, 4]
        assert decisions[3].code == grpc.StatusCode.NOT_FOUND.value[0]
        assert MODEL in decisions[3].details and not decisions[3].workers
        for i in (1, 2, 4):  # the first try, then the fallback, each with its address
            workers = decisions[i].workers
            assert [w.worker_id for w in workers] in (["a", "b"], ["b", "a"])
            assert all(w.address == addresses[w.worker_id] for w in workers)
            assert workers[0].precision == a.servicer.info.capabilities.precision
        # the router counts what it routed: the asks spread over both workers
        firsts = [decisions[i].workers[0].worker_id for i in (1, 2, 4)]
        assert set(firsts) == {"a", "b"}
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF


async def test_failure_reports_on_the_stream_eject_the_worker():
    routing = RoutingSection(policy="round_robin", failures_to_eject=2)
    async with (
        running_router(routing=routing) as router,
        running_worker(sim_engine(), router, "live"),
    ):
        await register_unreachable_worker(router)
        call = router.stub.RouteStream()
        report = router_pb2.ReportFailureRequest(worker_id="dead", code="UNAVAILABLE")
        unreadable = router_pb2.ReportFailureRequest(worker_id="live", code="BROKEN")
        gone = router_pb2.ReportFailureRequest(worker_id="gone", code="UNAVAILABLE")
        await call.write(router_pb2.RouteStreamRequest(failures=[report, unreadable, gone, report]))
        await call.write(router_pb2.RouteStreamRequest(asks=[_ask(i) for i in range(1, 5)]))
        response = await call.read()
        assert [d.workers[0].worker_id for d in response.decisions] == ["live"] * 4
        call.cancel()


async def test_a_completed_request_reported_on_the_stream_ends_its_workers_failures_in_a_row():
    """Each request's end comes back with the worker that answered: every end frees its
    slot (once, though the caller lists it in ``finished`` too, for older routers); a
    completed one also ends that worker's failures in a row, one that did not complete leaves
    them counted."""
    routing = RoutingSection(policy="round_robin", failures_to_eject=3)
    async with (
        running_router(routing=routing) as router,
        running_worker(sim_engine(), router, "a"),
    ):
        fleet = router.resources.registry.fleet
        worker = fleet.get("a")
        assert worker is not None
        failures = router_pb2.RouteStreamRequest(
            failures=[router_pb2.ReportFailureRequest(worker_id="a", code="UNAVAILABLE")] * 2
        )
        call = router.stub.RouteStream()
        await call.write(router_pb2.RouteStreamRequest(asks=[_ask(99)]))  # open throughout
        await call.read()
        await call.write(failures)
        usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=4)
        for ask_id, completed, failures_after in ((1, False, 2), (2, True, 0)):
            await call.write(router_pb2.RouteStreamRequest(asks=[_ask(ask_id)]))
            (decision,) = (await call.read()).decisions
            assert [w.worker_id for w in decision.workers] == ["a"]
            assert fleet.in_flight[worker.slot] == 2
            end = router_pb2.RouteFinished(
                worker_id="a", served_by="a", completed=completed, usage=usage
            )
            await call.write(router_pb2.RouteStreamRequest(ends=[end], finished=["a"]))
            await eventually(lambda: fleet.in_flight[worker.slot] < 2)
            assert fleet.in_flight[worker.slot] == 1  # ask 99's
            assert fleet.failures[worker.slot] == failures_after
        await call.write(failures)  # two more: in a row, two, short of ejecting it
        await call.write(router_pb2.RouteStreamRequest(asks=[_ask(3)]))
        await call.read()
        assert fleet.failures[worker.slot] == 2 and not fleet.ejected(worker)
        call.cancel()


async def _until_unavailable(router) -> None:
    deadline = time.monotonic() + 5
    while router.resources.registry.available:
        assert time.monotonic() < deadline, "the router never noticed Redis was gone"
        await asyncio.sleep(0.02)


async def test_a_router_that_loses_its_registry_ends_its_streams_and_refuses_new_ones(tmp_path):
    with RedisServer(workdir=tmp_path) as redis_server:
        async with running_router(redis_url=redis_server.url) as router:
            call = router.stub.RouteStream()
            await call.write(router_pb2.RouteStreamRequest(asks=[_ask(1)]))
            assert (await call.read()).decisions[0].code  # no worker: answered all the same
            redis_server.stop()
            await _until_unavailable(router)
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call.read()
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "cannot reach its registry" in (ended.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await router.stub.RouteStream().read()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "registry" in (refused.value.details() or "")


async def test_calls_to_a_list_of_routers_go_to_those_that_reach_their_registry(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    with (
        RedisServer(workdir=tmp_path / "a") as lost_redis,
        RedisServer(workdir=tmp_path / "b") as redis_server,
    ):
        async with (
            running_router(redis_url=lost_redis.url) as lost,
            running_router(redis_url=redis_server.url) as kept,
            running_worker(sim_engine(), kept, "w"),
        ):
            target = f"ipv4:{lost.address},{kept.address}"
            channel = grpc.aio.insecure_channel(target, options=router_channel_options(target))
            async with channel:
                stub = router_pb2_grpc.RouterStub(channel)
                lost_redis.stop()
                await _until_unavailable(lost)
                deadline = time.monotonic() + 5
                answered = []
                while len(answered) < 6:  # once the health watch saw it: never the lost one
                    assert time.monotonic() < deadline, answered
                    try:
                        reply = await stub.ListModels(router_pb2.ListModelsRequest(), timeout=1)
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.UNAVAILABLE
                        answered.clear()
                        continue
                    answered.append([m.id for m in reply.models])
                assert answered == [[MODEL]] * 6
