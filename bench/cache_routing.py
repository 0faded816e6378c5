"""Cache-aware routing: TTFT, throughput and prefix-cache hits per policy, against an oracle that
knows every worker's cache, on two workloads, in one run; on the simulated mixed fleet or on 2-3
real torch workers serving the tiny model.

    .venv/bin/python bench/cache_routing.py [--workload shared-prefix agent production] [--seed 1]
    .venv/bin/python bench/cache_routing.py --fleet torch [--workers 3] [--cache-tokens 8192]

Per policy, fresh processes on an emptied Redis: a real router and
- ``--fleet sim`` (the default): bench/router_policies.py's 16 simulated workers (4 x V100, A100,
  H100, MI100) as real gRPC servers, each with the prefix cache its GPU's memory holds after the
  weights (35k-127k tokens);
- ``--fleet torch``: ``--workers`` ``python -m worker_svc`` processes on models/tiny-deepseek-v3,
  started as the end-to-end tests start them (devtools.mesh, whose gateway idles here), each
  computing on one torch thread with a prefix cache of ``--cache-tokens``, and warmed up by a
  request of the workloads' size. A first such fleet calibrates: the gateway's tokenizer is
  learnt from it, a worker's prefill and decode speeds are timed alone, and the fleet's capacity
  is a burst of shared-prefix-sized requests with unique prompts (no cache hits).

Requests travel the gateway's path (routed on the router's RouteStream, served over
Worker.Serve by the gateway's mesh client): the prompt rendered and tokenized as the gateway
does it (infermesh/prompt_tokens.py: the simulated tokens, or the tokenizer the torch
workers serve, fetched from one of them), sent with its ids and the tokenizer's digest;
`cache_aware` is `balanced` with the prompt's `prefix_hashes`, every other policy gets none, so
`balanced` is the byte-window guess of before.

- shared-prefix: tenants each with a long system prompt and short unique questions, Poisson
  arrivals at ``--load`` x the fleet's capacity without cache hits (or ``--rate``); the prefixes
  together are more than twice a worker's cache.
- agent: sessions that each resend their growing history (a shared system prompt, an opening
  context of ``--history-tokens`` (none by default), then their own turns: tool output in, the
  model's answer back), closed loop, with the session's affinity key.
- production: the shape of a production conversation trace, where prefixes are reused little:
  long prompts (log-normal lengths, long-tailed, clipped to ``--long-prompt-tokens``) that all
  open with one short common block (``--common-tokens``), a few (``--follow-ups``) resending an
  earlier prompt with a new user turn; bursty arrivals (gamma gaps of shape ``--burst-shape``)
  at ``--long-load`` x the fleet's capacity without hits. On the sim fleet the prompts stop at
  32k tokens: its V100 and MI100 workers hold 34,586 tokens of KV cache and serve 32,768 at most,
  and the router knows no worker's context limit, so a longer prompt sent there would be refused.

Sizes are in tokens of the fleet's tokenizer (the made-up words run 4 characters a simulated
token, about 1.5 a real one); each fleet has its own defaults (DEFAULTS), sized for the sim fleet
and for the tiny model on 2 CPU cores.

The oracle is one per workload, the same for every policy: for each request, the whole blocks of
its prompt that a request before it in the workload shares (that request's prompt, or its prompt
and answer, which a worker may cache too), the longest such prefix, over all prompt tokens.
"Before" is the workload's schedule (shared-prefix: the arrival times; agent: turn by turn, each
turn's sessions in the order of their first arrival), not the order a run happened to send them
in. It is the hit ratio of a cache that kept everything and a placement that always found it: a
bound that no policy's placements move. (An oracle read from the workers' caches as each run left
them depends on where that run's policy put the prefixes, so it rose with the policy it judged,
and a policy that routes by those same caches came out near 100 % of it by construction.)
"On history's worker" (agent): the turns after a session's first, placed on the worker that served
its previous turn, which holds its history.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # this process forks the services

import redis

from bench import router_policies as policies
from bench.router_policies import FLEET, MODEL, fleet_router, words, worker_config
from devtools.mesh import Mesh, MeshSpec
from devtools.redis_server import RedisServer
from gateway.config import RouterSection
from gateway.mesh.client import MeshClient
from infermesh import prefix_hash, sim_tokens
from infermesh.pb import common_pb2
from infermesh.ports import free_port
from infermesh.prompt_tokens import SIM_RENDERER, PromptTokens, Renderer
from infermesh.tls import TlsSection
from tests.helpers.worker_client import worker_client
from worker_svc.config import DEFAULT_MODEL_PATH, ModelSection
from worker_svc.sim_engine.engine import SimEngine

POLICIES = {  # name: (router policy, send prefix_hashes)
    "random": ("random", False),
    "round_robin": ("round_robin", False),
    "least_load": ("least_load", False),
    "balanced": ("balanced", False),
    "cache_aware": ("balanced", True),
}
DEFAULTS: dict[str, dict[str, Any]] = {  # per fleet; token ranges are [low, high]
    "sim": {
        "tenants": 48,
        "prefix_tokens": 6000,
        "question_tokens": [25, 200],
        "max_tokens": [16, 64],
        "requests": 600,
        "load": 1.5,
        "sessions": 48,
        "turns": 8,
        "system_tokens": 3000,
        "tool_output_tokens": [100, 1000],
        "answer_tokens": 48,
        "think_s": 1.0,
        "history_tokens": [0, 0],
        "common_tokens": 512,
        "long_prompt_tokens": [1000, 32000],
        "long_median_tokens": 4000,
        "long_sigma": 1.1,
        "follow_ups": 0.05,
        "follow_up_tokens": [50, 1000],
        "burst_shape": 0.25,
        "long_load": 2.0,
    },
    # the tiny model on 2 shared cores: each of the 11 fleet starts takes 15 s or more, and a
    # policy's shared-prefix arrivals last 100 / (1.2 x the capacity measured, 1.6-6 requests/s) s
    "torch": {
        "tenants": 12,
        "prefix_tokens": 1500,
        "question_tokens": [25, 100],
        "max_tokens": [8, 16],
        "requests": 100,
        "load": 1.2,
        "sessions": 10,
        "turns": 5,
        "system_tokens": 1000,
        "tool_output_tokens": [100, 400],
        "answer_tokens": 16,
        "think_s": 0.5,
        "history_tokens": [0, 0],
        "common_tokens": 64,
        "long_prompt_tokens": [200, 3000],
        "long_median_tokens": 600,
        "long_sigma": 0.9,
        "follow_ups": 0.05,
        "follow_up_tokens": [20, 200],
        "burst_shape": 0.25,
        "long_load": 1.0,
    },
}
TIMEOUT_S = 300.0
# A torch worker's longest prompt + answer (the agent's last turns reach ~3k tokens); its cache
# must hold one whole context
_TORCH_MAX_MODEL_LEN = 4096


# ------------------------------------------------------------------------------ one request


@dataclasses.dataclass
class Outcome(policies.Outcome):
    # its place in the workload's schedule, the oracle's "before": (turn, scheduled arrival s)
    order: tuple[int, float] = (0, 0.0)
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_hashes: list[int] = dataclasses.field(default_factory=list)  # its prompt's blocks
    on_history: bool | None = None  # an agent turn after the first: on its previous turn's worker


@dataclasses.dataclass(frozen=True)
class Client:
    """Sends a run's requests through its router as the gateway sends them: each prompt rendered
    and tokenized with the fleet's tokenizer, its ids and the tokenizer's digest, and
    (cache_aware) its prefix hashes."""

    mesh: MeshClient
    model: str
    renderer: Renderer
    with_hashes: bool

    async def send(
        self,
        messages: list[dict[str, str]],
        max_tokens: int,
        *,
        order: tuple[int, float],
        session: str = "",
        start: float,
    ) -> Outcome:
        request = common_pb2.GenerateRequest(
            model=self.model,
            messages=[
                common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages
            ],
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
            affinity_key=session,
        )
        ids = self.renderer.token_ids(request)
        hashes = prefix_hash.chain(ids)
        request.prompt_token_ids[:] = ids
        request.tokenizer = self.renderer.digest
        if self.with_hashes:
            request.prefix_hashes[:] = hashes
        # the worker counts the same ids (the usage repeats it); a failed request keeps this
        outcome = Outcome(prompt_tokens=len(ids), order=order, prompt_ids=ids, prompt_hashes=hashes)
        sent = time.monotonic()
        await policies.read_stream(self.mesh.call(request, stream=True), outcome, sent, start)
        return outcome


# ------------------------------------------------------------------------------ the oracle


def oracle_tokens(outcomes: list[Outcome]) -> int:
    """The prompt tokens of ``outcomes`` that a request earlier in the workload's order shares (its
    prompt, or its prompt and answer), as whole blocks of the longest such prefix: what a cache
    that kept everything would have hit. Reads only the requests, their answers and their order,
    never where a policy placed them or what a worker cached."""
    seen: set[int] = set()
    shared = 0
    for outcome in sorted(outcomes, key=lambda o: o.order):
        # a block's name chains every block before it: a name seen is that whole prefix seen
        hashes = outcome.prompt_hashes
        blocks = next((n for n, h in enumerate(hashes) if h not in seen), len(hashes))
        shared += blocks * prefix_hash.BLOCK_TOKENS
        # a worker may cache the answer's blocks too (the torch engine does): the next turn of
        # an agent resends them
        seen.update(prefix_hash.chain(outcome.prompt_ids + outcome.token_ids))
    return shared


# ------------------------------------------------------------------------------ workloads

Workload = Callable[[Client], Awaitable[list[Outcome]]]


class Text:
    """Made-up words by their length in the fleet's tokens (``chars_per_token`` of them)."""

    def __init__(self, rng: random.Random, chars_per_token: float) -> None:
        self.rng, self.chars_per_token = rng, chars_per_token

    def of(self, tokens: int) -> str:
        return words(self.rng, round(tokens * self.chars_per_token))

    def between(self, low_tokens: int, high_tokens: int) -> str:
        chars = (
            round(low_tokens * self.chars_per_token),
            round(high_tokens * self.chars_per_token),
        )
        return words(self.rng, self.rng.randrange(*chars))


