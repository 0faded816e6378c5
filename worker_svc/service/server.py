"""The Worker gRPC service: the servicer of every Worker RPC over the engine, and the timing of
its generations (spans and metrics). Its registration with the routers is
``worker_svc.service.registration``; the process that runs both, ``worker_svc.service.main``."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1.health import aio as health_aio
from opentelemetry import trace

from infermesh.pb import common_pb2, worker_pb2, worker_pb2_grpc
from infermesh.tls import TlsSection
from telemetry import metrics
from worker_svc.engine.api import (
    EngineOverloadedError,
    GenerationChunk,
    InferenceEngine,
    InvalidArgumentError,
    KVBlockPeer,
)
from worker_svc.engine.cache_events import CacheBatch, SubscriberDroppedError
from worker_svc.service.kv_transfer import BlockNotHeldError, KVPuller, sent_blocks
from worker_svc.service.serve_server import serve_handler
from worker_svc.service.wire import RequestFailedError, to_engine

logger = logging.getLogger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Streams the engine's generations. The engine batches and queues; past its bounded
    waiting queue a request fails with RESOURCE_EXHAUSTED (the gateway's 429)."""

    def __init__(
        self, engine: InferenceEngine, info: common_pb2.WorkerInfo, tls: TlsSection
    ) -> None:
        self._engine = engine
        self.info = info
        self._puller = KVPuller(
            engine, info.worker_id, info.capabilities.kv_transfer_bytes_per_token, tls
        )
        self._reports = itertools.count(1)
        self.health: health_aio.HealthServicer | None = None  # the server's, once it runs

    @property
    def engine(self) -> InferenceEngine:
        """The engine it serves."""
        return self._engine

    def load(self) -> common_pb2.Load:
        engine_load = self._engine.load()
        caps = self._engine.capabilities
        return common_pb2.Load(
            running=engine_load.running,
            waiting=engine_load.waiting,
            kv_cache_usage=engine_load.kv_cache_usage,
            tokens_per_second=engine_load.tokens_per_second,
            memory_used_bytes=caps.weight_bytes
            + round(engine_load.kv_cache_usage * caps.kv_cache_bytes),
            report=next(self._reports),
            links=self._puller.rates.links(),
        )

    async def Info(
        self,
        request: worker_pb2.InfoRequest,
        context: grpc.aio.ServicerContext[worker_pb2.InfoRequest, worker_pb2.InfoResponse],
    ) -> worker_pb2.InfoResponse:
        return worker_pb2.InfoResponse(worker=self.info, load=self.load())

    async def TextFiles(
        self,
        request: worker_pb2.TextFilesRequest,
        context: grpc.aio.ServicerContext[worker_pb2.TextFilesRequest, worker_pb2.TextFileChunk],
    ) -> AsyncIterator[worker_pb2.TextFileChunk]:
        text_files = self._engine.text_files
        if not text_files.files:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"tokenizer {text_files.digest!r} has no files: "
                "its prompts are counted, not rendered",
            )
        for name, data in text_files.chunks():
            yield worker_pb2.TextFileChunk(name=name, data=data)

    async def CacheEvents(
        self,
        request: worker_pb2.CacheEventsRequest,
        context: grpc.aio.ServicerContext[
            worker_pb2.CacheEventsRequest, worker_pb2.CacheEventBatch
        ],
    ) -> AsyncIterator[worker_pb2.CacheEventBatch]:
        events = self._engine.cache_events
        batches = events.subscribe(request.epoch, request.after_seq)
        try:
            async with contextlib.aclosing(batches):
                async for batch in batches:
                    yield _batch_proto(events.epoch, batch)
        except SubscriberDroppedError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    async def KVBlocks(
        self,
        request: worker_pb2.KVBlocksRequest,
        context: grpc.aio.ServicerContext[worker_pb2.KVBlocksRequest, worker_pb2.KVBlocksResponse],
    ) -> AsyncIterator[worker_pb2.KVBlocksResponse]:
        engine = self._engine
        bytes_per_token = self.info.capabilities.kv_transfer_bytes_per_token
        # an engine may take part or not by its configuration (the simulated one: its prefix cache)
        if not isinstance(engine, KVBlockPeer) or not bytes_per_token:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker's engine ({type(engine).__name__}) sends no KV blocks",
            )
        try:
            if request.HasField("prefill"):
                await self._prefill(request.prefill)
            async for message in sent_blocks(engine, request.prefix_hashes, bytes_per_token):
                yield message
        except RequestFailedError as e:
            await context.abort(e.code, e.details)
        except BlockNotHeldError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))

    async def _prefill(self, request: common_pb2.GenerateRequest) -> None:
        """Computes ``request``'s prompt into the prefix cache for a decode worker: a greedy
        generation of one token (its tools and thinking kept: they are part of the prompt)."""
        prefill = common_pb2.GenerateRequest()
        prefill.CopyFrom(request)
        prefill.sampling.CopyFrom(common_pb2.SamplingParams(temperature=0, max_tokens=1))
        prefill.ClearField("json_schema")
        async with contextlib.aclosing(self.chunks(prefill)) as chunks:
            async for _ in chunks:
                pass

    async def close(self) -> None:
        """Closes the channels of its pulls from peers."""
        await self._puller.close()

    async def Tokenize(
        self,
        request: common_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[common_pb2.GenerateRequest, common_pb2.TokenizeResponse],
    ) -> common_pb2.TokenizeResponse:
        try:
            self._check_model(request)
            count = self._engine.prompt_tokens(to_engine(request))
        except RequestFailedError as e:
            await context.abort(e.code, e.details)
        except InvalidArgumentError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return common_pb2.TokenizeResponse(prompt_tokens=count)

    async def chunks(
        self,
        request: common_pb2.GenerateRequest,
        pull: common_pb2.KVPull | None = None,
    ) -> AsyncGenerator[GenerationChunk, None]:
        """The engine's chunks for ``request``, timed under the current span (after pulling
        the prompt's blocks ``pull`` names from their peer, when it does); a request this
        worker cannot serve raises RequestFailedError with its status."""
        self._check_model(request)
        engine_request = to_engine(request)
        if pull is not None:
            engine_request = dataclasses.replace(
                engine_request, peer_prefix=await self._puller.pull(pull, request)
            )
        caps = self.info.capabilities
        trace.get_current_span().set_attributes(
            {
                "infermesh.worker_id": self.info.worker_id,
                "infermesh.device": caps.device,
                "infermesh.device_name": caps.device_name,
                "infermesh.precision": common_pb2.Precision.Name(caps.precision),
            }
        )
        timing = _Timing(request.model, lambda: self._engine.load().running)
        try:
            async with contextlib.aclosing(self._engine.generate(engine_request)) as chunks:
                async for chunk in chunks:
                    timing.saw(chunk)
                    yield chunk
        except InvalidArgumentError as e:
            timing.status = "INVALID_ARGUMENT"
            raise RequestFailedError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except EngineOverloadedError as e:
            timing.status = "RESOURCE_EXHAUSTED"
            raise RequestFailedError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        finally:
            timing.end()

    def _check_model(self, request: common_pb2.GenerateRequest) -> None:
        if request.model not in self.info.models:
            raise RequestFailedError(
                grpc.StatusCode.NOT_FOUND,
                f"model {request.model!r} is not served here; "
                f"served: {', '.join(self.info.models)}",
            )


