"""Caller identities on the mesh's gRPC hops: the role a peer's certificate names, and one
table of which roles may call what.

A certificate names its role as a SAN URI ``spiffe://infermesh/<role>`` (a client may add its
name: ``spiffe://infermesh/client/<name>``) and the hosts it is reached at as DNS and IP SANs
(``python -m infermesh certs`` writes such a set). With TLS on, ``Authorizer`` checks every call
against ``ALLOWED`` before the servicer sees it: a caller without a mesh identity is refused
``UNAUTHENTICATED``, one whose role may not call the method ``PERMISSION_DENIED``; health and
reflection stay open. ``require_address_host`` is the one check that needs the request: a
worker registers only an address whose host its certificate names. Every refusal is logged
with the peer's identity and counted (``infermesh_grpc_refused_total``). With plaintext there
is no identity and nothing is checked."""

from __future__ import annotations

import dataclasses
import inspect
import ipaddress
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc

from telemetry import metrics

logger = logging.getLogger(__name__)

ROLES = ("gateway", "router", "worker", "client", "admin")
_URI_PREFIX = "spiffe://infermesh/"
_WORKER = "/infermesh.v1.Worker/"
_ROUTER = "/infermesh.v1.Router/"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_PROMPT_CARRIERS = frozenset({"gateway", "router"})
_FLEET_READERS = frozenset({"gateway", "client", "admin"})
# a refusal's status by its reason: no identity, else a role or address not allowed
_CODES = {"unauthenticated": grpc.StatusCode.UNAUTHENTICATED}

# Which roles may call each method of the mesh's services; a method not listed is refused.
ALLOWED: Mapping[str, frozenset[str]] = {
    # a worker's prompts and tokens: only the gateway and the router (its internal callers')
    **{f"{_WORKER}{m}": _PROMPT_CARRIERS for m in ("Serve", "Tokenize")},
    f"{_WORKER}Info": _PROMPT_CARRIERS | {"admin"},
    # the tokenizer's files, for the callers that render prompts as the worker does
    f"{_WORKER}TextFiles": _PROMPT_CARRIERS,
    # what a worker caches, for the router's cache index
    f"{_WORKER}CacheEvents": frozenset({"router"}),
    # the KV cache of cached blocks, for a peer worker that would otherwise compute them
    f"{_WORKER}KVBlocks": frozenset({"worker"}),
    # the gateway's route stream: route decisions and failure reports
    f"{_ROUTER}RouteStream": frozenset({"gateway"}),
    # a generation without the HTTP API, for internal callers (the gateway routes on its
    # route stream instead)
    **{f"{_ROUTER}{m}": frozenset({"client"}) for m in ("Generate", "Complete")},
    f"{_ROUTER}Tokenize": frozenset({"gateway", "client"}),
    # the registry: only workers (each for an address its certificate names)
    **{f"{_ROUTER}{m}": frozenset({"worker"}) for m in ("Register", "Heartbeat")},
    **{f"{_ROUTER}{m}": _FLEET_READERS for m in ("ListWorkers", "ListModels")},
}


def role_uri(role: str, name: str = "") -> str:
    """The SAN URI naming ``role`` (and, for a client, its ``name``)."""
    return f"{_URI_PREFIX}{role}/{name}" if name else f"{_URI_PREFIX}{role}"


@dataclasses.dataclass(frozen=True)
class Peer:
    """A caller as its certificate names it (``tls``: it came over TLS at all)."""

    address: str
    tls: bool
    uri: str = ""  # the spiffe://infermesh/ URI, empty without one
    hosts: frozenset[str] = frozenset()

    @property
    def role(self) -> str:
        """The role the URI names ("" when none: no identity)."""
        role = self.uri.removeprefix(_URI_PREFIX).split("/", 1)[0]
        return role if self.uri and role in ROLES else ""

    @property
    def identity(self) -> str:
        """The URI without ``spiffe://infermesh/`` ("client/batch-jobs"; "" when none)."""
        return self.uri.removeprefix(_URI_PREFIX) if self.role else ""

    def describe(self) -> str:
        return f"{self.uri or 'no mesh identity'} at {self.address}"