def shared_prefix(args: argparse.Namespace, chars_per_token: float) -> Workload:
    rng = random.Random(args.seed)
    text = Text(rng, chars_per_token)
    prefixes = [text.of(args.prefix_tokens) for _ in range(args.tenants)]
    plan, at = [], 0.0
    for _ in range(args.requests):
        at += rng.expovariate(args.rate)
        question = text.between(*args.question_tokens)
        low, high = args.max_tokens
        plan.append((at, rng.randrange(len(prefixes)), question, rng.randrange(low, high + 1)))

    async def run(client: Client) -> list[Outcome]:
        start = time.monotonic()

        async def one(at: float, tenant: int, question: str, max_tokens: int) -> Outcome:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            messages = [
                {"role": "system", "content": prefixes[tenant]},
                {"role": "user", "content": question},
            ]
            return await client.send(messages, max_tokens, order=(0, at), start=start)

        return list(await asyncio.gather(*(one(*p) for p in plan)))

    return run


def agent(args: argparse.Namespace, chars_per_token: float) -> Workload:
    rng = random.Random(args.seed)
    text = Text(rng, chars_per_token)
    system = text.of(args.system_tokens)
    sessions = [
        [text.between(*args.tool_output_tokens) for _ in range(args.turns)]
        for _ in range(args.sessions)
    ]
    thinks = [[rng.expovariate(1 / args.think_s) for _ in range(args.turns)] for _ in sessions]
    # what each session works on, sent once and resent with every turn (none by default)
    opening = [
        [{"role": "user", "content": text.between(*args.history_tokens)}]
        if args.history_tokens[1]
        else []
        for _ in sessions
    ]

    async def run(client: Client) -> list[Outcome]:
        start = time.monotonic()

        async def session(i: int) -> list[Outcome]:
            history = [{"role": "system", "content": system}, *opening[i]]
            outcomes: list[Outcome] = []
            for turn, tool_output in enumerate(sessions[i]):
                await asyncio.sleep(thinks[i][turn])
                history.append({"role": "user", "content": tool_output})
                outcome = await client.send(
                    history,
                    args.answer_tokens,
                    order=(turn, thinks[i][0]),
                    session=f"s{i}",
                    start=start,
                )
                if outcomes:
                    outcome.on_history = outcome.worker == outcomes[-1].worker
                outcomes.append(outcome)
                if outcome.error:
                    break
                history.append({"role": "assistant", "content": outcome.text})
            return outcomes

        per_session = await asyncio.gather(*(session(i) for i in range(len(sessions))))
        return [o for outcomes in per_session for o in outcomes]

    return run