def _batch_proto(epoch: int, batch: CacheBatch) -> worker_pb2.CacheEventBatch:
    return worker_pb2.CacheEventBatch(
        epoch=epoch,
        seq=batch.seq,
        snapshot=batch.snapshot,
        stored=batch.stored,
        removed=batch.removed,
        cleared=batch.cleared,
    )


class _Timing:
    """One generation's phases as child spans of the RPC's span (``queue``: waiting
    to join the batch; ``prefill``: to the first token; ``decode``: the rest) and as
    metrics."""

    def __init__(self, model: str, batch_size: Callable[[], int]) -> None:
        self._model = model
        self._batch_size_now = batch_size  # read once, at the first token
        self._started_ns = time.time_ns()
        self._first_ns: int | None = None
        self._queue_ns = 0
        self._batch_size = 0
        self._tokens = 0
        self._prompt_tokens = 0
        self.status = "CANCELLED"  # until the last chunk says otherwise

    def saw(self, chunk: GenerationChunk) -> None:
        self._tokens += len(chunk.token_ids)
        if self._first_ns is None and chunk.token_ids:
            self._first_ns = time.time_ns()
            self._queue_ns = min(int(chunk.queue_s * 1e9), self._first_ns - self._started_ns)
            self._batch_size = self._batch_size_now()
            trace.get_current_span().add_event("first_token", timestamp=self._first_ns)
        if chunk.finish_reason is not None:
            self.status = "OK"
            self._prompt_tokens = chunk.prompt_tokens

    def end(self) -> None:
        ended_ns = time.time_ns()
        metrics.REQUESTS.labels("worker", self._model, self.status).inc()
        if self._first_ns is None:
            return
        tracer = trace.get_tracer(__name__)
        attributes = {"infermesh.batch_size": self._batch_size}
        admitted_ns = self._started_ns + self._queue_ns
        tracer.start_span("queue", start_time=self._started_ns).end(end_time=admitted_ns)
        tracer.start_span(
            "prefill",
            start_time=admitted_ns,
            attributes={**attributes, "gen_ai.usage.input_tokens": self._prompt_tokens},
        ).end(end_time=self._first_ns)
        tracer.start_span(
            "decode",
            start_time=self._first_ns,
            attributes={**attributes, "gen_ai.usage.output_tokens": self._tokens},
        ).end(end_time=ended_ns)
        metrics.observe_generation(
            "worker",
            self._model,
            (self._first_ns - self._started_ns) / 1e9,
            (ended_ns - self._started_ns) / 1e9,
            self._prompt_tokens,
            self._tokens,
        )


