"""Generations straight from a worker, for the tests and benchmarks of a worker alone: over
``Worker.Serve`` with the mesh's own Serve client, the one way a generation reaches a worker."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

from devtools.certs import role_tls
from infermesh.channels import WorkerChannels
from infermesh.pb import common_pb2, worker_pb2, worker_pb2_grpc
from infermesh.ports import free_port
from infermesh.serve_client import ServeClient
from infermesh.tls import TlsSection
from tests.helpers.inprocess import PLAINTEXT
from worker_svc.config import ModelSection, WorkerConfig, WorkerServerSection
from worker_svc.engine.api import InferenceEngine
from worker_svc.service.main import create_server as create_worker_server

# Long enough for a CPU worker's slowest test prompt, short enough that a stuck one fails.
TIMEOUT_S = 60.0


class WorkerClient:
    """Requests to workers by address (with ``tls``, this caller's certificate); a failed
    request raises ``grpc.aio.AioRpcError`` with the worker's status, as its own call would."""

    def __init__(self, tls: TlsSection = PLAINTEXT) -> None:
        self._channels = WorkerChannels(tls)
        self._serve = ServeClient(self._channels)

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        """The worker's stub on the same channel, for its other methods (Info, Tokenize...)."""
        return self._channels.stub(address)

    def generate(
        self, address: str, request: common_pb2.GenerateRequest, timeout_s: float = TIMEOUT_S
    ) -> AsyncGenerator[common_pb2.GenerateResponse, None]:
        """The request's chunks as the worker streams them; closing the generator early
        cancels the request on the worker."""
        return self._serve.chunks(address, request, whole=False, timeout_s=timeout_s)

    async def complete(
        self,
        address: str,
        request: common_pb2.GenerateRequest,
        timeout_s: float = TIMEOUT_S,
        pull: common_pb2.KVPull | None = None,
    ) -> common_pb2.GenerateResponse:
        """The whole completion in one message (``pull``: the prompt's blocks the worker is to
        take from a peer first); cancelling the caller cancels the request."""
        chunks = self._serve.chunks(address, request, whole=True, timeout_s=timeout_s, pull=pull)
        async with contextlib.aclosing(chunks):
            (whole,) = [chunk async for chunk in chunks]
        return whole

    async def close(self) -> None:
        await self._serve.close()
        await self._channels.close()


@contextlib.asynccontextmanager
async def worker_client(tls: TlsSection = PLAINTEXT) -> AsyncIterator[WorkerClient]:
    client = WorkerClient(tls)
    try:
        yield client
    finally:
        await client.close()


def complete_once(
    address: str,
    request: common_pb2.GenerateRequest,
    tls: TlsSection = PLAINTEXT,
    timeout_s: float = TIMEOUT_S,
) -> common_pb2.GenerateResponse:
    """One whole completion, for a caller without an event loop (a synchronous test)."""

    async def complete() -> common_pb2.GenerateResponse:
        async with worker_client(tls) as client:
            return await client.complete(address, request, timeout_s)

    return asyncio.run(complete())


class LoopbackWorker:
    """A worker serving on loopback, asked through its own client."""

    def __init__(self, client: WorkerClient, info: common_pb2.WorkerInfo) -> None:
        self.client = client
        self.info = info
        self.address = info.address
        self.stub = client.stub(info.address)

    def generate(
        self, request: common_pb2.GenerateRequest
    ) -> AsyncGenerator[common_pb2.GenerateResponse, None]:
        return self.client.generate(self.address, request)

    async def complete(self, request: common_pb2.GenerateRequest) -> common_pb2.GenerateResponse:
        return await self.client.complete(self.address, request)

    async def load(self) -> common_pb2.Load:
        return (await self.stub.Info(worker_pb2.InfoRequest())).load


@contextlib.asynccontextmanager
async def loopback_worker(engine: InferenceEngine) -> AsyncIterator[LoopbackWorker]:
    """``engine`` served by a plaintext worker on a free loopback port, and a client of it."""
    config = WorkerConfig(server=WorkerServerSection(port=0), tls=PLAINTEXT)
    server, servicer = await create_worker_server(config, engine)
    try:
        async with worker_client() as client:
            yield LoopbackWorker(client, servicer.info)
    finally:
        await server.stop(grace=None)
        await servicer.close()


@contextlib.asynccontextmanager
async def serving_as_worker(
    engine: InferenceEngine, name: str, model_dir: Path | str, certs: Path
) -> AsyncIterator[str]:
    """``engine`` served over mutual TLS with the worker certificate ``name`` of ``certs``
    (`python -m infermesh certs --worker name=`), as workers calling each other are; yields its
    address."""
    tls = dataclasses.replace(
        role_tls(certs, "worker"),
        cert_file=str(certs / f"worker-{name}.crt"),
        key_file=str(certs / f"worker-{name}.key"),
    )
    config = WorkerConfig(
        server=WorkerServerSection(host="127.0.0.1", port=free_port(), worker_id=name),
        model=ModelSection(path=str(model_dir)),
        tls=tls,
    )
    server, servicer = await create_worker_server(config, engine)
    try:
        yield servicer.info.address
    finally:
        await server.stop(grace=None)
        await servicer.close()
