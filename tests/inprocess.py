"""Real router and worker servers inside the test's event loop, on loopback
ports: for tests that need the services but not separate processes."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from infermesh.pb import router_pb2, router_pb2_grpc
from router_svc.config import RegistrySection, RouterConfig, ServerSection
from router_svc.server import create_server as create_router
from worker_svc import server as worker_server
from worker_svc.config import RouterSection, WorkerConfig
from worker_svc.config import ServerSection as WorkerServerSection
from worker_svc.engine import Engine

MODEL = "tiny-deepseek-v3"


class RunningRouter:
    def __init__(self, port: int, stub: router_pb2_grpc.RouterStub) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.stub = stub


class RunningWorker:
    def __init__(self, server: grpc.aio.Server, servicer: worker_server.WorkerServicer) -> None:
        self.server = server
        self.servicer = servicer


@contextlib.asynccontextmanager
async def running_router(ttl_ms: int = 3000) -> AsyncIterator[RunningRouter]:
    config = RouterConfig(server=ServerSection(port=0),
                          registry=RegistrySection(heartbeat_interval_ms=100, ttl_ms=ttl_ms))
    server, port, channels = await create_router(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield RunningRouter(port, router_pb2_grpc.RouterStub(channel))
    finally:
        await server.stop(grace=None)
        await channels.close()


@contextlib.asynccontextmanager
async def running_worker(engine: Engine, router: RunningRouter,
                         worker_id: str = "") -> AsyncIterator[RunningWorker]:
    """A worker registered with ``router`` (the context waits for it)."""
    config = WorkerConfig(server=WorkerServerSection(port=0, worker_id=worker_id),
                          router=RouterSection(address=router.address))
    server, servicer = await worker_server.create_server(config, engine)
    reporter = asyncio.create_task(worker_server.report_to_router(router.address, servicer))
    try:
        await wait_for_workers(router, lambda ids: servicer.info.worker_id in ids)
        yield RunningWorker(server, servicer)
    finally:
        reporter.cancel()
        await server.stop(grace=None)


async def wait_for_workers(router: RunningRouter, ready, timeout_s: float = 5.0) -> None:
    """Waits until ``ready(set of registered worker ids)`` holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        reply = await router.stub.ListWorkers(router_pb2.ListWorkersRequest())
        ids = {w.worker.worker_id for w in reply.workers}
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