def add_worker_servicer(servicer: WorkerServicer, server: grpc.aio.Server) -> None:
    """The generated add_WorkerServicer_to_server, except that Tokenize and Serve parse their
    own requests: one that does not parse (a string that is not UTF-8) fails with
    INVALID_ARGUMENT, where grpc's deserializer would answer UNKNOWN."""

    # the request arrives as bytes (no deserializer); the servicer sees the parsed message
    async def tokenize_from_bytes(
        data: bytes, context: grpc.aio.ServicerContext[Any, common_pb2.TokenizeResponse]
    ) -> common_pb2.TokenizeResponse:
        try:
            request = common_pb2.GenerateRequest.FromString(data)
        except DecodeError as e:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed GenerateRequest ({e}); strings must be UTF-8",
            )
        return await servicer.Tokenize(request, context)

    service = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
    handlers = {
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            tokenize_from_bytes, response_serializer=common_pb2.TokenizeResponse.SerializeToString
        ),
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info,
            request_deserializer=worker_pb2.InfoRequest.FromString,
            response_serializer=worker_pb2.InfoResponse.SerializeToString,
        ),
        "Serve": serve_handler(servicer),
        "TextFiles": grpc.unary_stream_rpc_method_handler(
            servicer.TextFiles,
            request_deserializer=worker_pb2.TextFilesRequest.FromString,
            response_serializer=worker_pb2.TextFileChunk.SerializeToString,
        ),
        "KVBlocks": grpc.unary_stream_rpc_method_handler(
            servicer.KVBlocks,
            request_deserializer=worker_pb2.KVBlocksRequest.FromString,
            response_serializer=worker_pb2.KVBlocksResponse.SerializeToString,
        ),
        "CacheEvents": grpc.unary_stream_rpc_method_handler(
            servicer.CacheEvents,
            request_deserializer=worker_pb2.CacheEventsRequest.FromString,
            response_serializer=worker_pb2.CacheEventBatch.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
