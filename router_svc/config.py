"""Router configuration: ``[server]``, ``[redis]``, ``[registry]``, ``[routing]``, ``[metrics]``
and ``[tls]`` (``infermesh.tls``) sections."""

from __future__ import annotations

import dataclasses
from typing import Literal

from infermesh.config import MetricsSection, load_config, section
from infermesh.redis_client import check_redis_url
from infermesh.tls import TlsSection

Policy = Literal["balanced", "least_load", "round_robin", "random"]


@section
class ServerSection:
    host: str = "127.0.0.1"
    port: int = 50051


@section
class RedisSection:
    """Where the shared worker registry lives; every router of a mesh points at the same one.
    ``url``: one server (``redis://``, ``rediss://``, ``unix://``), a Redis Cluster
    (``redis+cluster://host:port,...``) or Sentinel (``redis+sentinel://host:port,.../service``),
    see ``infermesh.redis_client``."""

    url: str = "redis://127.0.0.1:6379/0"
    RENAMED = {"timeout_ms": "timeout_s (seconds)"}

    timeout_s: float = 0.5  # per Redis call; past it the registry counts as unreachable
    # Namespace of the registry's keys: the routers of one mesh share it; separate meshes on
    # one Redis use different ones. It is the registry's hash tag, so no braces.
    key_prefix: str = "infermesh:router:"

    def __post_init__(self) -> None:
        check_redis_url(self.url)
        if not self.key_prefix or "{" in self.key_prefix or "}" in self.key_prefix:
            raise ValueError(
                f"key_prefix: must be non-empty without braces, got {self.key_prefix!r}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be positive, got {self.timeout_s}")


@section
class RegistrySection:
    RENAMED = {
        "heartbeat_interval_ms": "heartbeat_interval_s (seconds)",
        "ttl_ms": "ttl_s (seconds)",
        "refresh_ms": "refresh_s (seconds)",
    }
    heartbeat_interval_s: float = 1.0
    ttl_s: float = 3.0  # a worker silent this long is dropped
    # How often this router re-reads the registry from Redis into its local view, which is
    # what every routing decision reads.
    refresh_s: float = 0.25

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0 or self.ttl_s <= self.heartbeat_interval_s:
            raise ValueError("need 0 < heartbeat_interval_s < ttl_s")
        if not 0 < self.refresh_s < self.ttl_s:
            raise ValueError("need 0 < refresh_s < ttl_s")

    @property
    def ttl_ms(self) -> int:
        """The TTL as Redis's PEXPIRE takes it."""
        return round(self.ttl_s * 1000)


@section
class RoutingSection:
    """The worker choice. ``balanced`` ranks by a weighted cost (lower is better):
    ``load_weight`` x (busy + 1) / max_parallel + ``kv_weight`` x KV cache use
    + ``hardware_weight`` x (1 - decode speed / fastest candidate's)
    - ``affinity_weight`` if the worker is the prompt prefix's home."""

    RENAMED = {
        "eject_cooldown_ms": "eject_cooldown_s (seconds)",
        "stall_timeout_ms": "stall_timeout_s (seconds)",
    }

    policy: Policy = "balanced"
    # Before the first token, a failed worker call is retried once elsewhere.
    retry_before_first_token: bool = True
    load_weight: float = 1.0
    kv_weight: float = 0.5
    hardware_weight: float = 0.5
    affinity_weight: float = 0.5
    prefix_bytes: int = 256  # leading prompt bytes whose hash is the prefix affinity key
    # Bounded-load consistent hashing: a prefix's home takes at most this factor of its fair share.
    affinity_load_factor: float = 1.25
    failures_to_eject: int = 3  # consecutive failed calls that eject a worker
    eject_cooldown_s: float = 10.0  # how long an ejected worker gets no traffic
    # Relayed streams: the longest silence of a worker's stream after its first chunk;
    # past it the worker has failed (stuck) and the stream ends with an error. (A frozen
    # worker is noticed sooner by the channel's keepalive pings, see infermesh.channels.)
    stall_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        weights = (self.load_weight, self.kv_weight, self.hardware_weight, self.affinity_weight)
        if any(w < 0 for w in weights):
            raise ValueError("the *_weight keys must be >= 0")
        if self.prefix_bytes < 1 or self.affinity_load_factor < 1:
            raise ValueError("need prefix_bytes >= 1 and affinity_load_factor >= 1")
        if self.failures_to_eject < 1 or self.eject_cooldown_s < 0:
            raise ValueError("need failures_to_eject >= 1 and eject_cooldown_s >= 0")
        if self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s: must be positive, got {self.stall_timeout_s}")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    server: ServerSection = dataclasses.field(default_factory=ServerSection)
    redis: RedisSection = dataclasses.field(default_factory=RedisSection)
    registry: RegistrySection = dataclasses.field(default_factory=RegistrySection)
    routing: RoutingSection = dataclasses.field(default_factory=RoutingSection)
    metrics: MetricsSection = dataclasses.field(default_factory=MetricsSection)
    tls: TlsSection = dataclasses.field(default_factory=TlsSection)


def load(path: str | None) -> RouterConfig:
    return load_config(RouterConfig, path, "infermesh_router")
