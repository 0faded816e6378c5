"""Fair queueing under overload: keys of weights 1, 2 and 4 at about 2x the fleet's
capacity; each key's share of the work served against its weight, the most requests any
worker held against its max_parallel, and the queue wait.

    .venv/bin/python bench/fair_queueing.py [--seconds 20] [--workers 4] [--slots 4]
        [--clients 11] [--max-tokens 24] [--no-queue]

On fresh processes: a Redis, a real router (``python -m router_svc`` with [fair_queue]
enabled) and one process hosting ``--workers`` simulated V100 workers of ``--slots`` slots
each (bench/router_policies.py's); this process is the gateway: per key, ``--clients``
closed-loop clients ask over one route stream (gateway.mesh.route_stream_client, as the gateway
does), call the chosen worker and report the request finished. 3 x 11 clients on 4 x 4 slots is
about 2x capacity; every key alone could fill the fleet, so each is always backlogged.

Printed per key: requests and completion tokens served in the measured window (after a
warm-up), its share against its weight's share (target: within 10 %), the p50 / p90 of the
wait for a decision (the time in the router's queue); then, per worker, the most requests it held
at once (running and waiting, the engine's own count at each admission, over the whole run)
against max_parallel. ``--no-queue``: the same with [fair_queue] off, the baseline (the router
routes every ask at once).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from bench.router_policies import registered, serve_workers, spawn, stop, wait_until
from devtools.redis_server import RedisServer
from gateway.mesh.route_stream_client import RouteStream
from infermesh.mesh_call import routes_of
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc
from infermesh.ports import free_port
from infermesh.probe import grpc_serving
from infermesh.tls import TlsSection
from tests.helpers.worker_client import WorkerClient
from worker_svc.config import (
    EngineSection,
    ModelSection,
    ParallelSection,
    RouterSection,
    WorkerConfig,
    WorkerServerSection,
)

MODEL = "sim-fair"
WEIGHTS = (1, 2, 4)
_WARMUP_S = 3.0
_PLAINTEXT = TlsSection(plaintext=True)


@dataclasses.dataclass
class KeyStats:
    weight: int
    requests: int = 0
    tokens: int = 0
    errors: int = 0
    waits: list[float] = dataclasses.field(default_factory=list)


def worker_configs(router_address: str, workers: int, slots: int) -> list[WorkerConfig]:
    return [
        WorkerConfig(
            server=WorkerServerSection(port=0, worker_id=f"v100-{i:02d}"),
            router=RouterSection(address=router_address),
            model=ModelSection(name=MODEL),
            parallel=ParallelSection(max_parallel=slots),
            engine=EngineSection(kind="sim", gpu="V100"),
            tls=_PLAINTEXT,
        )
        for i in range(workers)
    ]


async def client(
    stream: RouteStream,
    workers: WorkerClient,
    stats: KeyStats,
    tenant: str,
    max_tokens: int,
    measuring: asyncio.Event,
    stopping: asyncio.Event,
) -> None:
    """One closed-loop client of a key: ask, generate on the chosen worker, report the end."""
    request = common_pb2.GenerateRequest(
        model=MODEL,
        prompt="Tell me about fairness.",
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
        tenant=tenant,
        weight=stats.weight,
        tier=f"w{stats.weight}",
    )
    while not stopping.is_set():
        asked = time.monotonic()
        try:
            decision = await stream.ask(request, timeout_s=5.0, wait_s=60.0)
            waited = time.monotonic() - asked
            chosen = routes_of(decision)[0]
        except grpc.aio.AioRpcError:
            stats.errors += measuring.is_set()
            await asyncio.sleep(0.05)
            continue
        try:
            reply = await workers.complete(chosen.address, request, timeout_s=60)
        except grpc.aio.AioRpcError:
            stats.errors += measuring.is_set()
            stream.finished(router_pb2.RouteFinished(worker_id=chosen.worker_id))
            continue
        stream.finished(
            router_pb2.RouteFinished(
                worker_id=chosen.worker_id,
                served_by=chosen.worker_id,
                completed=True,
                usage=reply.usage,
            )
        )
        if measuring.is_set() and not stopping.is_set():
            stats.requests += 1
            stats.tokens += reply.usage.completion_tokens
            stats.waits.append(waited)


async def overload(
    router_address: str, seconds: float, clients: int, max_tokens: int
) -> list[KeyStats]:
    channel = grpc.aio.insecure_channel(router_address)
    stub = router_pb2_grpc.RouterStub(channel)
    stream = RouteStream(stub)
    workers = WorkerClient(_PLAINTEXT)
    stats = [KeyStats(w) for w in WEIGHTS]
    measuring, stopping = asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.create_task(
            client(stream, workers, s, f"key-w{s.weight}", max_tokens, measuring, stopping)
        )
        for s in stats
        for _ in range(clients)
    ]
    await asyncio.sleep(_WARMUP_S)
    measuring.set()
    await asyncio.sleep(seconds)
    stopping.set()
    await asyncio.gather(*tasks)
    await stream.close()
    await workers.close()
    await channel.close()
    return stats


def percentile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def report(
    stats: list[KeyStats], peaks: dict[str, int], slots: int, clients: int, workers: int
) -> None:
    total_tokens = sum(s.tokens for s in stats) or 1
    total_weight = sum(WEIGHTS)
    print(
        f"{len(stats)} keys x {clients} closed-loop clients on {workers} workers x {slots} slots "
        f"({len(stats) * clients / (workers * slots):.2f}x capacity)"
    )
    print(
        f"{'weight':>6} {'requests':>9} {'tokens':>8} {'share':>7} {'target':>7} "
        f"{'off by':>7} {'wait p50':>9} {'wait p90':>9} {'errors':>6}"
    )
    worst = 0.0
    for s in stats:
        share = s.tokens / total_tokens
        target = s.weight / total_weight
        off = share / target - 1
        worst = max(worst, abs(off))
        print(
            f"{s.weight:>6} {s.requests:>9} {s.tokens:>8} {share:>7.1%} {target:>7.1%} "
            f"{off:>+7.1%} {percentile(s.waits, 0.5) * 1000:>7.0f}ms "
            f"{percentile(s.waits, 0.9) * 1000:>7.0f}ms {s.errors:>6}"
        )
    print(f"worst share off its weight's: {worst:.1%} (target: within 10%)")
    print(
        "most requests each worker held at once (running + waiting): "
        + ", ".join(f"{worker} {peak}" for worker, peak in sorted(peaks.items()))
        + f" (max_parallel {slots})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--clients", type=int, default=11, help="per key")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--queue", action=argparse.BooleanOptionalAction, default=True)
    # the child: serve the workers, then write each one's peak to the file --peaks names
    parser.add_argument("--fleet", help=argparse.SUPPRESS)
    parser.add_argument("--peaks", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fleet:
        engines = asyncio.run(serve_workers(worker_configs(args.fleet, args.workers, args.slots)))
        peaks = {worker: engine.peak_live for worker, engine in engines.items()}
        Path(args.peaks).write_text(json.dumps(peaks))
        return
    env = {
        "OTEL_SDK_DISABLED": "true",
        "INFERMESH_LOG_LEVEL": "ERROR",
        "INFERMESH_ROUTER_TLS_PLAINTEXT": "true",
    }
    with tempfile.TemporaryDirectory() as workdir, RedisServer(workdir=workdir) as redis_server:
        peaks_file = str(Path(workdir) / "peaks.json")
        port = free_port()
        address = f"127.0.0.1:{port}"
        router = spawn(
            ["-m", "router_svc"],
            {
                **env,
                "INFERMESH_ROUTER_SERVER_PORT": str(port),
                "INFERMESH_ROUTER_REDIS_URL": redis_server.url,
                "INFERMESH_ROUTER_FAIR_QUEUE_ENABLED": str(args.queue).lower(),
                "INFERMESH_ROUTER_FAIR_QUEUE_MAX_WAIT_S": "60",
            },
        )
        fleet = None
        try:
            wait_until(lambda: grpc_serving(address), "the router")
            fleet = spawn(
                [
                    __file__,
                    "--fleet",
                    address,
                    "--workers",
                    str(args.workers),
                    "--slots",
                    str(args.slots),
                    "--peaks",
                    peaks_file,
                ],
                env,
            )
            wait_until(lambda: registered(address) == args.workers, "the fleet")
            stats = asyncio.run(overload(address, args.seconds, args.clients, args.max_tokens))
        finally:
            for proc in (fleet, router):
                if proc is not None:
                    stop(proc)
        peaks = json.loads(Path(peaks_file).read_text())
    report(stats, peaks, args.slots, args.clients, args.workers)


if __name__ == "__main__":
    main()
