"""The router over real gRPC on loopback, with real in-process workers on the tiny model."""
from __future__ import annotations


import grpc
import pytest

from infermesh.pb import common_pb2, router_pb2
from infermesh.redis_server import free_port
from tests.inprocess import MODEL, eventually, running_router, running_worker, wait_for_workers


def request() -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        request_id="r1", model=MODEL, messages=[common_pb2.ChatMessage(role="user", content="hi")],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=8))


async def test_generate_is_relayed_with_route_and_usage(tiny_engine):
    async with running_router() as router, running_worker(tiny_engine, router) as worker:
        chunks = [c async for c in router.stub.Generate(request())]
    info = worker.servicer.info
    assert chunks[0].route.worker_id == info.worker_id
    assert chunks[0].route.precision == info.capabilities.precision
    assert chunks[-1].finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert chunks[-1].usage.completion_tokens == sum(len(c.token_ids) for c in chunks)
    assert "".join(c.text for c in chunks)


async def test_models_listed_and_worker_gone_after_silence(tiny_engine):
    async with running_router(ttl_ms=500) as router:
        async with running_worker(tiny_engine, router):
            models = await router.stub.ListModels(router_pb2.ListModelsRequest())
            assert [(m.id, m.workers) for m in models.models] == [(MODEL, 1)]
        await wait_for_workers(router, lambda ids: not ids)  # silent: dropped within the TTL
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.stub.Generate(request()).read()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_dead_worker_is_skipped_before_the_first_token(tiny_engine):
    async with running_router() as router, running_worker(tiny_engine, router, "live"):
        dead = common_pb2.WorkerInfo(worker_id="dead", address=f"127.0.0.1:{free_port()}",
                                     models=[MODEL], capabilities=common_pb2.Capabilities(max_parallel=1))
        await router.stub.Register(router_pb2.RegisterRequest(worker=dead))
        for _ in range(4):  # whichever the router tries first, the stream comes from the live one
            chunks = [c async for c in router.stub.Generate(request())]
            assert chunks[0].route.worker_id == "live"


async def test_unknown_model_and_bad_registration(tiny_engine):
    async with running_router() as router, running_worker(tiny_engine, router):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.stub.Generate(common_pb2.GenerateRequest(model="nope", prompt="x")).read()
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and MODEL in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.stub.Register(router_pb2.RegisterRequest(
                worker=common_pb2.WorkerInfo(worker_id="x")))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_worker_refuses_a_prompt_beyond_the_context(tiny_engine):
    async with running_router() as router, running_worker(tiny_engine, router):
        too_long = common_pb2.GenerateRequest(model=MODEL,
                                              prompt="word " * (tiny_engine.max_model_len + 10))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.stub.Generate(too_long).read()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_cancelled_call_frees_the_sequence(tiny_engine):
    async with running_router() as router, running_worker(tiny_engine, router) as worker:
        call = router.stub.Generate(common_pb2.GenerateRequest(  # no max_tokens: to the context end
            model=MODEL, prompt="go on", sampling=common_pb2.SamplingParams(temperature=0)))
        await call.read()
        assert worker.servicer.load().running == 1
        call.cancel()
        await eventually(lambda: worker.servicer.load().running == 0)
