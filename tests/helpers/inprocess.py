"""Real router and worker servers inside the test's event loop, on loopback
ports: for tests that need the services but not separate processes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from devtools.certs import role_tls
from devtools.redis_server import RedisServer
from gateway.config import RouterSection as GatewayRouterSection
from gateway.mesh.client import MeshClient
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc
from infermesh.ports import free_port
from infermesh.tls import TlsSection, open_channel
from router_svc.config import (
    FairQueueSection,
    RedisSection,
    RegistrySection,
    RouterConfig,
    RouterServerSection,
    RoutingSection,
)
from router_svc.server import RunningRouter as RouterResources
from router_svc.server import create_server as create_router
from tests.helpers import MODEL
from worker_svc.config import (
    EngineSection,
    ParallelSection,
    Role,
    RouterSection,
    WorkerConfig,
    WorkerSection,
    WorkerServerSection,
)
from worker_svc.engine.api import InferenceEngine
from worker_svc.service.main import create_server as create_worker_server
from worker_svc.service.registration import Registration
from worker_svc.service.server import WorkerServicer
from worker_svc.sim_engine.engine import SimEngine

# The bulk of the suite runs the services without TLS; a test of TLS passes a certificate
# directory (``devtools.certs.write_certs``) instead.
PLAINTEXT = TlsSection(plaintext=True)


def tls_of(certs: Path | None, role: str) -> TlsSection:
    """``role``'s [tls] from the certificate directory ``certs``; None: plaintext."""
    return PLAINTEXT if certs is None else role_tls(certs, role)


class RunningRouter:
    def __init__(
        self, port: int, stub: router_pb2_grpc.RouterStub, resources: RouterResources
    ) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.stub = stub
        self.resources = resources  # its registry and local fleet view


class RunningWorker:
    def __init__(
        self, server: grpc.aio.Server, servicer: WorkerServicer, registration: Registration
    ) -> None:
        self.server = server
        self.servicer = servicer
        self.registration = registration


@contextlib.asynccontextmanager
async def running_router(
    ttl_s: float = 3.0,
    redis_url: str | None = None,
    routing: RoutingSection | None = None,
    port: int = 0,
    certs: Path | None = None,
    fair_queue: FairQueueSection | None = None,
) -> AsyncIterator[RunningRouter]:
    """A router on ``port`` (0: a free one) with its registry in Redis at ``redis_url``
    (None: a throwaway Redis of its own). Routers given the same URL share one registry.
    ``certs``: over TLS with that directory's router certificate, the test's stub calling
    with the admin's; None: plaintext. ``fair_queue``: its [fair_queue] (None: off)."""
    if redis_url is None:
        with tempfile.TemporaryDirectory() as workdir, RedisServer(workdir=workdir) as redis_server:
            async with running_router(
                ttl_s, redis_server.url, routing, port, certs, fair_queue
            ) as router:
                yield router
        return
    config = RouterConfig(
        server=RouterServerSection(port=port),
        redis=RedisSection(url=redis_url),
        registry=RegistrySection(heartbeat_interval_s=0.1, ttl_s=ttl_s, refresh_s=0.05),
        routing=routing or RoutingSection(),
        fair_queue=fair_queue or FairQueueSection(),
        tls=tls_of(certs, "router"),
    )
    server, port, resources = await create_router(config)
    try:
        async with open_channel(f"127.0.0.1:{port}", tls_of(certs, "admin")) as channel:
            yield RunningRouter(port, router_pb2_grpc.RouterStub(channel), resources)
    finally:
        await server.stop(grace=None)
        await resources.close()


