"""Traces over mutual TLS, as the deployments export them: the exporter telemetry sets up,
configured by the standard variables alone, against a TLS-only OTLP receiver that asks for a
certificate of the mesh's CA."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.sdk import environment_variables as otel_env
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import telemetry
from devtools.certs import write_certs
from tests.helpers.otlp import OtlpReceiver


@pytest.fixture
def tls_receiver(tmp_path) -> Iterator[tuple[OtlpReceiver, int, Path]]:
    """A receiver serving OTLP on TLS only with a certificate of a fresh CA (the router's, which
    names localhost), requiring a client certificate of that CA; its port and the CA's dir."""
    write_certs(tmp_path)
    receiver = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    credentials = grpc.ssl_server_credentials(
        [((tmp_path / "router.key").read_bytes(), (tmp_path / "router.crt").read_bytes())],
        root_certificates=(tmp_path / "ca.crt").read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    yield receiver, port, tmp_path
    server.stop(None)


def _export_one(name: str) -> None:
    """One span through the exporter telemetry.setup_tracing uses, sent as it ends."""
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "tls-test"}))
    provider.add_span_processor(SimpleSpanProcessor(telemetry.span_exporter()))
    with provider.get_tracer(__name__).start_as_current_span(name):
        pass
    provider.shutdown()


def test_spans_reach_a_tls_collector_with_the_services_certificate(tls_receiver, monkeypatch):
    receiver, port, certs = tls_receiver
    monkeypatch.setenv(otel_env.OTEL_EXPORTER_OTLP_ENDPOINT, f"https://localhost:{port}")
    monkeypatch.setenv(otel_env.OTEL_EXPORTER_OTLP_CERTIFICATE, str(certs / "ca.crt"))
    monkeypatch.setenv(otel_env.OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE, str(certs / "gateway.crt"))
    monkeypatch.setenv(otel_env.OTEL_EXPORTER_OTLP_CLIENT_KEY, str(certs / "gateway.key"))
    monkeypatch.setenv(otel_env.OTEL_EXPORTER_OTLP_TIMEOUT, "2")
    _export_one("over-tls")
    assert [(service, span.name) for service, span in receiver.spans()] == [
        ("tls-test", "over-tls")
    ]
    # without a certificate of its own the collector refuses it in the handshake
    monkeypatch.delenv(otel_env.OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE)
    monkeypatch.delenv(otel_env.OTEL_EXPORTER_OTLP_CLIENT_KEY)
    _export_one("no-certificate")
    assert [span.name for _, span in receiver.spans()] == ["over-tls"]
