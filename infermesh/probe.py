"""Readiness probes: ``python -m infermesh.probe grpc HOST:PORT`` or
``python -m infermesh.probe http URL`` exits 0 when the service answers
healthy. Container health checks and the dev runner use them."""

from __future__ import annotations

import sys
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def grpc_serving(address: str, timeout_s: float = 1.0) -> bool:
    """The standard gRPC health service reports SERVING."""
    with grpc.insecure_channel(address) as channel:
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
    checks = {"grpc": grpc_serving, "http": http_ok}
    if len(argv) != 2 or argv[0] not in checks:
        print("usage: python -m infermesh.probe grpc HOST:PORT | http URL", file=sys.stderr)
        return 2
    return 0 if checks[argv[0]](argv[1]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
