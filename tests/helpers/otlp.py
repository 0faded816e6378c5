"""The OTLP/gRPC trace endpoint a collector or Jaeger serves, for tests that read the spans
services export."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """The OTLP/gRPC trace endpoint a collector or Jaeger serves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[tuple[str, trace_pb2.Span]] = []

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                )
                for scope_spans in resource_spans.scope_spans:
                    self._spans.extend((service, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, trace_id: bytes | None = None) -> list[tuple[str, trace_pb2.Span]]:
        with self._lock:
            return [
                (s, span)
                for s, span in self._spans
                if trace_id is None or span.trace_id == trace_id
            ]


@contextlib.contextmanager
def serving_receiver() -> Iterator[tuple[OtlpReceiver, int]]:
    """A receiver on a free loopback port (plaintext), and the port."""
    receiver = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, port
    finally:
        server.stop(grace=None)


class _Switch(SpanProcessor):
    """The in-process provider's one processor: hands spans to ``target`` while a test exports,
    to nothing otherwise (the global provider can be set only once per process)."""

    def __init__(self) -> None:
        self.target: SpanProcessor | None = None

    def on_start(self, span: Span, parent_context: otel_context.Context | None = None) -> None:
        if self.target is not None:
            self.target.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if self.target is not None:
            self.target.on_end(span)


_SWITCH = _Switch()


@contextlib.contextmanager
def exporting_in_process(port: int, service: str = "infermesh-in-process") -> Iterator[None]:
    """The spans of the services running in this process (in-process routers and workers),
    exported to the receiver on ``port`` meanwhile, as a deployment's services export theirs;
    flushed as it ends."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
        provider.add_span_processor(_SWITCH)
        trace.set_tracer_provider(provider)
    processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True))
    _SWITCH.target = processor
    try:
        yield
    finally:
        _SWITCH.target = None
        processor.shutdown()  # type: ignore[no-untyped-call]  # the SDK leaves it untyped