def production(args: argparse.Namespace, chars_per_token: float) -> Workload:
    """Long prompts that share little, bursty: the shape of a production conversation trace."""
    rng = random.Random(args.seed)
    text = Text(rng, chars_per_token)
    common = text.of(args.common_tokens)
    low, high = args.long_prompt_tokens
    prompts: list[list[dict[str, str]]] = []
    lengths: list[int] = []  # each prompt's tokens, as planned
    for _ in range(args.requests):
        follow_up = args.follow_up_tokens[1]
        earlier = [i for i in range(len(prompts)) if lengths[i] + follow_up <= high]
        if earlier and rng.random() < args.follow_ups:
            i = rng.choice(earlier)  # a conversation's next turn: its whole prompt again
            tokens = rng.randrange(args.follow_up_tokens[0], follow_up + 1)
            messages = [*prompts[i], {"role": "user", "content": text.of(tokens)}]
            lengths.append(lengths[i] + tokens)
        else:
            tokens = round(rng.lognormvariate(math.log(args.long_median_tokens), args.long_sigma))
            tokens = min(max(tokens, low), high)
            messages = [
                {"role": "system", "content": common},
                {"role": "user", "content": text.of(tokens - args.common_tokens)},
            ]
            lengths.append(tokens)
        prompts.append(messages)
    # the arrivals' rate: --long-load x the fleet's capacity, scaled from the shared-prefix
    # requests it was measured for by prompt tokens (prefill is most of a long prompt's work)
    rate = args.long_load * args.capacity_per_s * mean_request(args)[0] / statistics.mean(lengths)
    args.long_rate = rate
    plan, at = [], 0.0
    for messages in prompts:
        # gamma gaps of shape < 1 (mean 1 / rate): bursts of arrivals, then lulls
        at += rng.gammavariate(args.burst_shape, 1 / (args.burst_shape * rate))
        low_max, high_max = args.max_tokens
        plan.append((at, messages, rng.randrange(low_max, high_max + 1)))

    async def run(client: Client) -> list[Outcome]:
        start = time.monotonic()

        async def one(at: float, messages: list[dict[str, str]], max_tokens: int) -> Outcome:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            return await client.send(messages, max_tokens, order=(0, at), start=start)

        return list(await asyncio.gather(*(one(*p) for p in plan)))

    return run


