"""``bench --sim``: a simulated mixed fleet on this machine: a Redis, a router, a gateway and
one simulated worker (worker_svc/sim_engine/) per GPU kind, sized by
worker_svc/hardware/sizing.py; each of the role its kind is given (aggregated: all "both";
disaggregated: "prefill" and "decode" kinds, KV blocks crossing a link of ``link_gbps``)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from devtools.mesh import Mesh, MeshSpec
from devtools.redis_server import RedisServer
from gateway.accounts.keys import create_key_at
from infermesh.ports import free_port
from worker_svc.config import DEFAULT_MODEL_PATH
from worker_svc.hardware.sizing import model_size_of

SIM_MODEL = "sim-8b"  # the [engine] default sizes: 8B dense, 128 KiB of KV cache per token


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    api_key: str
    admin_url: str
    admin_token: str
    model: str


@contextlib.contextmanager
def simulated_fleet(
    kinds: list[str],
    model: str = "",
    roles: Mapping[str, str] = MappingProxyType({}),
    link_gbps: float = 0.0,
) -> Iterator[Endpoint]:
    """The running fleet's endpoint; stops everything on exit. ``model``: the simulated model
    ([engine] model: a bundled name, a checkpoint directory or a config.json); empty: the 8B
    default. ``roles``: a kind's [worker] role (default both); ``link_gbps``: the link between
    the workers, for the router and the simulated transfers alike."""
    name = model_size_of(model).name if model else SIM_MODEL
    token = secrets.token_urlsafe(24)
    with (
        tempfile.TemporaryDirectory(prefix="infermesh-bench-") as workdir,
        RedisServer(workdir=workdir) as redis_server,
    ):
        spec = MeshSpec(
            redis_url=redis_server.url,
            model_path=DEFAULT_MODEL_PATH,
            gateway_port=free_port(),
            router_port=free_port(),
            worker_ports=tuple(free_port() for _ in kinds),
            env={
                "OTEL_SDK_DISABLED": "true",
                "INFERMESH_GATEWAY_ADMIN_TOKEN": token,
                "INFERMESH_WORKER_ENGINE_KIND": "sim",
                "INFERMESH_WORKER_MODEL_NAME": name,
                "INFERMESH_WORKER_ENGINE_MODEL": model,
                "INFERMESH_WORKER_ENGINE_LINK_GBPS": str(link_gbps),
            },
            router_env=({"INFERMESH_ROUTER_ROUTING_LINK_GBPS": str(link_gbps)},),
            worker_env=tuple(
                {
                    "INFERMESH_WORKER_ENGINE_GPU": kind,
                    "INFERMESH_WORKER_SERVER_WORKER_ID": f"sim-{kind.lower()}",
                    "INFERMESH_WORKER_WORKER_ROLE": roles.get(kind, "both"),
                }
                for kind in kinds
            ),
            log_dir=Path(workdir),
        )
        with Mesh(spec):
            key = asyncio.run(create_key_at(redis_server.url, "infermesh bench --sim"))
            yield Endpoint(spec.base_url, key, f"http://127.0.0.1:{spec.gateway_port}", token, name)