def peer_of(context: grpc.aio.ServicerContext[Any, Any]) -> Peer:
    """The caller of the call ``context`` serves, from its TLS auth context."""
    auth = context.auth_context()
    tls = b"ssl" in auth.get("transport_security_type", [])
    names = [n.decode(errors="replace") for n in auth.get("x509_subject_alternative_name", [])]
    uris = [n for n in names if n.startswith(_URI_PREFIX)]
    return Peer(
        address=context.peer(),
        tls=tls,
        uri=uris[0] if len(uris) == 1 else "",  # two mesh URIs: no single identity
        hosts=frozenset(_normal_host(n) for n in names if "://" not in n),
    )


async def _refuse(
    context: grpc.aio.ServicerContext[Any, Any],
    service: str,
    method: str,
    peer: Peer,
    reason: str,
    why: str,
) -> None:
    """Logs, counts and aborts the call (raises)."""
    name = method.rsplit("/", 1)[-1]
    metrics.GRPC_REFUSED.labels(service, name, reason).inc()
    message = f"{name} refused for {peer.describe()}: {why}"
    logger.warning("%s: %s", service, message)
    await context.abort(_CODES.get(reason, grpc.StatusCode.PERMISSION_DENIED), message)


async def refuse(
    context: grpc.aio.ServicerContext[Any, Any], service: str, method: str, reason: str, why: str
) -> None:
    """Refuses (aborts) the call with PERMISSION_DENIED for ``why``, logged and counted under
    ``reason`` as the checks here are (a check the servicer makes itself, e.g. ownership)."""
    await _refuse(context, service, method, peer_of(context), reason, why)


async def check_caller(
    context: grpc.aio.ServicerContext[Any, Any], service: str, method: str
) -> None:
    """Refuses (aborts) the call unless the caller's role may call ``method``."""
    peer = peer_of(context)
    if not peer.role:
        await _refuse(
            context,
            service,
            method,
            peer,
            "unauthenticated",
            f"the certificate names no {_URI_PREFIX}<role> URI",
        )
    allowed = ALLOWED.get(method, frozenset())
    if peer.role not in allowed:
        await _refuse(
            context,
            service,
            method,
            peer,
            "role",
            f"role {peer.role} may not call it (allowed: {', '.join(sorted(allowed)) or 'none'})",
        )


async def require_address_host(
    context: grpc.aio.ServicerContext[Any, Any], service: str, method: str, address: str
) -> None:
    """Refuses (aborts) a call over TLS whose peer's certificate does not name ``address``'s
    host as a DNS or IP SAN: a worker cannot register another host's address."""
    peer = peer_of(context)
    if not peer.tls:
        return  # plaintext: no identity, every caller trusted
    host = _normal_host(_host_of(address))
    if host not in peer.hosts:
        await _refuse(
            context,
            service,
            method,
            peer,
            "address",
            f"its certificate does not name the host of {address!r} "
            f"(names: {', '.join(sorted(peer.hosts)) or 'none'})",
        )


def _host_of(address: str) -> str:
    """The host of "host:port", "[v6]:port" or a bare host."""
    if address.startswith("["):
        return address[1:].split("]", 1)[0]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def _normal_host(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower().rstrip(".")


class Authorizer(grpc.aio.ServerInterceptor):
    """Checks every call's caller against ``ALLOWED`` before the servicer runs (health and
    reflection pass)."""

    def __init__(self, service: str) -> None:
        self._service = service

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler
        return _guarded(handler, lambda context: check_caller(context, self._service, method))


def _guarded(handler: Any, check: Callable[[Any], Any]) -> Any:
    """``handler`` whose behaviour first awaits ``check(context)``."""
    if handler.request_streaming and handler.response_streaming:
        kind, factory = "stream_stream", grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        kind, factory = "stream_unary", grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        kind, factory = "unary_stream", grpc.unary_stream_rpc_method_handler
    else:
        kind, factory = "unary_unary", grpc.unary_unary_rpc_method_handler
    behaviour = getattr(handler, kind)
    if inspect.isasyncgenfunction(behaviour):

        async def streamed(request: Any, context: Any) -> AsyncIterator[Any]:
            await check(context)
            async for response in behaviour(request, context):
                yield response

        guarded: Any = streamed
    else:

        async def called(request: Any, context: Any) -> Any:
            await check(context)
            return await behaviour(request, context)

        guarded = called
    return factory(
        guarded,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
