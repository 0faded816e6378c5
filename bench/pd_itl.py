"""Streams decoding while long prompts keep arriving (issues #35, #43): the inter-token latency of
the decoding streams when two real torch workers serve together (aggregated: each does both
phases) against apart (one "prefill", one "decode": the long prompts' KV blocks computed on P and
sent to D), at equal fleet: apart under the rule before #43 (always-split: every prompt to P) and
under the router's per-request decision (ours: to P only when D's streams would stall past the
inter-token objective and P's first token comes no later; router_svc/phases.py), and the decision
over two "both" workers, either prefilling for the other while idle (ours-both).

    nice -n 10 .venv/bin/python bench/pd_itl.py [--seconds 60] [--streams 4] \
        [--prompt-tokens 8192] [--every-s 6] [--link-gbps 10] [--modes aggregated ours-both]

Each mode starts its own mesh as processes (devtools.mesh: Redis, the router, two workers on
`models/tiny-deepseek-v3-mla`, the gateway; mutual TLS), each worker pinned to a core of its own
(all its threads, one torch thread), so the modes get the same compute: a prefill on P takes
no cycles from D. Apart, the router has `[routing] link_gbps` set and the workers `[worker] role`
"prefill" and "decode"; each mode sets `[routing] phase_split` (aggregated: "never"). Load,
through the gateway with the openai SDK, greedy:
``--streams`` chats that each stream 128 tokens and start again when done, and every
``--every-s`` a fresh prompt of ``--prompt-tokens`` tokens (made-up words, no cache hits) asking
for 4 tokens. Prints, per mode, the streams' inter-token latency (the gaps between content chunks
after the first) p50/p99, their tokens/s, the long prompts' TTFT p50/max and how many requests the
router prefilled on P (its infermesh_router_phase_plans counter, the warm-up included); then each
split mode's ITL p99 against aggregated's (#43's target for ours: <= 1.0).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import openai

from bench.fair_queueing import percentile
from bench.pd_serving import phase_plans
from bench.router_policies import words
from devtools.mesh import Mesh, MeshSpec
from devtools.redis_server import RedisServer
from gateway.accounts.keys import create_key_at
from infermesh.ports import free_port
from infermesh.text.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-deepseek-v3-mla"
STREAM_TOKENS = 128
LONG_PROMPT_NEW_TOKENS = 4
MODES = {  # name: (a prefill and a decode worker, [routing] phase_split, link)
    "aggregated": (False, "never", False),
    "always-split": (True, "always", True),
    "ours": (True, "cost", True),
    # both workers "both", linked: either may prefill for the other while it is idle
    "ours-both": (False, "cost", True),
}


async def stream_loop(
    client: openai.AsyncOpenAI, model: str, stop_at: float, gaps: list[float], tokens: list[int]
) -> None:
    """One chat streaming STREAM_TOKENS tokens, again and again until ``stop_at``: the gaps
    between its content chunks after the first go to ``gaps``."""
    while time.monotonic() < stop_at:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=STREAM_TOKENS,
            temperature=0,
            stream=True,
        )
        last = None
        async for chunk in stream:
            if not chunk.choices or not chunk.choices[0].delta.content:
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            tokens[0] += 1


async def long_prompts(
    client: openai.AsyncOpenAI,
    model: str,
    stop_at: float,
    texts: list[str],
    every_s: float,
    ttfts: list[float],
) -> None:
    """A fresh long prompt every ``every_s`` until ``stop_at``; each one's TTFT to ``ttfts``."""

    async def one(text: str) -> None:
        start = time.monotonic()
        stream = await client.completions.create(
            model=model, prompt=text, max_tokens=LONG_PROMPT_NEW_TOKENS, temperature=0, stream=True
        )
        first = None
        async for _ in stream:
            first = first or time.monotonic()
        if first is not None:
            ttfts.append(first - start)

    pending = []
    for text in texts:
        if time.monotonic() >= stop_at:
            break
        pending.append(asyncio.create_task(one(text)))
        await asyncio.sleep(every_s)
    await asyncio.gather(*pending)


def pin(pid: int, core: int) -> None:
    """Every thread of process ``pid`` on ``core``."""
    subprocess.run(
        ["taskset", "-a", "-p", "-c", str(core), str(pid)],
        check=True,
        text=True,
        capture_output=True,
    )


