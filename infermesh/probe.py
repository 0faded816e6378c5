"""Readiness probes: ``python -m infermesh.probe grpc HOST:PORT [CERT KEY CA]`` or
``python -m infermesh.probe http URL`` exits 0 when the service answers
healthy. Container health checks and the dev runner use them. A gRPC service over TLS asks
every caller for a certificate, so its probe gives one (any role: health is open to all)."""

from __future__ import annotations

import sys
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infermesh.config import ConfigError
from infermesh.tls import TlsSection, open_blocking_channel

_PLAINTEXT = TlsSection(plaintext=True)


def grpc_serving(address: str, timeout_s: float = 1.0, tls: TlsSection = _PLAINTEXT) -> bool:
    """The standard gRPC health service reports SERVING (asked with ``tls``'s certificate)."""
    with open_blocking_channel(address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    status: int = reply.status
    serving: int = health_pb2.HealthCheckResponse.SERVING
    return status == serving


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status: int = response.status
            return status == 200
    except OSError:
        return False


def main(argv: list[str]) -> int:
    if argv[:1] == ["http"] and len(argv) == 2:
        return 0 if http_ok(argv[1]) else 1
    if argv[:1] == ["grpc"] and len(argv) in (2, 5):
        tls = _PLAINTEXT
        if len(argv) == 5:
            tls = TlsSection(cert_file=argv[2], key_file=argv[3], ca_file=argv[4])
        try:
            return 0 if grpc_serving(argv[1], tls=tls) else 1
        except ConfigError as e:
            print(f"probe: {e}", file=sys.stderr)
            return 2
    print(
        "usage: python -m infermesh.probe grpc HOST:PORT [CERT KEY CA] | http URL", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
