"""Routing decision time with 1,000 registered workers: what the router spends per request
choosing a worker, without I/O (target: p99 <= 100 us).

    .venv/bin/python bench/router_decision.py [--workers 1000] [--decisions 20000]
        [--blocks 3000] [--phases] [--index-memory] [--index python]

Times exactly the hot path of RouterServicer.Generate before the worker call: RouteRequest.of
(the prompt prefix hash) and Chooser.choose over the router's local Fleet view. The fleet is a
mix of the GPU profiles with varied load; each decision starts a stream on the chosen worker
and an older one ends, so loads and in-flight counts move as in service. Redis is not on this
path: the registry is copied into the Fleet in the background (router_svc/registry.py).
Prints p50/p99/max per policy.

Then the same for ``balanced`` with requests carrying ``prefix_hashes`` (1k-80k-token prompts)
over a prefix index as the workers' cache events would fill it: 64 system prompts of 2k-8k tokens,
each cached on a few dozen workers, and per worker agent sessions (a system prompt and a history,
1k-80k tokens in all) up to ``--blocks`` cached blocks each, on the session's worker (one in ten
on another, where it was passed on once). Four requests in five continue a session (its history
and a new turn, with its affinity key), one in five starts a new one; each decision gets a prompt
of its own, made just before it, so no lookup finds the index warm from an earlier one. The
hashes are the gateway's work (computed before the clock starts); the lookup of the longest cached
prefix per candidate is timed with the choice, and then alone (``PrefixIndex.cached_blocks`` over
the candidates of the first model, on fresh prompts again), with the compiled lookup the router
runs and with the pure-Python reference (``--index python`` times the decisions with the reference
too). ``--phases`` then times the same with phase planning (router_svc/phases.py): a quarter of
the workers of role "prefill", the rest "decode", all sending KV blocks of DeepSeek-V3's size
(prefilling 256 tokens a step beside decodes) over 100 Gb/s links in four zones (25 Gb/s between
zones): every decision weighs prefilling on the chosen worker against the prefill worker that
would deliver the prompt's blocks first, from the same lookup of the index (over both roles'
workers); it prints how many decisions planned a prefill worker, and by which term.
``--index-memory`` measures the index's bytes per cached (worker, block) pair with tracemalloc on
a smaller fleet.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import random
import statistics
import time
import tracemalloc
from array import array
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from infermesh.pb import common_pb2
from infermesh.prefix_hash import BLOCK_TOKENS, chain
from router_svc.config import Policy, RoutingSection
from router_svc.fleet import Fleet, WorkerEntry
from router_svc.prefix_index import PrefixIndex
from router_svc.routing import Chooser, RouteRequest
from worker_svc.hardware.sizing import model_size_of

_KINDS = [  # (device name, precision, max_parallel, decode tokens/s, prefill tokens/s)
    ("Tesla V100-SXM2-32GB", common_pb2.PRECISION_FP16, 4, 41.0, 2500.0),
    ("NVIDIA A100-SXM4-80GB", common_pb2.PRECISION_BF16, 8, 45.0, 8000.0),
    ("NVIDIA H100 80GB HBM3", common_pb2.PRECISION_FP8, 8, 152.0, 20000.0),
    ("AMD Instinct MI100", common_pb2.PRECISION_BF16, 4, 56.0, 3000.0),
]
_MODELS = ["deepseek-v3", "deepseek-r1"]
_PROMPT_PREFIXES = 64


_V3_KV_BYTES_PER_TOKEN = model_size_of("DeepSeek-V3").kv_bytes_per_token("bf16")
_ZONES = 4
_PHASE_LINKS = RoutingSection(
    link_gbps=100,
    zone_link_gbps={f"zone-{a}/zone-{b}": 25 for a in range(_ZONES) for b in range(a + 1, _ZONES)},
)


def build_fleet(workers: int, rng: random.Random, phases: bool = False) -> Fleet:
    fleet = Fleet(ttl_s=3)
    for i in range(workers):
        name, precision, max_parallel, speed, prefill = _KINDS[i % len(_KINDS)]
        # by the kinds' period, so that every kind has workers of both roles
        role = ("prefill" if i // len(_KINDS) % 4 == 0 else "decode") if phases else ""
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
                prefill_tokens_per_second=prefill,
                role=role,
                zone=f"zone-{i % _ZONES}" if phases else "",
                kv_transfer_bytes_per_token=_V3_KV_BYTES_PER_TOKEN if phases else 0,
                prefill_chunk_tokens=256 if phases else 0,
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


def tokens(rng: random.Random, count: int) -> array[int]:
    return array("I", rng.randbytes(4 * count))


def build_index(
    fleet: Fleet,
    rng: random.Random,
    blocks_per_worker: int,
    sessions_per_worker: int = 4,
    compiled: bool = True,
) -> tuple[PrefixIndex, list[tuple[str, array[int]]]]:
    """An index as the workers' cache events fill it, and the sessions cached in it (affinity
    key, prompt token ids): each on its session's worker, one in ten on another (passed on when
    its worker was full)."""
    config = RoutingSection()
    index = PrefixIndex(config.index_max_blocks, config.index_max_probes, compiled=compiled)
    homes = Chooser(config)  # no index: the sessions' own workers
    systems = [tokens(rng, rng.randrange(2000, 8000)) for _ in range(_PROMPT_PREFIXES)]
    entries = fleet.entries()
    held: dict[int, list[int]] = {entry.slot: [] for entry in entries}
    sessions: list[tuple[str, array[int]]] = []
    for i in range(len(entries) * sessions_per_worker):
        key = f"session-{i}"
        ask = common_pb2.GenerateRequest(model=_MODELS[0], affinity_key=key)
        if rng.random() < 0.9:
            slot = homes.choose(fleet, RouteRequest.of(ask, config.prefix_bytes)).workers[0].slot
        else:
            slot = rng.choice(entries).slot
        room = blocks_per_worker - len(held[slot])
        if room <= 0:
            continue
        system = rng.choice(systems)
        total = min(rng.randrange(1000, 80000), room * BLOCK_TOKENS)
        history = (system + tokens(rng, max(total - len(system), 0)))[:total]
        held[slot] += chain(history)
        sessions.append((key, history))
    for slot, blocks in held.items():
        index.apply(slot, blocks, ())
    return index, sessions


def prefix_requests(
    rng: random.Random, count: int, sessions: list[tuple[str, array[int]]]
) -> Iterator[common_pb2.GenerateRequest]:
    """A distinct prompt for every decision, each made just before its decision (off the clock):
    a prompt looked up once, as in service, where a few hundred reused ones would find their
    probes of the index in the CPU's caches."""
    for _ in range(count):
        if rng.random() < 0.8:
            key, history = rng.choice(sessions)
            ids = history + tokens(rng, rng.randrange(50, 2000))
        else:
            key, ids = "", rng.choice(sessions)[1][:4000] + tokens(rng, rng.randrange(1000, 76000))
        yield common_pb2.GenerateRequest(
            model=_MODELS[0], affinity_key=key, prefix_hashes=chain(ids)
        )


