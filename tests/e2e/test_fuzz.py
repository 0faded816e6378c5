"""A short fuzz of the whole mesh (bench/fuzz.py runs the full one): schemathesis against
the gateway's /openapi.json, raw malformed requests, slow and idle clients, on a gateway,
router and simulated worker as processes with a real Redis. No 5xx, every 4xx in its API's
error shape, no process restarted, RSS back within 10 %, no credential in any log line,
span or body."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import psutil
import pytest

from devtools.mesh import Mesh, MeshSpec
from infermesh.ports import free_port
from tests.helpers import fuzz
from tests.helpers.e2e import new_key
from worker_svc.config import DEFAULT_MODEL_PATH

ADMIN_TOKEN = "fuzz-admin-token-0123456789abcdef"
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def fuzz_mesh(e2e_redis, otlp_receiver, tmp_path_factory) -> Iterator[Mesh]:
    spec = MeshSpec(
        redis_url=e2e_redis.url,
        model_path=DEFAULT_MODEL_PATH,
        gateway_port=free_port(),
        router_port=free_port(),
        worker_ports=(free_port(),),
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_receiver[1]}",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            **fuzz.mesh_env(ADMIN_TOKEN, TIMEOUT_S),
        },
        log_dir=tmp_path_factory.mktemp("fuzz"),
    )
    with Mesh(spec) as mesh:
        yield mesh


def test_fuzzing_the_mesh_finds_nothing(fuzz_mesh, e2e_redis, otlp_receiver):
    spec = fuzz_mesh.spec
    api_key = new_key(e2e_redis.url)
    target = fuzz.Target(
        base=f"http://127.0.0.1:{spec.gateway_port}",
        port=spec.gateway_port,
        api_key=api_key,
        admin_token=ADMIN_TOKEN,
        model=fuzz.served_model(spec.router_address),
    )
    pids = {name: fuzz_mesh.pid(name) for name in ("gateway", "router", "worker0")}
    gateway = psutil.Process(pids["gateway"])
    report = fuzz.FuzzReport()
    asyncio.run(fuzz.raw_cases(target, report))  # warms the gateway up as well
    rss_before = gateway.memory_info().rss

    fuzz.schema_cases(target, max_examples=2, report=report)
    asyncio.run(fuzz.slow_clients(target, clients=3, idle=20, timeout_s=TIMEOUT_S, report=report))

    assert report.failures == [] and report.cases > 100
    fuzz_mesh.check_alive()
    assert {name: fuzz_mesh.pid(name) for name in pids} == pids
    assert gateway.memory_info().rss <= rss_before * 1.1
    logs = [fuzz_mesh.log(name) for name in ("gateway", "router", "worker0")]
    spans = [str(span) for _, span in otlp_receiver[0].spans()]
    assert fuzz.leaked([api_key, ADMIN_TOKEN], logs + spans, report.bodies) == []
