"""Router configuration: ``[server]``, ``[registry]`` and ``[routing]`` sections."""
from __future__ import annotations

import dataclasses
from typing import Literal

from infermesh.config import load_config, section

Policy = Literal["least_load", "round_robin"]


@section
class ServerSection:
    host: str = "127.0.0.1"
    port: int = 50051


@section
class RegistrySection:
    heartbeat_interval_ms: int = 1000
    ttl_ms: int = 3000  # a worker silent this long is dropped

    def __post_init__(self) -> None:
        if self.heartbeat_interval_ms <= 0 or self.ttl_ms <= self.heartbeat_interval_ms:
            raise ValueError("need 0 < heartbeat_interval_ms < ttl_ms")


@section
class RoutingSection:
    policy: str = "least_load"
    # Before the first token, a failed worker call is retried once elsewhere.
    retry_before_first_token: bool = True

    def __post_init__(self) -> None:
        if self.policy not in ("least_load", "round_robin"):
            raise ValueError(f"policy: expected least_load or round_robin, got {self.policy!r}")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    server: ServerSection = dataclasses.field(default_factory=ServerSection)
    registry: RegistrySection = dataclasses.field(default_factory=RegistrySection)
    routing: RoutingSection = dataclasses.field(default_factory=RoutingSection)


def load(path: str | None) -> RouterConfig:
    return load_config(RouterConfig, path, "infermesh_router")
