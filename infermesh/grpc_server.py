"""The gRPC server set-up every service shares: mutual TLS with the caller check
(``infermesh.tls``, ``infermesh.authz``), tracing interceptors, the standard health service and
server reflection (so grpcurl works)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

import telemetry
from infermesh import tls as mesh_tls
from infermesh.authz import Authorizer
from infermesh.channels import SERVER_OPTIONS


async def create_grpc_server(
    address: str,
    add_servicers: Callable[[grpc.aio.Server, int], None],
    service_names: Iterable[str],
    tls: mesh_tls.TlsSection,
    service: str,
) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """Builds and starts ``service``'s server on ``address`` ("host:port"; port 0 picks a free
    one): over mutual TLS with every call's caller checked, or, ``tls.plaintext``, without
    either (ConfigError when ``tls`` is neither).

    ``add_servicers(server, port)`` is called once the port is bound. Returns
    the server, the port and the health servicer, its services SERVING."""
    interceptors = telemetry.grpc_server_interceptors()
    if tls.plaintext:
        mesh_tls.warn_plaintext(service)
        credentials = None
    else:
        credentials = mesh_tls.server_credentials(tls)
        interceptors.append(Authorizer(service))
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    port = (
        server.add_insecure_port(address)
        if credentials is None
        else server.add_secure_port(address, credentials)
    )
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
