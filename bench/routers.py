"""Routers active-active (issue #37): requests/s of one mesh with one router against the same
mesh with two, in one run.

    .venv/bin/python bench/routers.py [--duration 10] [--rounds 2] [--concurrency 64]

Two meshes of processes on one Redis (devtools.mesh), each with two gateways and three
simulated workers in zero-latency mode (tokens cost nothing, so what is measured is the mesh);
one mesh has one router, which both gateways dial, the other two routers on one registry, each
gateway dialing both with its own leading (``[router] address`` a gRPC list), so each router
decides for one gateway. Tracing off, warnings only, an API key without limits (its admission and
settlement scripts run). Nothing is pinned: the processes share the machine's cores.

For each mesh in turn, ``--rounds`` times (alternating, so that the machine's other load falls
on both alike), closed-loop clients send non-streamed chat completions of 16 tokens for
``--duration`` seconds after a 2 s warm-up, half of them through each gateway. Prints per round
and mesh requests/s, p50/p99 latency, failed requests, and CPU milliseconds per request of the
gateways, of the routers and of the workers (psutil, before and after); then the two routers'
requests/s against the one router's, over all rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import psutil

from bench.mesh_load import MeshLoad, Outcome, simulated_mesh
from devtools.mesh import Mesh
from devtools.redis_server import RedisServer
from gateway.accounts.keys import create_key_at
from infermesh.ports import free_port
from worker_svc.config import DEFAULT_MODEL_PATH

_WARMUP_S = 2.0
_MAX_TOKENS = 16
_WORKERS = 3
_ENV = {"INFERMESH_WORKER_ENGINE_ZERO_LATENCY": "true"}


@dataclasses.dataclass(frozen=True)
class Round:
    routers: int
    outcomes: list[Outcome]
    elapsed_s: float
    cpu_s: dict[str, float]  # gateways, routers, workers: CPU seconds over the round

    @property
    def served(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.ok]

    @property
    def per_s(self) -> float:
        return len(self.served) / self.elapsed_s

    def latency_ms(self, q: float) -> float:
        ordered = sorted(o.latency_s for o in self.served)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0


@contextlib.contextmanager
def _mesh(redis_url: str, workdir: Path, routers: int) -> Iterator[tuple[Mesh, list[str]]]:
    """The mesh with ``routers`` routers, started, and its two gateways' base URLs."""
    spec = dataclasses.replace(
        simulated_mesh(redis_url, workdir, _ENV),
        worker_ports=tuple(free_port() for _ in range(_WORKERS)),
        extra_router_ports=tuple(free_port() for _ in range(routers - 1)),
    )
    with Mesh(spec) as mesh:
        port = free_port()
        second = {"INFERMESH_GATEWAY_ROUTER_ADDRESS": spec.router_target(first=routers - 1)}
        mesh.add_gateway("gateway2", port, second)
        yield mesh, [spec.base_url, f"http://127.0.0.1:{port}/v1"]


def _cpu_s(mesh: Mesh) -> dict[str, float]:
    names = {
        "gateways": ["gateway", "gateway2"],
        "routers": mesh.spec.router_names,
        "workers": [f"worker{i}" for i in range(_WORKERS)],
    }

    def of(name: str) -> float:
        process = psutil.Process(mesh.pid(name))
        return sum(sum(p.cpu_times()[:2]) for p in [process, *process.children(recursive=True)])

    return {role: sum(of(n) for n in members) for role, members in names.items()}


async def _round(
    mesh: Mesh, bases: list[str], key: str, concurrency: int, duration_s: float
) -> Round:
    model = Path(DEFAULT_MODEL_PATH).name
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        loads = [MeshLoad(session, base, key, model, max_tokens=_MAX_TOKENS) for base in bases]
        shares = [concurrency // 2, concurrency - concurrency // 2]

        async def run(until: float, outcomes: list[Outcome]) -> None:
            await asyncio.gather(
                *(
                    load.run(share, until, lambda: "plain", outcomes)
                    for load, share in zip(loads, shares, strict=True)
                )
            )

        await run(time.monotonic() + _WARMUP_S, [])
        before, started = _cpu_s(mesh), time.monotonic()
        outcomes: list[Outcome] = []
        await run(started + duration_s, outcomes)
        elapsed = time.monotonic() - started
        after = _cpu_s(mesh)
    return Round(
        len(mesh.spec.router_ports),
        outcomes,
        elapsed,
        {role: after[role] - before[role] for role in before},
    )


def _print(i: int, r: Round) -> None:
    per_request = {role: s * 1000 / max(len(r.served), 1) for role, s in r.cpu_s.items()}
    print(
        f"round {i} routers={r.routers}: {r.per_s:8.1f} req/s  "
        f"p50 {r.latency_ms(0.5):6.1f} ms  p99 {r.latency_ms(0.99):6.1f} ms  "
        f"failed {len(r.outcomes) - len(r.served)}  CPU ms/req: "
        + "  ".join(f"{role} {ms:.2f}" for role, ms in per_request.items())
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    print(
        f"python {sys.version.split()[0]}, grpcio {grpc.__version__}, {psutil.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}; c={args.concurrency}"
    )
    with tempfile.TemporaryDirectory() as tmp, RedisServer(workdir=Path(tmp)) as redis:
        key = asyncio.run(create_key_at(redis.url, "routers"))
        (Path(tmp) / "one").mkdir()
        (Path(tmp) / "two").mkdir()
        with (
            _mesh(redis.url, Path(tmp) / "one", routers=1) as one,
            _mesh(redis.url, Path(tmp) / "two", routers=2) as two,
        ):
            rounds: list[Round] = []
            for i in range(args.rounds):
                for mesh, bases in (one, two):
                    r = asyncio.run(_round(mesh, bases, key, args.concurrency, args.duration))
                    _print(i + 1, r)
                    rounds.append(r)
    totals = {
        n: sum(len(r.served) for r in rounds if r.routers == n)
        / sum(r.elapsed_s for r in rounds if r.routers == n)
        for n in (1, 2)
    }
    print(
        f"over {args.rounds} rounds: 1 router {totals[1]:.1f} req/s, 2 routers "
        f"{totals[2]:.1f} req/s ({totals[2] / totals[1]:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