WORKLOADS = {"shared-prefix": shared_prefix, "agent": agent, "production": production}


def mean_request(args: argparse.Namespace) -> tuple[int, int]:
    """A shared-prefix request's mean prompt and completion tokens."""
    return args.prefix_tokens + sum(args.question_tokens) // 2, sum(args.max_tokens) // 2


# ------------------------------------------------------------------------------ fleets


@dataclasses.dataclass(frozen=True)
class Fleet:
    """What the runs need of a fleet, and how to start it for each policy."""

    model: str
    renderer: Renderer  # the gateway's tokenization of this fleet's prompts
    chars_per_token: float  # of the made-up words, in that tokenization
    capacity_per_s: float  # shared-prefix requests the fleet serves a second without cache hits
    cache_tokens: int  # the largest worker's prefix cache
    described: str
    # a fresh router of a policy and fresh workers, registered; yields the router's address
    router: Callable[[str], contextlib.AbstractContextManager[str]]


def sim_fleet(args: argparse.Namespace, redis_url: str, workdir: Path) -> Fleet:
    engines = [SimEngine.from_config(worker_config(i, "unused:0")) for i in range(len(FLEET))]
    return Fleet(
        model=MODEL,
        renderer=SIM_RENDERER,
        chars_per_token=sim_tokens.BYTES_PER_TOKEN,  # the words are ASCII
        capacity_per_s=roofline_capacity_per_s(engines, *mean_request(args)),
        cache_tokens=max(e.roofline.kv_capacity_tokens for e in engines),
        described=f"{len(FLEET)} simulated workers",
        router=functools.partial(fleet_router, redis_url=redis_url),
    )


