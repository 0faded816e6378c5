"""Prefill/decode disaggregation against aggregated serving, at equal fleet: goodput, time to
first token and inter-token latency on a simulated mixed fleet of 16 DeepSeek-V3 workers.

    nice -n 10 .venv/bin/python bench/pd_serving.py
        [--workload agent shared-prefix production prefill-heavy]
        [--modes aggregated always-split conditional ours ours-partitioned]
        [--prefill H100:2,H800:2,A100:1] [--link-gbps 400] [--time-scale 4] [--seed 1]

Every mode runs in this one invocation on the same arrivals (or the same sessions and think
times). Per mode and workload, fresh processes on an emptied Redis: a real router (cache-aware:
the balanced policy, each request with its prompt's block hashes) and one process hosting the 16
simulated workers (worker_svc/sim_engine/, prefilling in the torch engine's chunks) as real gRPC
servers: 4 of each of H200 x 8 GPUs, H100 x 16, H800 x 16 and A100 x 24, serving DeepSeek-V3 (FP8
on the Hopper GPUs, BF16 on the A100s; MLA attention's FLOPs counted) with a prefix cache of what
their memory holds after the weights (4.9-6.8 M tokens), up to 32 sequences each, contexts to
128k tokens. The modes (``[routing] phase_split``, router_svc/phases.py):

- aggregated: every worker "both", no link, no split (``never``);
- always-split: ``--prefill`` workers of each kind of role "prefill", the rest "decode", with the
  link: every prompt a prefill worker can take is prefilled there (``always``: the rule before
  the per-request decision), a busy holder's cached prefix pulled when the link beats computing;
- conditional: the same fleet under Dynamo's rule (``conditional``: prefilled on D when the part
  it lacks is under 2,048 tokens or 0.7 of the prompt, or when P has prefill queued);
- ours: every worker "both", with the link: the router's per-request decision (``cost``), idle
  workers prefilling for busy ones;
- ours-partitioned (not by default): the partitioned fleet under the router's decision.

Workloads (bench/cache_routing.py's, sized here): agent: sessions that open with a 20-80k-token
context and resend their growing history every turn (closed loop, think times between turns);
shared-prefix: tenants' 6k-token system prompts with short questions, Poisson arrivals at a
fixed rate; production (not by default): long prompts (1-64k tokens, median 8k) sharing one
512-token block, bursty, with 200-400-token answers, at ``--long-load`` x the fleet's capacity
without hits; prefill-heavy (not by default): fresh prompts of 8-64k tokens (median 24k) with
200-800-token answers (input:output at least 10:1), bursty, at ``--heavy-load`` x the capacity.

Goodput here is the number of requests meeting both SLOs (their time to first token <= 2 s, and
the 99th percentile of their own inter-token gaps, for answers under 100 tokens the longest, <=
100 ms) per second of one fixed window, the same for every mode of a workload (from the start to
the last answer of the slowest mode), at the same offered workload for every mode:
every request counts, a failed or cut one in the denominator as a miss. Not the highest arrival
rate meeting the SLOs, which would need a search of rates per mode. The share of requests meeting
them is shown too, with TTFT p50/p90 and the fleet's inter-token p99 (over every token).

Simulated time runs ``--time-scale`` times slower than the wall clock (the workers' steps and
transfers, the speeds they report, the router's link, the workload's arrivals and think times),
so that 16 workers, a router and this client sharing a busy machine add little jitter to what is
timed; every figure is in simulated seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import math
import os
import statistics
import tempfile
import urllib.request
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # this process forks the services

from prometheus_client.parser import text_string_to_metric_families

from bench import cache_routing
from bench import router_policies as policies
from devtools.pd_split import decode_without_prefill
from devtools.redis_server import RedisServer
from infermesh import sim_tokens
from infermesh.ports import free_port
from infermesh.prompt_tokens import SIM_RENDERER
from infermesh.tls import TlsSection
from router_svc.config import RoutingSection
from worker_svc.config import (
    AttentionSection,
    EngineSection,
    ModelSection,
    ParallelSection,
    RouterSection,
    WorkerConfig,
    WorkerSection,
    WorkerServerSection,
)
from worker_svc.hardware.gpu_profiles import gpu_profiles
from worker_svc.hardware.sizing import model_size_of
from worker_svc.sim_engine.engine import SimEngine

MODEL = "DeepSeek-V3"
KINDS = (("H200", 8), ("H100", 16), ("H800", 16), ("A100", 24))  # (GPU profile, GPUs per worker)
FLEET = [kind for kind in KINDS for _ in range(4)]
# MLA: 61 layers x 128 heads, each query against a cached token's 512 + 64 values (scores) and
# its 512-value latent (the absorbed value), 2 FLOPs a multiply-add
ATTENTION_FLOPS_PER_KEY = model_size_of(MODEL).attention_flops_per_key
MAX_PARALLEL = 32
MAX_MODEL_LEN = 131072
TTFT_SLO_S = 2.0
ITL_SLO_S = 0.1
MODES = {  # name: (prefill workers, link, [routing] phase_split)
    "aggregated": (False, False, "never"),
    "always-split": (True, True, "always"),
    "conditional": (True, True, "conditional"),
    "ours": (False, True, "cost"),
    "ours-partitioned": (True, True, "cost"),
}
DEFAULT_MODES = ["aggregated", "always-split", "conditional", "ours"]
DEFAULTS: dict[str, Any] = {
    "sessions": 32,
    "turns": 4,
    "system_tokens": 2000,
    "history_tokens": [20000, 80000],
    "tool_output_tokens": [200, 2000],
    "answer_tokens": 64,
    "think_s": 3.0,
    "tenants": 48,
    "prefix_tokens": 6000,
    "question_tokens": [25, 200],
    "max_tokens": [16, 64],
    "requests": 600,
    "rate": 120.0,
    # production (bench/cache_routing.py's): long prompts sharing one block, bursty, long answers
    "common_tokens": 512,
    "long_prompt_tokens": [1000, 64000],
    "long_median_tokens": 8000,
    "long_sigma": 1.1,
    "follow_ups": 0.05,
    "follow_up_tokens": [50, 1000],
    "burst_shape": 0.25,
    "long_load": 0.15,
    "long_max_tokens": [200, 400],
    # prefill-heavy: fresh long prompts, short answers, bursty
    "heavy_prompt_tokens": [8000, 64000],
    "heavy_median_tokens": 24000,
    "heavy_load": 0.5,
    "heavy_max_tokens": [200, 800],
}


def roles(prefill: dict[str, int], disaggregated: bool) -> list[str]:
    """Each worker's role: the first ``prefill[kind]`` workers of a kind prefill, the rest decode
    (aggregated: all both)."""
    if not disaggregated:
        return ["both"] * len(FLEET)
    out, seen = [], dict.fromkeys(prefill, 0)
    for gpu, _ in FLEET:
        seen[gpu] = seen.get(gpu, 0) + 1
        out.append("prefill" if seen[gpu] <= prefill.get(gpu, 0) else "decode")
    return out


def worker_configs(
    router_address: str, worker_roles: Sequence[str], link_gbps: float, time_scale: float
) -> list[WorkerConfig]:
    return [
        WorkerConfig(
            server=WorkerServerSection(port=0, worker_id=f"{gpu.lower()}-{i:02d}-{role}"),
            worker=WorkerSection(role=role),  # type: ignore[arg-type]  # roles() gives Role's
            router=RouterSection(address=router_address),
            model=ModelSection(name=MODEL),
            attention=AttentionSection(max_model_len=MAX_MODEL_LEN),
            parallel=ParallelSection(max_parallel=MAX_PARALLEL),
            engine=EngineSection(
                kind="sim",
                gpu=gpu,
                gpu_count=count,
                model=MODEL,
                attention_flops_per_key=ATTENTION_FLOPS_PER_KEY,
                link_gbps=link_gbps,
                time_scale=time_scale,
            ),
            tls=TlsSection(plaintext=True),
        )
        for i, ((gpu, count), role) in enumerate(zip(FLEET, worker_roles, strict=True))
    ]


def prefill_split(text: str) -> dict[str, int]:
    """``KIND:N,...`` (prefill workers per GPU kind), checked against the fleet: each precision
    that has decode workers has a prefill worker (its blocks go to no other precision)."""
    split: dict[str, int] = {}
    for item in filter(None, text.split(",")):
        kind, _, count = item.partition(":")
        if kind not in dict(KINDS) or not count.isdigit() or not 0 < int(count) < 4:
            raise argparse.ArgumentTypeError(
                f"{item!r}: need KIND:N with KIND one of {', '.join(dict(KINDS))}, 0 < N < 4"
            )
        split[kind] = int(count)
    worker_roles = {str(i): role for i, role in enumerate(roles(split, disaggregated=True))}
    precisions = {str(i): gpu_profiles()[gpu].precision for i, (gpu, _) in enumerate(FLEET)}
    missing = decode_without_prefill(worker_roles, precisions)
    if missing:
        raise argparse.ArgumentTypeError(f"{text!r}: the {missing[0]} workers have no prefill one")
    return split


def request_itl_p99(itl_s: list[float]) -> float:
    """The 99th percentile of one request's inter-token gaps (nearest rank: under 100 gaps,
    the longest); 0 for an answer of one token."""
    if not itl_s:
        return 0.0
    gaps = sorted(itl_s)
    return gaps[math.ceil(0.99 * len(gaps)) - 1]


def summarize(
    outcomes: list[cache_routing.Outcome], time_scale: float, window_s: float | None = None
) -> dict[str, Any]:
    """The run's figures in simulated seconds; goodput per second of ``window_s`` (None: the
    run's own makespan, to its last answer)."""
    done = [o for o in outcomes if o.done_s is not None and o.ttft_s is not None]
    ttfts = sorted(o.ttft_s / time_scale for o in done if o.ttft_s is not None) or [0.0, 0.0]
    gaps = sorted(g / time_scale for o in done for g in o.itl_s) or [0.0, 0.0]
    good = [
        o
        for o in done
        if o.ttft_s is not None
        and o.ttft_s / time_scale <= TTFT_SLO_S
        and request_itl_p99(o.itl_s) / time_scale <= ITL_SLO_S
    ]
    makespan = max((o.done_s for o in outcomes if o.done_s is not None), default=0.0) / time_scale
    # an agent's turns after its first: their history is cached somewhere
    later = [o.ttft_s / time_scale for o in done if o.order[0] > 0 and o.ttft_s is not None]
    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(done),
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": statistics.quantiles(ttfts, n=10)[8],
        "itl_p99": statistics.quantiles(gaps, n=100)[98],
        "good": len(good),
        "good_share": len(good) / len(outcomes),
        "goodput": len(good) / (window_s or makespan or 1.0),
        "makespan": makespan,
        "hit": sum(o.cached_tokens for o in done) / max(sum(o.prompt_tokens for o in done), 1),
        "later_ttft_p50": statistics.median(later) if later else None,
        "error_codes": ", ".join(sorted({o.error for o in outcomes if o.error})),
    }


