"""Fuzzing the whole mesh (issue #13): schemathesis against the gateway's /openapi.json,
raw malformed requests, slow and idle clients.

    .venv/bin/python bench/fuzz.py [--examples 100] [--rounds 3] [--slow 20] [--idle 500]

Starts Redis, the router, one simulated worker (INFERMESH_WORKER_ENGINE_KIND=sim,
zero latency) and the gateway as processes (devtools.mesh), the gateway with 2 s header,
body and keep-alive timeouts. Runs, per round: every operation of the document with
--examples positive and --examples negative cases (positive ones half the time on the
served model, so the worker generates), the raw malformed bodies and headers of
tests.helpers.fuzz; then --slow clients sending headers and --slow a body a byte every 0.2 s,
and --idle idle keep-alive connections. Prints cases run, the statuses, failures found
(5xx, 4xx not in the API's error shape, unanswered requests, slow clients kept), whether
any process restarted, the gateway's RSS after the first round and at the end, and
whether the API key or admin token appears in any log line or response body.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import psutil

from devtools.mesh import Mesh, one_worker_mesh
from tests.helpers import fuzz
from worker_svc.config import DEFAULT_MODEL_PATH

ADMIN_TOKEN = "bench-fuzz-admin-token-0123456789"
TIMEOUT_S = 2.0
SERVICES = ("gateway", "router", "worker0")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--examples",
        type=int,
        default=100,
        help="schemathesis cases per operation and mode, per round",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slow", type=int, default=20, help="slow clients of each kind")
    parser.add_argument("--idle", type=int, default=500, help="idle keep-alive connections")
    args = parser.parse_args()
    # every log line is read for keys: INFO, not the bench default of warnings only
    env = {"INFERMESH_LOG_LEVEL": "INFO", **fuzz.mesh_env(ADMIN_TOKEN, TIMEOUT_S)}
    with one_worker_mesh(DEFAULT_MODEL_PATH, "fuzz", env) as (mesh, api_key):
        return _fuzz(args, mesh, api_key)


def _fuzz(args: argparse.Namespace, mesh: Mesh, api_key: str) -> int:
    spec = mesh.spec
    target = fuzz.Target(
        base=f"http://127.0.0.1:{spec.gateway_port}",
        port=spec.gateway_port,
        api_key=api_key,
        admin_token=ADMIN_TOKEN,
        model=fuzz.served_model(spec.router_address),
    )
    pids = {name: mesh.pid(name) for name in SERVICES}
    gateway = psutil.Process(pids["gateway"])
    report = fuzz.FuzzReport()
    rss: list[int] = []
    started = time.monotonic()
    for round_ in range(args.rounds):
        fuzz.schema_cases(target, args.examples, report)
        asyncio.run(fuzz.raw_cases(target, report))
        rss.append(gateway.memory_info().rss)
        print(
            f"round {round_ + 1}: {report.cases} cases, {len(report.failures)} failures, "
            f"gateway RSS {rss[-1] / 2**20:.1f} MiB ({time.monotonic() - started:.0f} s)",
            flush=True,
        )
    asyncio.run(fuzz.slow_clients(target, args.slow, args.idle, TIMEOUT_S, report))
    time.sleep(TIMEOUT_S)  # the slow clients' connections are gone
    mesh.check_alive()
    restarted = [name for name in SERVICES if mesh.pid(name) != pids[name]]
    end_rss = gateway.memory_info().rss
    logs = [mesh.log(name) for name in SERVICES]
    leaks = fuzz.leaked([api_key, ADMIN_TOKEN], logs, report.bodies)
    growth = end_rss / rss[0] - 1
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; "
        f"{time.monotonic() - started:.0f} s"
    )
    print(f"cases run: {report.cases}; statuses: {dict(sorted(report.statuses.items()))}")
    print(f"failures found: {len(report.failures)}")
    for failure in report.failures[:50]:
        print(f"  {failure}")
    print(f"processes restarted: {restarted or 'none'}")
    print(
        f"gateway RSS: {rss[0] / 2**20:.1f} MiB after round 1, {end_rss / 2**20:.1f} MiB at "
        f"the end ({growth:+.1%})"
    )
    print(
        f"credentials in {len(logs)} logs and {len(report.bodies)} bodies: {leaks[:10] or 'none'}"
    )
    return 0 if not report.failures and not restarted and not leaks and growth <= 0.1 else 1


if __name__ == "__main__":
    sys.exit(main())