def roofline_capacity_per_s(
    engines: list[SimEngine], prompt_tokens: int, completion_tokens: int
) -> float:
    """Requests/s the fleet sustains by the roofline when every prompt is prefilled in full."""
    total = 0.0
    for engine in engines:
        batch = engine.max_parallel
        step = engine.roofline.decode_step_s(
            batch, batch * (prompt_tokens + completion_tokens // 2)
        )
        total += 1 / (engine.roofline.prefill_s(prompt_tokens) + completion_tokens * step / batch)
    return total


def torch_fleet(args: argparse.Namespace, redis_url: str, workdir: Path) -> Fleet:
    """The torch fleet, calibrated on a first start of it: its tokenizer as the gateway learns
    it, a worker's prefill and decode speeds alone, and a burst's requests/s."""
    model = ModelSection(path=DEFAULT_MODEL_PATH).served_name
    router = functools.partial(
        torch_router,
        redis_url=redis_url,
        workdir=workdir,
        workers=args.workers,
        cache_bytes=args.cache_tokens * torch_cache_bytes_per_token(),
    )
    with router("least_load") as address:
        calibration = asyncio.run(calibrate(address, model, args))
    return Fleet(
        model=model,
        renderer=calibration.renderer,
        chars_per_token=calibration.chars_per_token,
        capacity_per_s=calibration.capacity_per_s,
        cache_tokens=args.cache_tokens,
        described=(
            f"{args.workers} torch workers ({model}, 1 torch thread each); a worker alone "
            f"prefills {calibration.prefill_tokens_per_s:.0f} tokens/s (each tells the router the "
            "speed it measures once it has prefilled) and decodes "
            f"{calibration.decode_s_per_token * 1000:.1f} ms/token; the fleet serves "
            f"{calibration.capacity_per_s:.1f} shared-prefix requests/s without cache hits"
        ),
        router=router,
    )


def torch_cache_bytes_per_token() -> int:
    """A token's cache in the tiny model, in the precision its workers will serve in here."""
    # torch only for this fleet: the simulated one runs without it
    import torch

    from worker_svc.model.checkpoint import read_config
    from worker_svc.model.precision import TORCH_DTYPES, detect_capabilities
    from worker_svc.torch_engine.kv_cache import bytes_per_token

    precision = detect_capabilities(
        torch.device("cpu"), dtype=os.environ.get("INFERMESH_WORKER_MODEL_DTYPE", "auto")
    ).precision
    return bytes_per_token(read_config(DEFAULT_MODEL_PATH)[1], TORCH_DTYPES[precision])


@contextlib.contextmanager
def torch_router(
    policy: str, *, redis_url: str, workdir: Path, workers: int, cache_bytes: int
) -> Iterator[str]:
    """A fresh router (``policy``) with ``workers`` fresh torch workers registered and warmed up,
    on an emptied Redis; yields the router's address."""
    redis.Redis.from_url(redis_url).flushall()
    spec = MeshSpec(
        redis_url=redis_url,
        model_path=DEFAULT_MODEL_PATH,
        gateway_port=free_port(),
        router_port=free_port(),
        worker_ports=tuple(free_port() for _ in range(workers)),
        env={
            "OTEL_SDK_DISABLED": "true",
            "INFERMESH_LOG_LEVEL": "WARNING",
            "INFERMESH_ROUTER_ROUTING_POLICY": policy,
            # the workers share 2 cores with the router and this process
            "INFERMESH_WORKER_ENGINE_THREADS": "1",
            "INFERMESH_WORKER_CACHE_CPU_CACHE_BYTES": str(cache_bytes),
            "INFERMESH_WORKER_ATTENTION_MAX_MODEL_LEN": str(_TORCH_MAX_MODEL_LEN),
        },
        log_dir=Path(tempfile.mkdtemp(prefix=f"{policy}-", dir=workdir)),
    )
    with Mesh(spec):
        asyncio.run(warm_up([f"127.0.0.1:{port}" for port in spec.worker_ports]))
        yield spec.router_address


async def warm_up(worker_addresses: list[str]) -> None:
    """A request of the workloads' size to each worker: a worker's first prefill of each size
    takes up to three times longer than the later ones, which would land on a run's first
    requests."""
    request = common_pb2.GenerateRequest(
        model=ModelSection(path=DEFAULT_MODEL_PATH).served_name,
        messages=[
            common_pb2.ChatMessage(role="user", content=words(random.Random("warm up"), 2000))
        ],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4),
    )

    async with worker_client() as client:
        await asyncio.gather(*(client.complete(a, request) for a in worker_addresses))


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What a first start of the torch fleet measured."""

    renderer: Renderer
    chars_per_token: float
    prefill_tokens_per_s: float
    decode_s_per_token: float
    capacity_per_s: float


async def calibrate(router_address: str, model: str, args: argparse.Namespace) -> Calibration:
    renderer = await gateway_renderer(router_address, model)
    rng = random.Random(f"calibrate {args.seed}")  # other words than the workloads': no hits
    sample = words(rng, 20_000)
    chars_per_token = len(sample) / len(
        renderer.token_ids(common_pb2.GenerateRequest(prompt=sample))
    )
    text = Text(rng, chars_per_token)
    completion_tokens = mean_request(args)[1]

    def request() -> list[dict[str, str]]:
        return [
            {"role": "system", "content": text.of(args.prefix_tokens)},
            {"role": "user", "content": text.of(sum(args.question_tokens) // 2)},
        ]

    async with policies.gateway_mesh(router_address, TIMEOUT_S) as mesh:
        client = Client(mesh, model, renderer, False)
        # one at a time (least_load: each on another worker): a worker's own speeds
        alone = [
            await client.send(request(), completion_tokens, order=(0, 0.0), start=time.monotonic())
            for _ in range(3)
        ]
        # all at once, a few batches' worth: what the fleet serves on the cores it shares
        start = time.monotonic()
        burst = await asyncio.gather(
            *(
                client.send(request(), completion_tokens, order=(0, 0.0), start=start)
                for _ in range(6 * args.workers)
            )
        )
    failed = [o.error for o in [*alone, *burst] if o.error]
    if failed:
        raise RuntimeError(f"calibration requests failed: {failed}")
    return Calibration(
        renderer,
        chars_per_token,
        statistics.median(o.prompt_tokens / o.ttft_s for o in alone if o.ttft_s),
        statistics.median(
            (o.done_s - o.ttft_s) / (o.tokens - 1) for o in alone if o.done_s and o.ttft_s
        ),
        len(burst) / max(o.done_s for o in burst if o.done_s),
    )


async def gateway_renderer(router_address: str, model: str) -> Renderer:
    """The model's tokenizer as the gateway learns it: the digest its workers report in the
    router's ListWorkers, the files fetched from one of them (Worker.TextFiles)."""
    mesh = MeshClient(RouterSection(address=router_address), TlsSection(plaintext=True))
    tokens = PromptTokens(mesh, refresh_s=1.0)
    try:
        async with asyncio.timeout(60):
            while (renderer := tokens.renderer(model)) is None:
                await asyncio.sleep(0.1)
        return renderer
    finally:
        await tokens.close()
        await mesh.close()