@contextlib.asynccontextmanager
async def running_worker(
    engine: InferenceEngine,
    router: RunningRouter,
    worker_id: str = "",
    max_parallel: int | None = None,
    certs: Path | None = None,
    port: int = 0,
    role: Role = "both",
) -> AsyncIterator[RunningWorker]:
    """A worker on ``port`` (0: a free one) registered with ``router`` (the context waits for
    it); ``max_parallel`` is what it reports (None: its device's default), give the engine's.
    ``certs``: over TLS with that directory's worker certificate; None: plaintext. ``role``: its
    [worker] role."""
    config = WorkerConfig(
        server=WorkerServerSection(port=port, worker_id=worker_id),
        worker=WorkerSection(role=role),
        router=RouterSection(address=router.address),
        parallel=ParallelSection(max_parallel=max_parallel),
        tls=tls_of(certs, "worker"),
    )
    server, servicer = await create_worker_server(config, engine)
    registration = Registration(router.address, servicer, config.tls)
    reporter = asyncio.create_task(registration.run())
    try:
        await wait_for_workers(router, lambda ids: servicer.info.worker_id in ids)
        yield RunningWorker(server, servicer, registration)
    finally:
        reporter.cancel()
        await server.stop(grace=None)
        await servicer.close()


async def register_unreachable_worker(
    router: RunningRouter, worker_id: str = "dead", model: str = MODEL
) -> None:
    """Registers a worker serving ``model`` (reporting no tokenizer) at a port nobody listens
    on: every call to it fails."""
    await router.stub.Register(
        router_pb2.RegisterRequest(
            worker=common_pb2.WorkerInfo(
                worker_id=worker_id,
                address=f"127.0.0.1:{free_port()}",
                models=[model],
                capabilities=common_pb2.Capabilities(max_parallel=1),
            )
        )
    )


def sim_engine(
    gpu: str = "H100",
    max_parallel: int | None = None,
    max_waiting: int = 64,
    kind: type[SimEngine] = SimEngine,
    **engine: Any,
) -> SimEngine:
    """A simulated engine on a GPU profile (max_parallel None: the GPU's default);
    ``engine`` overrides [engine] keys; ``kind``: SimEngine or a subclass of it."""
    return kind.from_config(
        WorkerConfig(
            parallel=ParallelSection(max_parallel=max_parallel, max_waiting=max_waiting),
            engine=dataclasses.replace(EngineSection(kind="sim", gpu=gpu), **engine),
        )
    )


async def wait_for_workers(router: RunningRouter, ready, timeout_s: float = 5.0) -> None:
    """Waits until ``ready(set of registered worker ids)`` holds (a router whose registry read
    timed out on a loaded machine answers UNAVAILABLE until its next read: asked again)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    ids: set[str] = set()
    while True:
        try:
            reply = await router.stub.ListWorkers(router_pb2.ListWorkersRequest())
            ids = {w.worker.worker_id for w in reply.workers}
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        else:
            if ready(ids):
                return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"registered workers {sorted(ids)} never became ready")
        await asyncio.sleep(0.05)


async def eventually(condition, timeout_s: float = 5.0) -> None:
    """Waits until ``condition()`` holds, failing after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.05)


async def gateway_complete(
    router: RunningRouter, request: common_pb2.GenerateRequest, *, stream: bool = False
) -> common_pb2.GenerateResponse:
    """``request`` served to its end on the gateway's path: routed on ``router``'s RouteStream
    by the gateway's mesh client and served from the worker over Worker.Serve
    (``infermesh.mesh_call``); its last chunk (not ``stream``: the whole answer), with the
    route of the worker that served it. Raises the router's refusal as
    ``grpc.aio.AioRpcError``, the workers' failure as ``failover.StreamFailedError``."""
    mesh = MeshClient(GatewayRouterSection(address=router.address), TlsSection(plaintext=True))
    try:
        call = mesh.call(request, stream=stream)
        async with contextlib.aclosing(call.chunks) as chunks:
            last = [chunk async for chunk in chunks][-1]
        assert call.finish_reason and call.route is not None
        last.route.CopyFrom(call.route)
        return last
    finally:
        await mesh.close()


async def gateway_route(
    router: RunningRouter, request: common_pb2.GenerateRequest
) -> common_pb2.Route:
    """The worker that served ``request``, streamed to its end on the gateway's path."""
    return (await gateway_complete(router, request, stream=True)).route
