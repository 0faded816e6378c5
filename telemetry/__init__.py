"""OpenTelemetry set-up shared by every service.

Traces go over OTLP/gRPC to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (default
localhost:4317, Jaeger's OTLP port); every standard ``OTEL_*`` variable is
honoured by the SDK (sampler, resource attributes, ``OTEL_SDK_DISABLED``), TLS
included: an ``https://`` endpoint, the collector's CA in
``OTEL_EXPORTER_OTLP_CERTIFICATE`` and this service's certificate in
``OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`` / ``_CLIENT_KEY`` (as deploy/ sets them).
Context crosses services in gRPC metadata through the official
instrumentations, never by hand. With ``OTEL_SDK_DISABLED=true`` no span is
ever recorded, so the instrumentations are left out too: they would cost
every request and every message their time for nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings

import grpc
import opentelemetry.instrumentation.aiohttp_server as otel_aiohttp
from aiohttp.typedefs import Middleware
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.instrumentation.grpc import filters as grpc_filters
from opentelemetry.instrumentation.redis import RedisInstrumentor
from opentelemetry.sdk.environment_variables import OTEL_SDK_DISABLED
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 2.0


def tracing_enabled() -> bool:
    """False when ``OTEL_SDK_DISABLED`` is true, as the SDK itself reads it."""
    return os.environ.get(OTEL_SDK_DISABLED, "").strip().lower() != "true"


def setup_tracing(service_name: str) -> TracerProvider:
    """Installs the global tracer provider for this process; call once at start."""
    # shutdown_tracing() flushes with a bound; the SDK's own exit hook has none.
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: service_name}), shutdown_on_exit=False
    )
    provider.add_span_processor(BatchSpanProcessor(span_exporter()))
    trace.set_tracer_provider(provider)
    # An absent collector is an operator's choice in development, not an
    # error worth a log line per export attempt.
    logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter").setLevel(logging.CRITICAL)
    return provider


def span_exporter() -> OTLPSpanExporter:
    """The OTLP/gRPC exporter as the ``OTEL_EXPORTER_OTLP_*`` variables configure it: its
    endpoint and, for an ``https://`` one, the CA it checks the collector against and the
    certificate it presents."""
    return OTLPSpanExporter()


def shutdown_tracing(timeout_s: float = _SHUTDOWN_TIMEOUT_S) -> None:
    """Flushes pending spans; call at exit. Waits at most ``timeout_s``: with no
    collector listening the exporter would retry for its whole export timeout."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        flush = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
        flush.start()
        flush.join(timeout_s)


# Calls made every second or so by every worker or probe: traced, they would
# bury the requests in Jaeger under one trace per heartbeat.
_UNTRACED = grpc_filters.negate(
    grpc_filters.any_of(grpc_filters.method_name("Heartbeat"), grpc_filters.health_check())
)


def grpc_server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """Interceptors for ``grpc.aio.server``: continue the caller's trace."""
    return [aio_server_interceptor(filter_=_UNTRACED)] if tracing_enabled() else []


def grpc_client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for ``grpc.aio`` channels: carry the trace in metadata."""
    return aio_client_interceptors(filter_=_UNTRACED) if tracing_enabled() else []


def aiohttp_middlewares() -> list[Middleware]:
    """The server-span middleware for an aiohttp app, honouring an incoming traceparent."""
    if not tracing_enabled():
        return []
    if otel_aiohttp.tracer is None:
        # The middleware reads module state (tracer, meters, excluded URLs)
        # that only instrument() sets. Set it, then undo the patching of
        # web.Application: the app adds this middleware itself, in its place.
        instrumentor = otel_aiohttp.AioHttpServerInstrumentor()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the web.Application subclass
            instrumentor.instrument()
        instrumentor.uninstrument()
    return [otel_aiohttp.create_aiohttp_middleware()]


def instrument_redis() -> None:
    """Spans for Redis commands; the instrumentation replaces every argument with '?'."""
    if tracing_enabled():
        RedisInstrumentor().instrument()