FLEETS = {"sim": sim_fleet, "torch": torch_fleet}


# ------------------------------------------------------------------------------ runs


async def run_policy(address: str, fleet: Fleet, workload: Workload, hashes: bool) -> list[Outcome]:
    async with policies.gateway_mesh(address, TIMEOUT_S) as mesh:
        return await workload(Client(mesh, fleet.model, fleet.renderer, hashes))


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    done = [o for o in outcomes if o.done_s is not None and o.ttft_s is not None]
    ttfts = sorted(o.ttft_s for o in done if o.ttft_s is not None)
    q = statistics.quantiles(ttfts, n=100) if len(ttfts) > 1 else [float("nan")] * 99
    later_turns = [o.on_history for o in done if o.on_history is not None]
    makespan = max((o.done_s for o in done if o.done_s is not None), default=float("nan"))
    return {
        "mean": statistics.mean(ttfts) if ttfts else float("nan"),
        "p50": statistics.median(ttfts) if ttfts else float("nan"),
        "p90": q[89],
        "p99": q[98],
        "tokens_per_s": sum(o.tokens for o in done) / makespan,
        "hit": sum(o.cached_tokens for o in done) / max(sum(o.prompt_tokens for o in done), 1),
        # over every request sent, served or not: the same requests whatever the policy did
        "oracle": oracle_tokens(outcomes) / max(sum(o.prompt_tokens for o in outcomes), 1),
        "on_history": sum(later_turns) / len(later_turns) if later_turns else None,
        "done": len(done),
        "errors": len(outcomes) - len(done),
        "error_codes": ", ".join(sorted({o.error for o in outcomes if o.error})),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fleet", choices=sorted(FLEETS), default="sim")
    parser.add_argument("--workload", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=list(POLICIES))
    parser.add_argument("--seed", type=int, default=1)
    torch_fleet_args = parser.add_argument_group("torch fleet")
    torch_fleet_args.add_argument("--workers", type=int, default=3)
    torch_fleet_args.add_argument(
        "--cache-tokens",
        type=int,
        default=8192,
        help=f"each worker's prefix cache (at least {_TORCH_MAX_MODEL_LEN}: one whole context)",
    )
    shared = parser.add_argument_group("shared-prefix (defaults: the fleet's, DEFAULTS)")
    shared.add_argument("--tenants", type=int)
    shared.add_argument("--prefix-tokens", type=int)
    shared.add_argument("--question-tokens", type=int, nargs=2, metavar=("LOW", "HIGH"))
    shared.add_argument("--max-tokens", type=int, nargs=2, metavar=("LOW", "HIGH"))
    shared.add_argument("--requests", type=int)
    shared.add_argument(
        "--load", type=float, help="arrivals / the fleet's capacity without cache hits"
    )
    shared.add_argument("--rate", type=float, help="arrivals a second (instead of --load)")
    agents = parser.add_argument_group("agent (defaults: the fleet's, DEFAULTS)")
    agents.add_argument("--sessions", type=int)
    agents.add_argument("--turns", type=int)
    agents.add_argument("--system-tokens", type=int)
    agents.add_argument("--tool-output-tokens", type=int, nargs=2, metavar=("LOW", "HIGH"))
    agents.add_argument("--answer-tokens", type=int)
    agents.add_argument("--think-s", type=float)
    agents.add_argument(
        "--history-tokens",
        type=int,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="each session's opening context, resent with every turn (0 0: none)",
    )
    long = parser.add_argument_group(
        "production: long prompts sharing little, bursty (--requests too; defaults: DEFAULTS)"
    )
    long.add_argument("--common-tokens", type=int, help="the one leading block every prompt shares")
    long.add_argument(
        "--long-prompt-tokens", type=int, nargs=2, metavar=("LOW", "HIGH"), help="clipped to these"
    )
    long.add_argument("--long-median-tokens", type=int, help="of the log-normal prompt lengths")
    long.add_argument("--long-sigma", type=float, help="of the log-normal prompt lengths")
    long.add_argument(
        "--follow-ups", type=float, help="share of requests resending an earlier one's prompt"
    )
    long.add_argument("--follow-up-tokens", type=int, nargs=2, metavar=("LOW", "HIGH"))
    long.add_argument(
        "--burst-shape", type=float, help="of the gamma gaps between arrivals (< 1: bursty)"
    )
    long.add_argument(
        "--long-load",
        type=float,
        help="arrivals / the fleet's capacity without cache hits, for these prompts",
    )
    parser.set_defaults(**DEFAULTS[parser.parse_known_args()[0].fleet])
    args = parser.parse_args()
    results: dict[tuple[str, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as workdir, RedisServer(workdir=workdir) as redis_server:
        fleet = FLEETS[args.fleet](args, redis_server.url, Path(workdir))
        args.rate = args.rate or args.load * fleet.capacity_per_s
        args.capacity_per_s = fleet.capacity_per_s
        print(
            f"fleet: {fleet.described}; largest cache {fleet.cache_tokens} tokens; shared-prefix: "
            f"{args.tenants} tenants x {args.prefix_tokens} tokens "
            f"({args.tenants * args.prefix_tokens / fleet.cache_tokens:.1f}x the largest cache), "
            f"{args.requests} requests at {args.rate:.1f}/s "
            f"({args.rate / fleet.capacity_per_s:.2f}x capacity without hits); "
            f"agent: {args.sessions} sessions x {args.turns} turns; production: "
            f"{args.requests} prompts of {args.long_prompt_tokens[0]}-{args.long_prompt_tokens[1]} "
            f"tokens (median {args.long_median_tokens}) sharing {args.common_tokens}",
            flush=True,
        )
        for name in args.workload:
            workload = WORKLOADS[name](args, fleet.chars_per_token)
            if name == "production":
                print(
                    f"production: {args.long_rate:.1f} requests/s on average "
                    f"({args.long_load:.2f}x capacity without hits)",
                    flush=True,
                )
            for label in args.policies:
                policy, hashes = POLICIES[label]
                with fleet.router(policy) as address:
                    outcomes = asyncio.run(run_policy(address, fleet, workload, hashes))
                r = results[name, label] = summarize(outcomes)
                on_history = (
                    f"on history's worker {r['on_history']:4.0%}  "
                    if r["on_history"] is not None
                    else ""
                )
                print(
                    f"{name:<13} {label:<12} TTFT mean {r['mean'] * 1000:6.0f} ms  "
                    f"p50 {r['p50'] * 1000:6.0f}  p90 {r['p90'] * 1000:6.0f}  "
                    f"p99 {r['p99'] * 1000:6.0f}  {r['tokens_per_s']:6.0f} tok/s  "
                    f"hits {r['hit']:4.0%} (oracle {r['oracle']:4.0%}, "
                    f"{r['hit'] / max(r['oracle'], 1e-9):4.0%} of it)  "
                    f"{on_history}done {r['done']:.0f}  "
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
    if ("production", "balanced") in results and ("production", "cache_aware") in results:
        old, new = results["production", "balanced"], results["production", "cache_aware"]
        print(
            f"production cache_aware vs balanced: p90 TTFT x{new['p90'] / old['p90']:.2f} "
            "(target < 1)"
        )
    if ("agent", "cache_aware") in results:
        print(
            f"agent cache_aware: {results['agent', 'cache_aware']['on_history']:.0%} of the turns "
            "after a session's first on the worker holding their history (target >= 90 %)"
        )


if __name__ == "__main__":
    main()
