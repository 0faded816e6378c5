"""Routing decision time with 1,000 registered workers: what the router spends per request
choosing a worker, without I/O (target: p99 <= 100 us).

    .venv/bin/python bench/router_decision.py [--workers 1000] [--decisions 20000]

Times exactly the hot path of RouterServicer.Generate before the worker call: RouteRequest.of
(the prompt prefix hash) and Chooser.choose over the router's local Fleet view. The fleet is a
mix of the GPU profiles with varied load; each decision starts a stream on the chosen worker
and an older one ends, so loads and in-flight counts move as in service. Redis is not on this
path: the registry is copied into the Fleet in the background (router_svc/registry.py).
Prints p50/p99/max per policy.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

from infermesh.pb import common_pb2
from router_svc.config import Policy, RoutingSection
from router_svc.fleet import Fleet, WorkerEntry
from router_svc.routing import Chooser, RouteRequest

_KINDS = [  # (device name, precision, max_parallel, decode tokens/s)
    ("Tesla V100-SXM2-32GB", common_pb2.PRECISION_FP16, 4, 41.0),
    ("NVIDIA A100-SXM4-80GB", common_pb2.PRECISION_BF16, 8, 45.0),
    ("NVIDIA H100 80GB HBM3", common_pb2.PRECISION_FP8, 8, 152.0),
    ("AMD Instinct MI100", common_pb2.PRECISION_BF16, 4, 56.0),
]
_MODELS = ["deepseek-v3", "deepseek-r1"]
_PROMPT_PREFIXES = 64


def build_fleet(workers: int, rng: random.Random) -> Fleet:
    fleet = Fleet(ttl_s=3)
    for i in range(workers):
        name, precision, max_parallel, speed = _KINDS[i % len(_KINDS)]
        info = common_pb2.WorkerInfo(
            worker_id=f"worker-{i:04d}",
            address=f"10.0.{i // 250}.{i % 250}:50061",
            models=[_MODELS[i % 5 == 0]],  # a fifth serve the second model
            capabilities=common_pb2.Capabilities(
                device="cuda",
                device_name=name,
                precision=precision,
                max_parallel=max_parallel,
                decode_tokens_per_second=speed,
            ),
        )
        running = rng.randrange(max_parallel + 1)
        load = common_pb2.Load(
            running=running,
            waiting=rng.randrange(3) if running == max_parallel else 0,
            kv_cache_usage=rng.random(),
        )
        fleet.upsert(info, load, registered_at=0, expires_in_s=3)
    return fleet


def requests(rng: random.Random, count: int) -> list[common_pb2.GenerateRequest]:
    systems = [
        " ".join(rng.choice("abcdefghij") * rng.randrange(1, 8) for _ in range(200))
        for _ in range(_PROMPT_PREFIXES)
    ]
    return [
        common_pb2.GenerateRequest(
            model=_MODELS[0],
            precision=rng.choice(
                [common_pb2.PRECISION_UNSPECIFIED] * 4 + [common_pb2.PRECISION_FP8]
            ),
            messages=[
                common_pb2.ChatMessage(role="system", content=rng.choice(systems)),
                common_pb2.ChatMessage(role="user", content=f"question {rng.random()}"),
            ],
        )
        for _ in range(count)
    ]


def time_policy(policy: Policy, workers: int, decisions: int) -> list[float]:
    rng = random.Random(1)
    fleet = build_fleet(workers, rng)
    chooser = Chooser(RoutingSection(policy=policy))
    prefix_bytes = RoutingSection().prefix_bytes
    batch = requests(rng, decisions)
    open_streams: collections.deque[WorkerEntry] = collections.deque()
    concurrent = workers * 3  # streams in flight across the fleet
    times = []
    for request in batch:
        start = time.perf_counter_ns()
        decision = chooser.choose(fleet, RouteRequest.of(request, prefix_bytes))
        times.append((time.perf_counter_ns() - start) / 1000)
        fleet.started(decision.workers[0])
        open_streams.append(decision.workers[0])
        if len(open_streams) > concurrent:
            fleet.ended(open_streams.popleft())
    return times[decisions // 10 :]  # after warm-up


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--decisions", type=int, default=20000)
    args = parser.parse_args()
    print(f"{args.workers} workers, {args.decisions} decisions per policy (first 10% not counted)")
    print(f"{'policy':<12} {'p50 us':>8} {'p99 us':>8} {'max us':>8}")
    for policy in ("round_robin", "least_load", "balanced"):
        times = sorted(time_policy(policy, args.workers, args.decisions))
        p50, p99 = statistics.quantiles(times, n=100)[49], statistics.quantiles(times, n=100)[98]
        print(f"{policy:<12} {p50:>8.1f} {p99:>8.1f} {times[-1]:>8.1f}")


if __name__ == "__main__":
    main()
