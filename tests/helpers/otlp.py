"""The OTLP/gRPC trace endpoint a collector or Jaeger serves, for tests that read the spans
services export."""

from __future__ import annotations

import threading

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


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
