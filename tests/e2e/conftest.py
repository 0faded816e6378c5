"""A real mesh for end-to-end tests: Redis, router, worker and gateway as
processes on free loopback ports, every gRPC hop over mutual TLS (certificates written into
the log directory), exporting traces to a test OTLP receiver."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devtools.chat_model import SERVED_PATH
from devtools.mesh import Mesh, MeshSpec
from devtools.redis_server import RedisServer
from infermesh.ports import free_port
from tests.helpers.e2e import new_key
from tests.helpers.otlp import OtlpReceiver, serving_receiver
from worker_svc.config import DEFAULT_MODEL_PATH


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[tuple[OtlpReceiver, int]]:
    with serving_receiver() as served:
        yield served


@pytest.fixture(scope="session")
def e2e_redis(tmp_path_factory) -> Iterator[RedisServer]:
    with RedisServer(workdir=tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory) -> Iterator[RedisServer]:
    """A module's own Redis, for a fleet that must see no other's workers: routers sharing a Redis
    see each other's workers through the registry (the vLLM modules both name one torch-worker)."""
    with RedisServer(workdir=tmp_path_factory.mktemp("module-redis")) as server:
        yield server


def _start_mesh(
    redis_url: str,
    otlp_port: int,
    log_dir,
    workers: int,
    worker_dtype: str = "auto",
    model_path: str = DEFAULT_MODEL_PATH,
) -> Mesh:
    spec = MeshSpec(
        redis_url=redis_url,
        model_path=model_path,
        gateway_port=free_port(),
        router_port=free_port(),
        worker_ports=tuple(free_port() for _ in range(workers)),
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "INFERMESH_GATEWAY_METRICS_PORT": str(free_port()),
            "INFERMESH_ROUTER_METRICS_PORT": str(free_port()),
            "INFERMESH_WORKER_METRICS_PORT": str(free_port()),
            "INFERMESH_WORKER_MODEL_DTYPE": worker_dtype,
        },
        log_dir=log_dir,
        certs=log_dir / "certs",
    )
    mesh = Mesh(spec)
    try:
        return mesh.start()
    except Exception as e:
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(log_dir.glob("*.log"))
        )
        raise RuntimeError(f"mesh did not start: {e}\n{logs}") from e


@pytest.fixture(scope="session")
def mesh(e2e_redis, otlp_receiver, tmp_path_factory, worker_dtype) -> Iterator[Mesh]:
    """One router, one worker on the tiny model in worker_dtype, one gateway."""
    mesh = _start_mesh(
        e2e_redis.url,
        otlp_receiver[1],
        tmp_path_factory.mktemp("mesh"),
        workers=1,
        worker_dtype=worker_dtype,
    )
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def chat_mesh(otlp_receiver, tmp_path_factory, worker_dtype) -> Iterator[tuple[Mesh, str]]:
    """One router, one worker on the trained default chat model (`make run`'s), one gateway, and
    a key. Its own Redis: routers sharing one see each other's workers through the registry."""
    with RedisServer(workdir=tmp_path_factory.mktemp("chat-redis")) as redis_server:
        mesh = _start_mesh(
            redis_server.url,
            otlp_receiver[1],
            tmp_path_factory.mktemp("chat-mesh"),
            workers=1,
            worker_dtype=worker_dtype,
            model_path=SERVED_PATH,
        )
        try:
            yield mesh, new_key(redis_server.url)
        finally:
            mesh.stop()


@pytest.fixture(scope="session")
def workerless_mesh(otlp_receiver, tmp_path_factory) -> Iterator[tuple[Mesh, str]]:
    """A router and a gateway with no worker registered, and a key for it. Its own
    Redis: routers sharing one see each other's workers through the registry."""
    with RedisServer(workdir=tmp_path_factory.mktemp("bare-redis")) as redis_server:
        mesh = _start_mesh(
            redis_server.url, otlp_receiver[1], tmp_path_factory.mktemp("bare"), workers=0
        )
        try:
            yield mesh, new_key(redis_server.url)
        finally:
            mesh.stop()


@pytest.fixture(scope="session")
def api_key(e2e_redis) -> str:
    return new_key(e2e_redis.url)
