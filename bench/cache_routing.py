"""Cache-aware routing on the simulated mixed fleet: TTFT, throughput and prefix-cache hits per
policy, against an oracle that knows every worker's cache, on two workloads, in one run.

    .venv/bin/python bench/cache_routing.py [--workload shared-prefix agent] [--seed 1]

The fleet and router are bench/router_policies.py's: a real router per policy and 16 simulated
workers (4 x V100, A100, H100, MI100) as real gRPC servers, each with the prefix cache its GPU's
memory holds after the weights (35k-127k tokens). Requests go to the router's Generate as an
internal caller's would; `cache_aware` is `balanced` with the prompt's `prefix_hashes` (what the
gateway computes), every other policy gets none, so `balanced` is the byte-window guess of before.

- shared-prefix: tenants each with a long system prompt (~6k tokens) and short unique questions,
  Poisson arrivals; the prefixes together are more than twice the largest worker's cache.
- agent: sessions that each resend their growing history (a shared system prompt, then their own
  turns: tool output in, the model's answer back), closed loop, with the session's affinity key.

The oracle: this process follows every worker's Worker.CacheEvents stream (what the router's index
follows) and, as each request is sent, finds the longest prefix any worker holds; its hit ratio is
those tokens over all prompt tokens: the best any policy could have done with the caches as they
were. "On holder" (agent): the turns whose worker held the longest cached prefix of that turn.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from bench import router_policies as policies
from bench.router_policies import FLEET, MODEL, fleet_router, words, worker_config
from devtools.redis_server import RedisServer
from infermesh import prefix_hash
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from infermesh.sim_tokens import prompt_text, sim_token_ids
from worker_svc.sim_engine.engine import SimEngine

POLICIES = {  # name: (router policy, send prefix_hashes)
    "random": ("random", False),
    "round_robin": ("round_robin", False),
    "least_load": ("least_load", False),
    "balanced": ("balanced", False),
    "cache_aware": ("balanced", True),
}
_BYTES_PER_TOKEN = 4
_TIMEOUT_S = 300.0


# ------------------------------------------------------------------------------ the oracle


class Oracle:
    """Every worker's cached block hashes, from its CacheEvents stream."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def follow(self, router_address: str) -> None:
        async with grpc.aio.insecure_channel(router_address) as channel:
            listed = await router_pb2_grpc.RouterStub(channel).ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=5
            )
        for status in listed.workers:
            self.held[status.worker.worker_id] = set()
            self._tasks.append(
                asyncio.create_task(self._follow(status.worker.worker_id, status.worker.address))
            )

    async def _follow(self, worker_id: str, address: str) -> None:
        held = self.held[worker_id]
        async with grpc.aio.insecure_channel(address) as channel:
            stream = worker_pb2_grpc.WorkerStub(channel).CacheEvents(
                worker_pb2.CacheEventsRequest()
            )
            async for batch in stream:
                if batch.snapshot or batch.cleared:
                    held.clear()
                held.update(batch.stored)
                held.difference_update(batch.removed)

    def cached_blocks(self, worker_id: str, hashes: list[int]) -> int:
        held, n = self.held.get(worker_id, set()), 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n

    def cached_now(self, hashes: list[int]) -> dict[str, int]:
        """Each worker's cached blocks of the prompt `hashes` names, as they are now."""
        return {w: self.cached_blocks(w, hashes) for w in self.held}

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


# ------------------------------------------------------------------------------ one request


@dataclasses.dataclass
class Outcome(policies.Outcome):
    oracle_tokens: int = 0  # the longest prefix any worker held when it was sent
    on_holder: bool = False  # its worker held that longest prefix


