"""The gRPC server set-up every service shares: tracing interceptors, the
standard health service and server reflection (so grpcurl works)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

import telemetry
from infermesh.channels import SERVER_KEEPALIVE_OPTIONS


async def create_grpc_server(
    address: str,
    add_servicers: Callable[[grpc.aio.Server, int], None],
    service_names: Iterable[str],
) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """Builds and starts a server on ``address`` ("host:port"; port 0 picks a free one).

    ``add_servicers(server, port)`` is called once the port is bound. Returns
    the server, the port and the health servicer, its services SERVING."""
    server = grpc.aio.server(
        interceptors=telemetry.grpc_server_interceptors(), options=SERVER_KEEPALIVE_OPTIONS
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    add_servicers(server, port)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    await server.start()
    for name in ["", *names]:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health