class Timings(NamedTuple):
    wall_us: list[float]
    cpu_us: list[float]  # this thread's CPU time: without the waits of a shared machine
    cached_tokens: list[int]  # of the chosen worker, as the index predicted
    plans: list[str]  # each decision's phase plan and its deciding term

    def after_warm_up(self) -> Timings:
        """Without the first tenth (the warm-up: first calls, caches filling)."""
        warm = len(self.wall_us) // 10
        return Timings(
            self.wall_us[warm:], self.cpu_us[warm:], self.cached_tokens[warm:], self.plans[warm:]
        )


def time_policy(
    policy: Policy,
    workers: int,
    decisions: int,
    blocks_per_worker: int = 0,
    phases: bool = False,
    compiled: bool = True,
) -> Timings:
    rng = random.Random(1)
    fleet = build_fleet(workers, rng, phases)
    prefix_bytes = RoutingSection().prefix_bytes
    batch: Iterable[common_pb2.GenerateRequest]
    if blocks_per_worker:
        index, sessions = build_index(fleet, rng, blocks_per_worker, compiled=compiled)
        routing = _PHASE_LINKS if phases else RoutingSection()
        chooser = Chooser(dataclasses.replace(routing, policy=policy), index)
        batch = prefix_requests(rng, decisions, sessions)
    else:
        chooser = Chooser(RoutingSection(policy=policy))
        batch = requests(rng, decisions)
    open_streams: collections.deque[WorkerEntry] = collections.deque()
    concurrent = workers * 3  # streams in flight across the fleet
    timings = Timings([], [], [], [])
    for request in batch:
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        decision = chooser.choose(fleet, RouteRequest.of(request, prefix_bytes))
        timings.cpu_us.append((time.thread_time_ns() - start_cpu) / 1000)
        timings.wall_us.append((time.perf_counter_ns() - start) / 1000)
        timings.cached_tokens.append(decision.cached_tokens)
        timings.plans.append(f"{decision.phases.plan}/{decision.phases.term}")
        fleet.started(decision.workers[0])
        fleet.queued_prefill(decision.workers[0], decision.prefill_s)  # as the router does
        if decision.pull is not None and decision.pull.compute:
            fleet.queued_prefill(decision.pull.holder, decision.pull.prefill_s)
        open_streams.append(decision.workers[0])
        if len(open_streams) > concurrent:
            fleet.ended(open_streams.popleft())
    return timings.after_warm_up()


