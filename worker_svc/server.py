"""The Worker gRPC service and its registration with the router."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

import telemetry
from infermesh.grpc_server import create_grpc_server
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from worker_svc.config import WorkerConfig
from worker_svc.engine import (Engine, GenerationChunk, GenerationRequest, InvalidRequestError,
                               SamplingParams)

logger = logging.getLogger(__name__)

_PRECISIONS = {"fp8": common_pb2.PRECISION_FP8, "bf16": common_pb2.PRECISION_BF16,
               "fp16": common_pb2.PRECISION_FP16, "fp32": common_pb2.PRECISION_FP32}
_FINISH_REASONS = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "stop": common_pb2.FINISH_REASON_STOP,
                   "length": common_pb2.FINISH_REASON_LENGTH}
_REGISTER_RETRY_S = 1.0


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Admits at most ``max_parallel`` streams into the engine; the rest wait."""

    def __init__(self, engine: Engine, info: common_pb2.WorkerInfo, max_parallel: int) -> None:
        self._engine = engine
        self.info = info
        self._slots = asyncio.Semaphore(max_parallel)
        self._waiting = 0

    def load(self) -> common_pb2.Load:
        engine_load = self._engine.load()
        return common_pb2.Load(running=engine_load.running,
                               waiting=engine_load.waiting + self._waiting,
                               tokens_per_second=engine_load.tokens_per_second)

    async def Info(self, request: worker_pb2.InfoRequest,
                   context: grpc.aio.ServicerContext) -> worker_pb2.InfoResponse:
        return worker_pb2.InfoResponse(worker=self.info, load=self.load())

    async def Generate(self, request: common_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GenerateResponse]:
        if request.model not in self.info.models:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model {request.model!r} is not served here; "
                                f"served: {', '.join(self.info.models)}")
        if bool(request.messages) == bool(request.prompt):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "exactly one of messages and prompt must be given")
        span = trace.get_current_span()
        span.set_attribute("infermesh.worker_id", self.info.worker_id)
        span.set_attribute("infermesh.precision",
                           common_pb2.Precision.Name(self.info.capabilities.precision))
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            async with contextlib.aclosing(self._engine.generate(_to_engine(request))) as chunks:
                async for chunk in chunks:
                    yield _to_proto(chunk)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            self._slots.release()


def _to_engine(request: common_pb2.GenerateRequest) -> GenerationRequest:
    s = request.sampling
    sampling = SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids))
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    return GenerationRequest(request_id=request.request_id, messages=messages or None,
                             prompt=request.prompt or None, sampling=sampling)


def _to_proto(chunk: GenerationChunk) -> common_pb2.GenerateResponse:
    response = common_pb2.GenerateResponse(
        text=chunk.text, token_ids=chunk.token_ids,
        finish_reason=_FINISH_REASONS[chunk.finish_reason])
    if chunk.finish_reason is not None:
        response.usage.CopyFrom(common_pb2.Usage(prompt_tokens=chunk.prompt_tokens,
                                                 completion_tokens=chunk.completion_tokens))
    return response


def worker_info(config: WorkerConfig, engine: Engine, address: str) -> common_pb2.WorkerInfo:
    caps = engine.capabilities
    return common_pb2.WorkerInfo(
        worker_id=config.server.worker_id or f"worker-{address}",
        address=address,
        models=[config.model.served_name],
        capabilities=common_pb2.Capabilities(
            device=caps.device, device_name=caps.device_name,
            compute_capability=caps.compute_capability, precision=_PRECISIONS[caps.precision],
            memory_total_bytes=caps.memory_total_bytes, weight_bytes=caps.weight_bytes,
            max_parallel=config.parallel.max_parallel))


async def report_to_router(router_address: str, servicer: WorkerServicer) -> None:
    """Registers, then heartbeats load until cancelled. Survives a router
    restart (registers again) and an unreachable router (retries)."""
    info = servicer.info
    async with grpc.aio.insecure_channel(
            router_address, interceptors=telemetry.grpc_client_interceptors()) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        registered, interval_s, reported_down = False, _REGISTER_RETRY_S, False
        while True:
            try:
                if not registered:
                    reply = await router.Register(
                        router_pb2.RegisterRequest(worker=info, load=servicer.load()), timeout=5)
                    interval_s = reply.heartbeat_interval_ms / 1000
                    registered = True
                    logger.info("registered with router %s as %s", router_address, info.worker_id)
                else:
                    reply = await router.Heartbeat(router_pb2.HeartbeatRequest(
                        worker_id=info.worker_id, load=servicer.load()), timeout=5)
                    registered = reply.registered
                reported_down = False
            except grpc.aio.AioRpcError as e:
                registered = False
                if not reported_down:
                    logger.warning("router %s unreachable (%s); retrying", router_address,
                                   e.code().name)
                    reported_down = True
                interval_s = _REGISTER_RETRY_S
            if registered:
                await asyncio.sleep(interval_s)


async def create_server(config: WorkerConfig, engine: Engine) -> tuple[grpc.aio.Server, WorkerServicer]:
    """Starts the Worker service for ``engine`` (port 0: a free port)."""
    servicer: WorkerServicer | None = None

    def add(server: grpc.aio.Server, port: int) -> None:
        nonlocal servicer
        address = config.server.advertise_address or f"{config.server.host}:{port}"
        servicer = WorkerServicer(engine, worker_info(config, engine, address),
                                  config.parallel.max_parallel)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)

    server, _, _ = await create_grpc_server(
        f"{config.server.host}:{config.server.port}", add,
        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name])
    assert servicer is not None, "create_grpc_server did not add the servicer"
    return server, servicer


async def serve(config: WorkerConfig) -> None:
    engine = await asyncio.to_thread(
        Engine.from_checkpoint, config.model.path, dtype=config.model.dtype,
        use_native_fp8=config.quantization.use_native_fp8,
        max_model_len=config.attention.max_model_len)
    server, servicer = await create_server(config, engine)
    info = servicer.info
    logger.info("worker %s listening on %s serving %s on %s in %s", info.worker_id, info.address,
                config.model.served_name, engine.capabilities.device, engine.capabilities.precision)
    reporter = asyncio.create_task(report_to_router(config.router.address, servicer))
    try:
        await server.wait_for_termination()
    finally:
        reporter.cancel()
        await server.stop(grace=2)
        await engine.close()