async def measure(
    base_url: str, key: str, model: str, texts: list[str], args: argparse.Namespace
) -> dict[str, float]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600) as c:
        # warm-up: a long prompt (the first prefill of a size is slow) and a stream, not counted
        await c.completions.create(model=model, prompt=texts[0], max_tokens=1, temperature=0)
        await stream_loop(c, model, time.monotonic(), [], [0])
        gaps: list[float] = []
        ttfts: list[float] = []
        tokens = [0]
        start = time.monotonic()
        stop_at = start + args.seconds
        await asyncio.gather(
            *(stream_loop(c, model, stop_at, gaps, tokens) for _ in range(args.streams)),
            long_prompts(c, model, stop_at, texts[1:], args.every_s, ttfts),
        )
        elapsed = time.monotonic() - start
    return {
        "itl_p50_ms": percentile(gaps, 0.5) * 1000,
        "itl_p99_ms": percentile(gaps, 0.99) * 1000,
        "stream_tokens_per_s": tokens[0] / elapsed,
        "long_prompts": len(ttfts),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else 0.0,
        "ttft_max_s": max(ttfts, default=0.0),
    }


def run_mode(
    mode: str, texts: list[str], cores: list[int], args: argparse.Namespace
) -> dict[str, float]:
    apart, phase_split, link = MODES[mode]
    roles: tuple[Mapping[str, str], ...] = (
        ({"INFERMESH_WORKER_WORKER_ROLE": "prefill"}, {"INFERMESH_WORKER_WORKER_ROLE": "decode"})
        if apart
        else ()
    )
    metrics_port = free_port()
    router_env = (
        {
            "INFERMESH_ROUTER_ROUTING_LINK_GBPS": str(args.link_gbps if link else 0),
            "INFERMESH_ROUTER_ROUTING_PHASE_SPLIT": phase_split,
            "INFERMESH_ROUTER_METRICS_PORT": str(metrics_port),
        },
    )
    workdir = Path(tempfile.mkdtemp(prefix=f"pd-itl-{mode}-"))
    try:
        with RedisServer(workdir=workdir) as redis:
            spec = MeshSpec(
                redis_url=redis.url,
                model_path=str(MODEL_DIR),
                gateway_port=free_port(),
                router_port=free_port(),
                worker_ports=(free_port(), free_port()),
                env={
                    "OTEL_SDK_DISABLED": "true",
                    "INFERMESH_LOG_LEVEL": "WARNING",
                    "INFERMESH_WORKER_ENGINE_THREADS": "1",
                },
                worker_env=roles,
                router_env=router_env,
                log_dir=workdir,
                certs=workdir / "certs",
            )
            with Mesh(spec) as mesh:
                for i, core in enumerate(cores):
                    pin(mesh.pid(f"worker{i}"), core)
                key = asyncio.run(create_key_at(redis.url, "pd-itl"))
                result = asyncio.run(measure(spec.base_url, key, MODEL_DIR.name, texts, args))
                plans = phase_plans(metrics_port)
                result["split"] = sum(n for plan, n in plans.items() if plan.startswith("split/"))
                return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--every-s", type=float, default=6.0)
    parser.add_argument("--link-gbps", type=float, default=10.0)
    parser.add_argument("--cores", type=int, nargs=2, default=[0, 1], help="the workers' cores")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = parser.parse_args()
    tokenizer = Tokenizer(str(MODEL_DIR))
    rng = random.Random("pd-itl")
    sample = words(rng, 20_000)
    chars_per_token = len(sample) / len(tokenizer.encode(sample))
    count = int(args.seconds / args.every_s) + 2
    # both modes get the same prompts, none sharing a block with another
    texts = [
        f"{i} " + words(rng, round(args.prompt_tokens * chars_per_token)) for i in range(count)
    ]
    if "aggregated" not in args.modes:
        parser.error("--modes: aggregated is the reference every mode is compared with")
    results = {mode: run_mode(mode, texts, args.cores, args) for mode in args.modes}
    print(
        f"{args.streams} streams of {STREAM_TOKENS} tokens, a {args.prompt_tokens}-token prompt "
        f"every {args.every_s} s, {args.seconds} s a mode"
    )
    print(
        "| mode | ITL p50 ms | ITL p99 ms | stream tokens/s | long prompts | TTFT p50 s | "
        "TTFT max s | prefilled on P |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        print(
            f"| {mode} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
            f"{r['stream_tokens_per_s']:.1f} | {r['long_prompts']:.0f} | {r['ttft_p50_s']:.2f} | "
            f"{r['ttft_max_s']:.2f} | {r['split']:.0f} |"
        )
    base = max(results["aggregated"]["itl_p99_ms"], 1e-9)
    for mode in results.keys() - {"aggregated"}:
        ratio = results[mode]["itl_p99_ms"] / base
        target = " (target <= 1.0)" if mode.startswith("ours") else ""
        print(f"ITL p99 {mode} / aggregated: {ratio:.2f}{target}")


if __name__ == "__main__":
    main()
