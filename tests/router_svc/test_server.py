"""The router over real gRPC on loopback, with real in-process workers on the tiny model."""

from __future__ import annotations

import grpc
import pytest

from infermesh.pb import common_pb2, router_pb2
from router_svc.config import RoutingSection
from tests.helpers import MODEL
from tests.helpers.inprocess import (
    eventually,
    register_unreachable_worker,
    running_router,
    running_worker,
    sim_engine,
    wait_for_workers,
)


def request() -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        request_id="r1",
        model=MODEL,
        messages=[common_pb2.ChatMessage(role="user", content="hi")],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=8),
    )


async def test_generate_is_relayed_with_route_and_usage(tiny_engine):
    async with running_router() as router, running_worker(tiny_engine, router) as worker:
        chunks = [c async for c in router.stub.Generate(request())]
    info = worker.servicer.info
    assert chunks[0].route.worker_id == info.worker_id
    assert chunks[0].route.precision == info.capabilities.precision
    assert chunks[-1].finish_reason in (
        common_pb2.FINISH_REASON_STOP,
        common_pb2.FINISH_REASON_LENGTH,
    )
    assert chunks[-1].usage.completion_tokens == sum(len(c.token_ids) for c in chunks)
    assert "".join(c.text for c in chunks)


async def test_models_listed_and_worker_gone_after_silence(tiny_engine):
    async with running_router(ttl_s=0.5) as router:
        async with running_worker(tiny_engine, router):
            models = await router.stub.ListModels(router_pb2.ListModelsRequest())
            assert [(m.id, m.workers) for m in models.models] == [(MODEL, 1)]
        await wait_for_workers(router, lambda ids: not ids)  # silent: dropped within the TTL
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.stub.Generate(request()).read()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_dead_worker_is_skipped_before_the_first_token(tiny_engine):
    async with running_router() as router, running_worker(tiny_engine, router, "live"):
        await register_unreachable_worker(router)
        for _ in range(4):  # whichever the router tries first, the stream comes from the live one
            chunks = [c async for c in router.stub.Generate(request())]
            assert chunks[0].route.worker_id == "live"


async def test_unknown_model_and_bad_registration(tiny_engine):
    async with running_router() as router, running_worker(tiny_engine, router):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.stub.Generate(common_pb2.GenerateRequest(model="nope", prompt="x")).read()
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and MODEL in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.stub.Register(
                router_pb2.RegisterRequest(worker=common_pb2.WorkerInfo(worker_id="x"))
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_worker_refuses_a_prompt_beyond_the_context(tiny_engine):
    async with running_router() as router, running_worker(tiny_engine, router):
        too_long = common_pb2.GenerateRequest(
            model=MODEL, prompt="word " * (tiny_engine.max_model_len + 10)
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.stub.Generate(too_long).read()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_cancelled_call_frees_the_sequence(tiny_engine):
    async with running_router() as router, running_worker(tiny_engine, router) as worker:
        call = router.stub.Generate(
            common_pb2.GenerateRequest(  # no max_tokens: to the context end
                model=MODEL, prompt="go on", sampling=common_pb2.SamplingParams(temperature=0)
            )
        )
        await call.read()
        assert worker.servicer.load().running == 1
        call.cancel()
        await eventually(lambda: worker.servicer.load().running == 0)


async def test_route_chooses_without_relaying_and_counts_what_it_routed():
    async with (
        running_router(routing=RoutingSection(policy="least_load")) as router,
        running_worker(sim_engine(), router, "a") as a,
        running_worker(sim_engine(), router, "b") as b,
    ):
        addresses = {"a": a.servicer.info.address, "b": b.servicer.info.address}
        replies = [await router.stub.Route(request()) for _ in range(4)]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.stub.Route(common_pb2.GenerateRequest(model="nope", prompt="x"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and MODEL in e.value.details()
    for reply in replies:
        assert [w.worker_id for w in reply.workers] in (["a", "b"], ["b", "a"])
        assert all(w.address == addresses[w.worker_id] for w in reply.workers)
        assert reply.workers[0].precision == a.servicer.info.capabilities.precision
    # The idle simulated workers' heartbeats report the same load throughout, so the
    # router's own count of what it routed is what spreads the requests.
    firsts = [reply.workers[0].worker_id for reply in replies]
    assert firsts.count("a") == firsts.count("b") == 2


async def test_reported_failures_eject_the_worker(tiny_engine):
    routing = RoutingSection(policy="round_robin", failures_to_eject=2)
    async with (
        running_router(routing=routing) as router,
        running_worker(tiny_engine, router, "live"),
    ):
        await register_unreachable_worker(router)
        firsts = [(await router.stub.Route(request())).workers[0].worker_id for _ in range(4)]
        assert set(firsts) == {"live", "dead"}  # round robin over both
        for _ in range(2):
            await router.stub.ReportFailure(
                router_pb2.ReportFailureRequest(
                    worker_id="dead", code="UNAVAILABLE", details="connection refused"
                )
            )
        firsts = [(await router.stub.Route(request())).workers[0].worker_id for _ in range(4)]
        assert firsts == ["live"] * 4
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.stub.ReportFailure(
                router_pb2.ReportFailureRequest(worker_id="live", code="BROKEN")
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "BROKEN" in e.value.details()
        # an unknown worker (gone meanwhile) is no error
        await router.stub.ReportFailure(
            router_pb2.ReportFailureRequest(worker_id="gone", code="UNAVAILABLE")
        )


async def test_complete_relays_the_whole_answer_with_its_route_and_fails_over(tiny_engine):
    async with running_router() as router, running_worker(tiny_engine, router, "live") as worker:
        await register_unreachable_worker(router)
        chunks = [c async for c in router.stub.Generate(request())]
        replies = [await router.stub.Complete(request()) for _ in range(4)]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.stub.Complete(common_pb2.GenerateRequest(model="nope", prompt="x"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    for reply in replies:  # whichever the router tries first, the answer comes from the live one
        assert reply.route.worker_id == "live"
        assert reply.route.precision == worker.servicer.info.capabilities.precision
        assert reply.text == "".join(c.text for c in chunks)
        assert reply.usage == chunks[-1].usage and reply.finish_reason == chunks[-1].finish_reason
