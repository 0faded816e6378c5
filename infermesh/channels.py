"""One gRPC channel per worker address, reused across requests: the router and the gateway
both dial workers through a pool."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc

from infermesh.pb import worker_pb2_grpc
from infermesh.tls import TlsSection, open_channel

# The largest gRPC message a hop of the mesh sends or takes (gRPC's default is 4 MiB). A
# request's route ask carries its prompt's text, token ids and their block hashes, several
# bytes for each byte of the request body: the gateway's body limit is bounded so that its
# largest ask fits (gateway/config.py), and a bigger one (a long stored conversation) fails
# alone with RESOURCE_EXHAUSTED (``infermesh.bidi.check_size``).
GRPC_MESSAGE_LIMIT_BYTES = 64 * 1024 * 1024
_MESSAGE_SIZE_OPTIONS = [
    ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT_BYTES),
    ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT_BYTES),
]

# Reconnect soon after a peer comes back, rather than grpc's default of backing off for
# up to two minutes: a channel whose peer was gone for any time tries again at least
# every second, so a restarted router or worker is used again within about a second.
# Every long-lived channel (gateway -> router, worker -> router, -> workers) uses these.
#
# Keepalive: while calls are open, a ping every second; a peer that does not answer within
# two (a frozen process: SIGSTOP, a host that vanished without closing the connection)
# fails every call on the connection with UNAVAILABLE, so a request waiting for its first
# token goes to the fallback worker. Servers accept these pings (SERVER_OPTIONS).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.http2.max_pings_without_data", 0),
    *_MESSAGE_SIZE_OPTIONS,
]
SERVER_OPTIONS = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    *_MESSAGE_SIZE_OPTIONS,
]


# A target naming several routers (a list, or a DNS name that may resolve to several): calls
# go round robin to those whose health service answers SERVING. A router that cannot reach
# its registry in Redis answers NOT_SERVING (and ends its route streams), so that workers'
# heartbeats and gateways' route asks go to a router that can back them; pick_first would
# stay on a router that answers, whatever it answers. One router: pick_first, its answers
# (UNAVAILABLE while Redis is down) reaching the caller as they are.
_HEALTHY_ROUND_ROBIN = json.dumps(
    {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}
)


def several_routers(address: str) -> bool:
    """Whether the routers' gRPC target ``address`` may name several (a list, a DNS name)."""
    scheme, _, rest = address.partition(":")
    return scheme == "dns" or (scheme in ("ipv4", "ipv6") and "," in rest)


def router_channel_options(address: str) -> list[tuple[str, Any]]:
    """The options of a channel to ``address``, the routers' gRPC target."""
    if not several_routers(address):
        return list(CHANNEL_OPTIONS)
    return [*CHANNEL_OPTIONS, ("grpc.service_config", _HEALTHY_ROUND_ROBIN)]


class WorkerChannels:
    """Channels to workers by address, opened on first use (with ``tls``, this service's
    certificate) and closed together."""

    def __init__(self, tls: TlsSection) -> None:
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_channel(address, self._tls, CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels.values()))
        self._channels.clear()
        self._stubs.clear()
