"""Real routers and simulated workers over gRPC on loopback: routing by precision and
hardware, routers sharing one Redis, failover, ejection, capacity, deadlines, Redis outages."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from devtools.redis_server import RedisServer
from infermesh.pb import common_pb2, router_pb2
from router_svc.config import RoutingSection
from tests.helpers import MODEL
from tests.helpers.inprocess import (
    eventually,
    gateway_route,
    register_unreachable_worker,
    running_router,
    running_worker,
    sim_engine,
    wait_for_workers,
)

FP8, BF16 = common_pb2.PRECISION_FP8, common_pb2.PRECISION_BF16


def generate_request(
    max_tokens: int = 8, precision=common_pb2.PRECISION_UNSPECIFIED, prompt: str = "hello"
) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        model=MODEL,
        prompt=prompt,
        precision=precision,
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
    )


async def served_by(router, request: common_pb2.GenerateRequest) -> common_pb2.Route:
    """The worker the router chose, on the gateway's path (its route stream)."""
    return await gateway_route(router, request)


async def test_health_and_reflection_are_served(redis_server):
    async with (
        running_router(redis_url=redis_server.url) as router,
        grpc.aio.insecure_channel(router.address) as channel,
    ):
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="infermesh.v1.Router")
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        services = {s.name async for r in replies for s in r.list_services_response.service}
    assert {"infermesh.v1.Router", "grpc.health.v1.Health"} <= services


async def test_precision_wish_and_hardware_fitness_pick_the_worker(redis_server):
    async with (
        running_router(redis_url=redis_server.url) as router,
        running_worker(sim_engine("H100"), router, "h100"),
        running_worker(sim_engine("A100"), router, "a100"),
    ):
        route = await served_by(router, generate_request(precision=FP8))
        assert (route.worker_id, route.precision, route.device) == ("h100", FP8, "cuda")
        assert (await served_by(router, generate_request(precision=BF16))).worker_id == "a100"
        # no wish: an idle FP8 Hopper worker is the better fit for a latency-bound stream
        assert {(await served_by(router, generate_request())).worker_id for _ in range(3)} == {
            "h100"
        }
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await served_by(router, generate_request(precision=common_pb2.PRECISION_FP16))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_two_routers_share_one_registry(redis_server):
    async with (
        running_router(redis_url=redis_server.url) as a,
        running_router(redis_url=redis_server.url) as b,
        running_worker(sim_engine("A100"), a, "w1"),
    ):  # heartbeats to router a only
        await wait_for_workers(b, lambda ids: ids == {"w1"})
        assert (await served_by(b, generate_request())).worker_id == "w1"
        models = await b.stub.ListModels(router_pb2.ListModelsRequest())
        assert [(m.id, m.workers) for m in models.models] == [(MODEL, 1)]
    async with running_router(redis_url=redis_server.url, ttl_s=0.5) as c:
        await wait_for_workers(c, lambda ids: not ids)  # silent: gone for every router


async def test_workers_advertise_the_architecture_they_serve(redis_server):
    """A DeepSeek-V3.2 worker says so (model_type and its sparse attention's index_topk); a V3 one
    is dense."""
    async with (
        running_router(redis_url=redis_server.url) as router,
        running_worker(sim_engine("H200", index_topk=2048), router, "v32"),
        running_worker(sim_engine("H100"), router, "v3"),
    ):
        await wait_for_workers(router, lambda ids: ids == {"v32", "v3"})
        reply = await router.stub.ListWorkers(router_pb2.ListWorkersRequest())
        served = {
            w.worker.worker_id: (w.worker.capabilities.model_type, w.worker.capabilities.index_topk)
            for w in reply.workers
        }
        assert served == {"v32": ("deepseek_v32", 2048), "v3": ("deepseek_v3", 0)}