async def send(
    stub: router_pb2_grpc.RouterStub,
    oracle: Oracle,
    messages: list[dict[str, str]],
    max_tokens: int,
    *,
    with_hashes: bool,
    session: str = "",
    start: float,
) -> Outcome:
    hashes = prefix_hash.chain(sim_token_ids(prompt_text(messages, None)))
    request = common_pb2.GenerateRequest(
        model=MODEL,
        messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
        affinity_key=session,
        prefix_hashes=hashes if with_hashes else (),
    )
    outcome = Outcome()
    cached = oracle.cached_now(hashes)  # before the chosen worker caches this prompt
    best = max(cached.values(), default=0)
    outcome.oracle_tokens = best * prefix_hash.BLOCK_TOKENS
    sent = time.monotonic()
    await policies.read_stream(stub.Generate(request, timeout=_TIMEOUT_S), outcome, sent, start)
    outcome.on_holder = best > 0 and cached.get(outcome.worker, 0) == best
    return outcome


# ------------------------------------------------------------------------------ workloads

Workload = Callable[[router_pb2_grpc.RouterStub, Oracle, bool], Awaitable[list[Outcome]]]


def shared_prefix(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    prefixes = [words(rng, args.prefix_tokens * _BYTES_PER_TOKEN) for _ in range(args.tenants)]
    plan, at = [], 0.0
    for _ in range(args.requests):
        at += rng.expovariate(args.rate)
        question = words(rng, rng.randrange(100, 800))
        plan.append((at, rng.randrange(len(prefixes)), question, rng.randrange(16, 65)))

    async def run(stub: router_pb2_grpc.RouterStub, oracle: Oracle, hashes: bool) -> list[Outcome]:
        start = time.monotonic()

        async def one(at: float, tenant: int, question: str, max_tokens: int) -> Outcome:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            messages = [
                {"role": "system", "content": prefixes[tenant]},
                {"role": "user", "content": question},
            ]
            return await send(stub, oracle, messages, max_tokens, with_hashes=hashes, start=start)

        return list(await asyncio.gather(*(one(*p) for p in plan)))

    return run


def agent(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    system = words(rng, args.system_tokens * _BYTES_PER_TOKEN)
    sessions = [
        [words(rng, rng.randrange(400, 4000)) for _ in range(args.turns)]
        for _ in range(args.sessions)
    ]
    thinks = [[rng.expovariate(1 / args.think_s) for _ in range(args.turns)] for _ in sessions]

    async def run(stub: router_pb2_grpc.RouterStub, oracle: Oracle, hashes: bool) -> list[Outcome]:
        start = time.monotonic()

        async def session(i: int) -> list[Outcome]:
            history, outcomes = [{"role": "system", "content": system}], []
            for turn, tool_output in enumerate(sessions[i]):
                await asyncio.sleep(thinks[i][turn])
                history.append({"role": "user", "content": tool_output})
                outcome = await send(
                    stub, oracle, history, 48, with_hashes=hashes, session=f"s{i}", start=start
                )
                outcomes.append(outcome)
                if outcome.error:
                    break
                history.append({"role": "assistant", "content": outcome.text})
            return outcomes

        per_session = await asyncio.gather(*(session(i) for i in range(len(sessions))))
        return [o for outcomes in per_session for o in outcomes]

    return run


WORKLOADS = {"shared-prefix": shared_prefix, "agent": agent}


# ------------------------------------------------------------------------------ runs


async def run_policy(address: str, workload: Workload, hashes: bool) -> list[Outcome]:
    oracle = Oracle()
    await oracle.follow(address)
    await asyncio.sleep(0.5)  # the snapshots (empty caches) in
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            return await workload(router_pb2_grpc.RouterStub(channel), oracle, hashes)
    finally:
        await oracle.close()


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    done = [o for o in outcomes if o.done_s is not None and o.ttft_s is not None]
    ttfts = sorted(o.ttft_s for o in done if o.ttft_s is not None)
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else [float("nan")] * 9
    prompt = max(sum(o.prompt_tokens for o in done), 1)
    later_turns = [o for o in done if o.oracle_tokens > 0]
    makespan = max((o.done_s for o in done if o.done_s is not None), default=float("nan"))
    return {
        "p50": statistics.median(ttfts) if ttfts else float("nan"),
        "p90": q[8],
        "tokens_per_s": sum(o.tokens for o in done) / makespan,
        "hit": sum(o.cached_tokens for o in done) / prompt,
        "oracle": sum(o.oracle_tokens for o in done) / prompt,
        "on_holder": sum(o.on_holder for o in later_turns) / max(len(later_turns), 1),
        "done": len(done),
        "errors": len(outcomes) - len(done),
        "error_codes": ", ".join(sorted({o.error for o in outcomes if o.error})),
    }


def capacity_per_s(prompt_tokens: int, completion_tokens: int) -> float:
    """Requests/s the fleet sustains by the roofline when every prompt is prefilled in full."""
    total = 0.0
    for i in range(len(FLEET)):
        engine = SimEngine.from_config(worker_config(i, "unused:0"))
        batch = engine.max_parallel
        step = engine.roofline.decode_step_s(
            batch, batch * (prompt_tokens + completion_tokens // 2)
        )
        total += 1 / (engine.roofline.prefill_s(prompt_tokens) + completion_tokens * step / batch)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=list(POLICIES))
    parser.add_argument("--seed", type=int, default=1)
    shared = parser.add_argument_group("shared-prefix")
    shared.add_argument("--tenants", type=int, default=48)
    shared.add_argument("--prefix-tokens", type=int, default=6000)
    shared.add_argument("--requests", type=int, default=600)
    shared.add_argument(
        "--load", type=float, default=1.5, help="arrivals / the fleet's capacity without cache hits"
    )
    agents = parser.add_argument_group("agent")
    agents.add_argument("--sessions", type=int, default=48)
    agents.add_argument("--turns", type=int, default=8)
    agents.add_argument("--system-tokens", type=int, default=3000)
    agents.add_argument("--think-s", type=float, default=1.0)
    args = parser.parse_args()
    args.rate = args.load * capacity_per_s(args.prefix_tokens + 110, 40)
    largest = max(
        SimEngine.from_config(worker_config(i, "unused:0")).roofline.kv_capacity_tokens
        for i in range(len(FLEET))
    )
    print(
        f"fleet: {len(FLEET)} simulated workers, largest cache {largest} tokens; shared-prefix: "
        f"{args.tenants} tenants x {args.prefix_tokens} tokens "
        f"({args.tenants * args.prefix_tokens / largest:.1f}x the largest cache), "
        f"{args.requests} requests at {args.rate:.1f}/s ({args.load}x capacity without hits); "
        f"agent: {args.sessions} sessions x {args.turns} turns",
        flush=True,
    )
    results: dict[tuple[str, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as workdir, RedisServer(workdir=workdir) as redis_server:
        for name in args.workload:
            workload = WORKLOADS[name](args)
            for label in args.policies:
                policy, hashes = POLICIES[label]
                with fleet_router(policy, redis_server.url) as address:
                    outcomes = asyncio.run(run_policy(address, workload, hashes))
                r = results[name, label] = summarize(outcomes)
                print(
                    f"{name:<13} {label:<12} TTFT p50 {r['p50'] * 1000:7.0f} ms  "
                    f"p90 {r['p90'] * 1000:7.0f} ms  {r['tokens_per_s']:6.0f} tok/s  "
                    f"hits {r['hit']:4.0%} (oracle {r['oracle']:4.0%}, "
                    f"{r['hit'] / max(r['oracle'], 1e-9):4.0%} of it)  "
                    f"on holder {r['on_holder']:4.0%}  done {r['done']:.0f}  "
                    f"errors {r['errors']:.0f} {r['error_codes']}",
                    flush=True,
                )
    if ("shared-prefix", "balanced") in results and ("shared-prefix", "cache_aware") in results:
        old, new = results["shared-prefix", "balanced"], results["shared-prefix", "cache_aware"]
        print(
            f"shared-prefix cache_aware vs balanced: p90 TTFT x{new['p90'] / old['p90']:.2f} "
            f"(target <= 0.2); hits {new['hit'] / max(new['oracle'], 1e-9):.0%} of the oracle's "
            "(target >= 90 %)"
        )
    if ("agent", "cache_aware") in results:
        print(
            f"agent cache_aware: {results['agent', 'cache_aware']['on_holder']:.0%} of turns on "
            "the worker holding their history (target >= 90 %)"
        )


if __name__ == "__main__":
    main()
