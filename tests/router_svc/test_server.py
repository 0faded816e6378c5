"""The router over real gRPC on loopback, with real in-process workers on the tiny model."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

import grpc
import pytest

from infermesh.pb import common_pb2, router_pb2
from tests.helpers import MODEL
from tests.helpers.inprocess import (
    eventually,
    register_unreachable_worker,
    running_router,
    running_worker,
    sim_engine,
    wait_for_workers,
)
from worker_svc.engine.api import GenerationChunk, GenerationRequest
from worker_svc.sim_engine.engine import SimEngine


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


class _BuggyEngine(SimEngine):
    """A simulated engine with a bug: a generation raises after its first chunk."""

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        async with contextlib.aclosing(super().generate(request)) as chunks:
            yield await anext(chunks)
        raise RuntimeError("a bug")


@pytest.mark.parametrize(
    "fault, code, details",
    [
        ("closed", grpc.StatusCode.UNAVAILABLE, "the engine was closed"),
        ("bug", grpc.StatusCode.INTERNAL, "the worker failed: RuntimeError('a bug')"),
    ],
)
async def test_a_worker_failing_mid_stream_ends_the_relay_with_its_own_status(fault, code, details):
    """Past its first chunk a worker's failure is the caller's answer, with the worker's own
    status and message: its engine closed under the running request, or failed by a bug."""
    engine = sim_engine("V100", max_parallel=2, kind=_BuggyEngine if fault == "bug" else SimEngine)
    async with (
        running_router() as router,
        running_worker(engine, router, "w", max_parallel=2),
    ):
        call = router.stub.Generate(
            common_pb2.GenerateRequest(
                model=MODEL, prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=2000)
            )
        )
        assert (await call.read()).route.worker_id == "w"
        if fault == "closed":
            await engine.close()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in call:
                pass
        assert e.value.code() == code
        assert e.value.details() == f"worker w failed mid-stream: {details}"
        fleet = router.resources.registry.fleet
        assert fleet.in_flight[fleet.get("w").slot] == 0  # its slot is free again
    await engine.close()