def time_lookups(workers: int, lookups: int, blocks_per_worker: int, compiled: bool) -> Timings:
    """``PrefixIndex.cached_blocks`` alone, over the first model's workers, a fresh prompt each."""
    rng = random.Random(1)
    fleet = build_fleet(workers, rng)
    index, sessions = build_index(fleet, rng, blocks_per_worker, compiled=compiled)
    members = fleet.group(_MODELS[0], common_pb2.PRECISION_UNSPECIFIED).members
    timings = Timings([], [], [], [])
    for request in prefix_requests(rng, lookups, sessions):
        hashes = request.prefix_hashes
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        index.cached_blocks(hashes, members, fleet.slot_count)
        timings.cpu_us.append((time.thread_time_ns() - start_cpu) / 1000)
        timings.wall_us.append((time.perf_counter_ns() - start) / 1000)
    return timings.after_warm_up()


def index_bytes_per_block(workers: int, blocks_per_worker: int) -> tuple[float, float]:
    """Bytes per (worker, block) pair: blocks held by one worker each, then the same blocks held
    by every worker (the cost of each further holder)."""
    rng = random.Random(3)
    hashes = chain(tokens(rng, workers * blocks_per_worker * BLOCK_TOKENS))
    results = []
    for shared in (False, True):
        gc.collect()
        tracemalloc.start()
        index = PrefixIndex(max_blocks=len(hashes))
        for slot in range(workers):
            held = (
                hashes[:blocks_per_worker]
                if shared
                else hashes[slot * blocks_per_worker :][:blocks_per_worker]
            )
            # the hashes arrive in messages: the index holds its own int objects
            index.apply(slot, [int(str(h)) for h in held], ())
        size, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        pairs = workers * blocks_per_worker
        results.append(size / pairs)
        del index
    return results[0], results[1]


def report(name: str, timings: Timings) -> None:
    wall, cpu = sorted(timings.wall_us), sorted(timings.cpu_us)
    p50, p99 = statistics.quantiles(wall, n=100)[49], statistics.quantiles(wall, n=100)[98]
    cpu50, cpu99 = statistics.quantiles(cpu, n=100)[49], statistics.quantiles(cpu, n=100)[98]
    print(f"{name:<12} {p50:>8.1f} {p99:>8.1f} {wall[-1]:>8.1f} {cpu50:>8.1f} {cpu99:>8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--decisions", type=int, default=20000)
    parser.add_argument("--blocks", type=int, default=3000, help="cached blocks per worker")
    parser.add_argument("--phases", action="store_true", help="then with prefill/decode roles")
    parser.add_argument("--index-memory", action="store_true")
    parser.add_argument(
        "--index",
        choices=("compiled", "python"),
        default="compiled",
        help="the prefix lookup the decisions use ([routing] index)",
    )
    args = parser.parse_args()
    if args.index_memory:
        one, further = index_bytes_per_block(100, 2000)
        print(
            f"index: {one:.0f} bytes per block held by one worker, {further:.0f} per further holder"
        )
        return
    print(f"{args.workers} workers, {args.decisions} decisions per policy (first 10% not counted)")
    print(f"{'policy':<12} {'p50 us':>8} {'p99 us':>8} {'max us':>8} {'cpu p50':>8} {'cpu p99':>8}")
    for policy in ("round_robin", "least_load", "balanced"):
        report(policy, time_policy(policy, args.workers, args.decisions))
    started = time.perf_counter()
    compiled = args.index == "compiled"
    timings = time_policy("balanced", args.workers, args.decisions, args.blocks, compiled=compiled)
    print(
        f"with prefix_hashes over an index of {args.blocks} blocks per worker, {args.index} "
        f"lookup (built and run in {time.perf_counter() - started:.0f} s; the chosen workers had "
        f"{statistics.mean(timings.cached_tokens):.0f} prompt tokens cached on average):"
    )
    report("balanced", timings)
    print("the lookup alone (PrefixIndex.cached_blocks), compiled and the Python reference:")
    for lookup in ("compiled", "python"):
        report(
            lookup, time_lookups(args.workers, args.decisions, args.blocks, lookup == "compiled")
        )
    if args.phases:
        timings = time_policy(
            "balanced", args.workers, args.decisions, args.blocks, phases=True, compiled=compiled
        )
        planned = "prefill on P, decode on D"
        print(f"the same with phases ({planned}: 1 worker in 4 of role prefill, 4 zones):")
        report("balanced", timings)
        plans = collections.Counter(timings.plans)
        split = sum(count for plan, count in plans.items() if plan.startswith("split/"))
        print(
            f"planned a prefill worker: {split} of {len(timings.plans)} decisions; by plan/term: "
            + ", ".join(f"{plan} {count}" for plan, count in plans.most_common())
        )


if __name__ == "__main__":
    main()