async def run_workload(
    address: str, workload: cache_routing.Workload
) -> list[cache_routing.Outcome]:
    async with policies.gateway_mesh(address, cache_routing.TIMEOUT_S) as mesh:
        return await workload(cache_routing.Client(mesh, MODEL, SIM_RENDERER, with_hashes=True))


def capacity_per_s(args: argparse.Namespace) -> float:
    """Shared-prefix requests a second the aggregated fleet serves without cache hits, by the
    roofline (production's arrivals are a share of it)."""
    configs = worker_configs("unused:0", roles({}, False), 0.0, 1.0)
    engines = [SimEngine.from_config(c) for c in configs]
    return cache_routing.roofline_capacity_per_s(engines, *cache_routing.mean_request(args))


def describe_fleet(worker_roles: Sequence[str]) -> str:
    configs = worker_configs("unused:0", worker_roles, 0.0, 1.0)
    parts = []
    for (gpu, count), config in zip(KINDS, configs[::4], strict=True):
        engine = SimEngine.from_config(config)
        roofline = engine.roofline
        parts.append(
            f"{gpu} x {count} ({roofline.profile.precision}): cache "
            f"{roofline.kv_capacity_tokens / 1e6:.1f} M tokens, 50k-token prefill "
            f"{roofline.prefill_s(50_000):.2f} s, decode step (32 x 50k) "
            f"{roofline.decode_step_s(32, 32 * 50_000) * 1000:.1f} ms"
        )
    return "; ".join(parts)