async def test_registering_twice_and_nonsense_load_over_grpc(redis_server):
    async with running_router(redis_url=redis_server.url) as router:
        worker = common_pb2.WorkerInfo(worker_id="w", address="127.0.0.1:1", models=[MODEL])
        for _ in range(2):
            await router.stub.Register(router_pb2.RegisterRequest(worker=worker))
        reply = await router.stub.ListWorkers(router_pb2.ListWorkersRequest())
        assert [w.worker.worker_id for w in reply.workers] == ["w"]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.stub.Heartbeat(
                router_pb2.HeartbeatRequest(
                    worker_id="w", load=common_pb2.Load(kv_cache_usage=float("nan"))
                )
            )
        assert (
            e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "kv_cache_usage" in e.value.details()
        )
        unknown = await router.stub.Heartbeat(router_pb2.HeartbeatRequest(worker_id="nobody"))
        assert not unknown.registered


async def test_worker_dying_mid_stream_ends_the_stream_with_a_clean_error(redis_server):
    async with running_router(redis_url=redis_server.url) as router:
        async with running_worker(sim_engine("V100"), router, "doomed") as worker:
            call = router.stub.Generate(generate_request(max_tokens=500))
            first = await call.read()
            assert first.route.worker_id == "doomed"
            await worker.server.stop(grace=None)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                while await call.read() != grpc.aio.EOF:
                    pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "doomed failed mid-stream" in e.value.details()


async def test_failing_worker_is_skipped_then_ejected(redis_server):
    routing = RoutingSection(policy="round_robin", failures_to_eject=2)
    async with (
        running_router(redis_url=redis_server.url, routing=routing) as router,
        running_worker(sim_engine("A100", zero_latency=True), router, "live"),
    ):
        await register_unreachable_worker(router)
        fleet = router.resources.registry.fleet
        for _ in range(4):  # whichever is tried first, the stream comes from the live one
            assert (await served_by(router, generate_request())).worker_id == "live"
        assert fleet.ejected_until[fleet.get("dead").slot] > fleet.clock()


async def test_no_capacity_anywhere_is_resource_exhausted(redis_server):
    async with running_router(redis_url=redis_server.url) as router:
        workers = [sim_engine("V100", max_parallel=1, max_waiting=0) for _ in range(2)]
        async with (
            running_worker(workers[0], router, "v1", max_parallel=1),
            running_worker(workers[1], router, "v2", max_parallel=1),
        ):
            busy = [router.stub.Generate(generate_request(max_tokens=1000)) for _ in range(2)]
            routes = {(await call.read()).route.worker_id for call in busy}
            assert routes == {"v1", "v2"}
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await router.stub.Generate(generate_request()).read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "no worker has capacity" in e.value.details()
            for call in busy:
                call.cancel()
            await eventually(lambda: all(w.load().running == 0 for w in workers))
            assert (await served_by(router, generate_request())).worker_id in routes


async def test_deadline_reaches_the_worker(redis_server):
    engine = sim_engine("V100")
    async with running_router(redis_url=redis_server.url) as router, running_worker(engine, router):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in router.stub.Generate(generate_request(max_tokens=1000), timeout=0.5):
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: engine.load().running == 0)


async def test_redis_outage_answers_unavailable_and_recovers(tmp_path):
    redis = RedisServer(workdir=tmp_path).start()
    try:
        async with (
            running_router(redis_url=redis.url) as router,
            running_worker(sim_engine("H100", zero_latency=True), router, "w"),
        ):
            assert (await served_by(router, generate_request())).worker_id == "w"
            redis.stop()
            async with grpc.aio.insecure_channel(router.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                await eventually_async(
                    lambda: health_is(health, health_pb2.HealthCheckResponse.NOT_SERVING)
                )
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await router.stub.Generate(generate_request()).read()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert f"Redis at 127.0.0.1:{redis.port}/0) is unreachable" in e.value.details()
                redis.start()  # empty: the worker registers again by itself
                await eventually_async(
                    lambda: health_is(health, health_pb2.HealthCheckResponse.SERVING)
                )
                await wait_for_workers(router, lambda ids: ids == {"w"})
                assert (await served_by(router, generate_request())).worker_id == "w"
    finally:
        redis.stop()


async def health_is(health: health_pb2_grpc.HealthStub, status) -> bool:
    reply = await health.Check(health_pb2.HealthCheckRequest())
    return reply.status == status


async def eventually_async(condition, timeout_s: float = 5.0) -> None:
    """Waits until the coroutine ``condition()`` returns true."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.05)
