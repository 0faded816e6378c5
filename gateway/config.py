"""The gateway's one config object: ``[server]``, ``[redis]`` and ``[router]``.

Built once by ``python -m gateway`` with
``load_config(GatewayConfig, path, "infermesh_gateway")``; every key can be
overridden as ``INFERMESH_GATEWAY_<SECTION>_<KEY>``.
"""
from __future__ import annotations

import dataclasses

from infermesh.config import section


@section
class ServerSection:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")


@section
class RedisSection:
    url: str = "redis://127.0.0.1:6379/0"
    # Positive authentications are cached this long; a revoked key keeps
    # working in this process for at most this time.
    key_cache_ttl_ms: int = 1000
    # Bounds every Redis call so an unreachable Redis answers 503 quickly.
    timeout_s: float = 1.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.key_cache_ttl_ms < 0:
            raise ValueError(f"key_cache_ttl_ms must be >= 0, got {self.key_cache_ttl_ms}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@section
class RouterSection:
    address: str = "127.0.0.1:50051"
    # Deadline of a whole generation, first token to last.
    request_timeout_s: float = 600.0
    # How long a request waits for a connection to the router before a 503.
    connect_timeout_s: float = 2.0
    # Deadline of the small calls (ListModels).
    control_timeout_s: float = 5.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "connect_timeout_s", "control_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    server: ServerSection = dataclasses.field(default_factory=ServerSection)
    redis: RedisSection = dataclasses.field(default_factory=RedisSection)
    router: RouterSection = dataclasses.field(default_factory=RouterSection)