def workload_of(name: str, args: argparse.Namespace) -> cache_routing.Workload:
    """The workload ``name`` with its arrivals and think times in wall seconds."""
    scale = args.time_scale
    wall = argparse.Namespace(**{**vars(args), "rate": args.rate / scale})
    wall.think_s = args.think_s * scale
    wall.capacity_per_s = capacity_per_s(args) / scale
    if name == "production":
        wall.max_tokens = args.long_max_tokens
    if name == "prefill-heavy":  # production's shape: fresh long prompts, short answers
        wall.max_tokens = args.heavy_max_tokens
        wall.long_prompt_tokens = args.heavy_prompt_tokens
        wall.long_median_tokens = args.heavy_median_tokens
        wall.long_sigma = 0.6
        wall.long_load = args.heavy_load
        wall.follow_ups = 0.0
        wall.common_tokens = 0
        name = "production"
    return cache_routing.WORKLOADS[name](wall, sim_tokens.BYTES_PER_TOKEN)


def phase_plans(metrics_port: int) -> collections.Counter[str]:
    """The router's decisions by phase plan and deciding term ("split/stall": prefilled on P),
    read from its metrics port."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return collections.Counter(
        {
            f"{sample.labels['plan']}/{sample.labels['term']}": int(sample.value)
            for family in text_string_to_metric_families(text)
            if family.name == "infermesh_router_phase_plans"
            for sample in family.samples
            if sample.name.endswith("_total")
        }
    )


def run_mode(
    mode: str, args: argparse.Namespace, redis_url: str, workload: cache_routing.Workload
) -> tuple[list[cache_routing.Outcome], collections.Counter[str]]:
    """One mode's run of ``workload`` on a fresh router and fleet, and the router's phase plans."""
    _, link, phase_split = MODES[mode]
    scale = args.time_scale
    fleet_command = [
        __file__,
        "--mode",
        mode,
        "--prefill",
        ",".join(f"{k}:{n}" for k, n in args.prefill.items()),
        "--link-gbps",
        str(args.link_gbps),
        "--time-scale",
        str(scale),
        "--fleet",
    ]
    # the router's times run on the wall clock: the link's, the inter-token objective's and the
    # stall timeout's scaled with the simulated time (a worker's silence of 30 simulated seconds,
    # not 30 / scale: a long prefill in one decode step is not a stalled worker)
    router_env = {
        "INFERMESH_ROUTER_ROUTING_LINK_GBPS": str(args.link_gbps / scale if link else 0),
        "INFERMESH_ROUTER_ROUTING_PHASE_SPLIT": phase_split,
        "INFERMESH_ROUTER_ROUTING_INTER_TOKEN_OBJECTIVE_S": str(ITL_SLO_S * scale),
        "INFERMESH_ROUTER_ROUTING_STALL_TIMEOUT_S": str(RoutingSection().stall_timeout_s * scale),
        # a shared machine's stalls are no worker's failure: a slower Redis and a longer TTL
        # keep the fleet registered through them
        "INFERMESH_ROUTER_REDIS_TIMEOUT_S": "2",
        "INFERMESH_ROUTER_REGISTRY_TTL_S": "15",
        "INFERMESH_ROUTER_METRICS_PORT": str(metrics_port := free_port()),
    }
    with policies.fleet_router(
        "balanced", redis_url, fleet_command, len(FLEET), router_env
    ) as address:
        outcomes = asyncio.run(run_workload(address, workload))
        return outcomes, phase_plans(metrics_port)


def report(name: str, mode: str, r: dict[str, Any]) -> None:
    later = r["later_ttft_p50"]
    print(
        f"{name:<13} {mode:<16} goodput {r['goodput']:6.2f} req/s "
        f"({r['good']} of {r['requests']} meet both SLOs, {r['good_share']:4.0%})  "
        f"TTFT p50 {r['ttft_p50']:6.2f} s  p90 {r['ttft_p90']:6.2f} s  "
        f"ITL p99 {r['itl_p99'] * 1000:7.1f} ms  makespan {r['makespan']:6.1f} s  "
        f"hits {r['hit']:4.0%}  "
        + (f"later turns' TTFT p50 {later:5.2f} s  " if later is not None else "")
        + f"errors {r['errors']:.0f} {r['error_codes']}",
        flush=True,
    )


def verdicts(name: str, results: dict[str, dict[str, Any]]) -> None:
    """Each mode's goodput against aggregated's, and ours against the baselines, with targets."""
    base = results.get("aggregated")
    for mode, r in results.items():
        if base is None or mode == "aggregated":
            continue
        ratio = r["good"] / max(base["good"], 1)
        line = f"{name} {mode} vs aggregated: goodput x{ratio:.2f}"
        if mode.startswith("ours"):
            target = 1.5 if name == "prefill-heavy" else 0.95
            line += f" (target >= {target}: {'met' if ratio >= target else 'MISSED'})"
            for baseline in ("conditional", "always-split"):
                if baseline in results:
                    against = r["good"] / max(results[baseline]["good"], 1)
                    line += f"; vs {baseline} x{against:.2f}"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    workloads = ["agent", "shared-prefix", "production", "prefill-heavy"]
    parser.add_argument("--workload", nargs="+", choices=workloads, default=workloads[:2])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=DEFAULT_MODES)
    parser.add_argument(
        "--prefill",
        type=prefill_split,
        default=prefill_split("H100:2,H800:2,A100:1"),
        help="partitioned modes: prefill workers per GPU kind, KIND:N,... (H100:2,H800:2,A100:1)",
    )
    parser.add_argument("--link-gbps", type=float, default=400.0, help="between the workers")
    parser.add_argument("--time-scale", type=float, default=4.0, help="wall s per simulated s")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--fleet", metavar="ROUTER_ADDRESS", help=argparse.SUPPRESS)
    for key, value in DEFAULTS.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, list):
            parser.add_argument(flag, type=int, nargs=2, default=value, metavar=("LOW", "HIGH"))
        else:
            parser.add_argument(flag, type=type(value), default=value)
    args = parser.parse_args()
    if args.fleet:  # the child serving the workers of --mode
        logging.basicConfig(level=os.environ.get("INFERMESH_LOG_LEVEL", "WARNING"))
        partitioned, link, _ = MODES[args.mode]
        configs = worker_configs(
            args.fleet,
            roles(args.prefill, partitioned),
            args.link_gbps if link else 0.0,
            args.time_scale,
        )
        asyncio.run(policies.serve_workers(configs))
        return
    scale = args.time_scale
    print(
        f"fleet: {describe_fleet(roles({}, False))}; {MAX_PARALLEL} sequences a worker; "
        f"partitioned: prefill on {args.prefill}; link {args.link_gbps:g} Gb/s; "
        f"time scale {scale:g}; modes {', '.join(args.modes)}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as workdir, RedisServer(workdir=workdir) as redis_server:
        for name in args.workload:
            workload = workload_of(name, args)
            runs, plans = {}, {}
            for mode in args.modes:
                runs[mode], plans[mode] = run_mode(mode, args, redis_server.url, workload)
            # one window for every mode: to the slowest mode's last answer
            window_s = max(summarize(o, scale)["makespan"] for o in runs.values())
            results = {mode: summarize(o, scale, window_s) for mode, o in runs.items()}
            print(f"{name}: window {window_s:.1f} s", flush=True)
            for mode, r in results.items():
                report(name, mode, r)
                print(
                    "  plans: " + ", ".join(f"{plan} {n}" for plan, n in plans[mode].most_common()),
                    flush=True,
                )
                failures = collections.Counter(
                    f"{o.error}: {o.error_details}" for o in runs[mode] if o.error
                )
                for failure, count in failures.most_common():
                    print(f"  {count} x {failure}", flush=True)
            verdicts(name, results)


if __name__ == "__main__":
    main()
