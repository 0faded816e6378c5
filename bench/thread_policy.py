"""The worker's CPU thread policy under contention (issue #30): torch's OpenMP threads and their
wait policy, with the load generator on the same machine as the mesh.

    .venv/bin/python bench/thread_policy.py [--aiperf /tmp/aiperf/bin/aiperf] [--rounds 3] \
        [--burner N] [--settings policy torch-default ...]

Per round, for each thread setting (in an order rotated each round, so that a noisy minute does not
land on one setting only): starts the `make run` mesh (devtools.mesh: Redis, router, one checkpoint
worker on the tiny default model, gateway; the dev mesh's worker settings under the setting's own),
then measures

- quiet: one streamed chat at a time, 8 requests, none started after 20 s (a light client: the
  machine as quiet as the mesh leaves it), the reference for inter-token latency;
- load: streamed chat, concurrency 4, 40 requests, ~200 prompt tokens, 64 output tokens, none
  started after 60 s, by NVIDIA's aiperf when --aiperf names its executable (server token
  counts), else by this script's own aiohttp client; --burner N adds N processes spinning on the
  CPU while it runs.

Each row prints os.getloadavg()'s 1-minute figure taken as the run starts (other work on the machine
shows there), TTFT p50, ITL p50 ((latency - TTFT) / (output tokens - 1) per request, as aiperf
defines it) and output tokens/s (all output tokens over the run's wall time). The summary gives
median and best over the rounds, and checks the target: under load, the policy's ITL p50 at most 2x
its quiet one, and its tokens/s at least 0.7x the best setting's, medians of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

import aiohttp

from devtools.mesh import Mesh, MeshSpec, dev_worker_env
from devtools.redis_server import RedisServer
from gateway.accounts.keys import create_key_at
from infermesh.ports import free_port
from worker_svc.config import DEFAULT_MODEL_PATH
from worker_svc.torch_engine.threads import available_cores

_MODEL = Path(DEFAULT_MODEL_PATH).name
_PROMPT_WORDS = 190  # ~200 prompt tokens with the chat template (the tiny tokenizer)
_OUTPUT_TOKENS = 64
_ENGINE = "INFERMESH_WORKER_ENGINE_"
# No request starts later into a run (a slow setting's 40 requests would take minutes); its figures
# are over the requests it served.
_ISSUE_FOR_S = 60.0
_QUIET_ISSUE_FOR_S = 20.0

_CORES = str(available_cores())
# name -> the worker's variables on top of the dev mesh's
SETTINGS: dict[str, dict[str, str]] = {
    "policy": {},  # what `make run` gives its worker
    "torch-default": {  # before the policy: one thread per core, libgomp's own waiting
        f"{_ENGINE}THREADS": _CORES,
        f"{_ENGINE}OMP_WAIT_POLICY": "runtime",
    },
    "1-thread": {f"{_ENGINE}THREADS": "1"},
    "all-passive": {
        f"{_ENGINE}THREADS": _CORES,
        f"{_ENGINE}OMP_WAIT_POLICY": "passive",
    },
    "all-active": {
        f"{_ENGINE}THREADS": _CORES,
        f"{_ENGINE}OMP_WAIT_POLICY": "active",
    },
    "all-bound": {  # one thread per core, each bound to its core
        f"{_ENGINE}THREADS": _CORES,
        f"{_ENGINE}OMP_WAIT_POLICY": "runtime",
        "OMP_PROC_BIND": "close",
        "OMP_PLACES": "cores",
    },
}


@dataclasses.dataclass(frozen=True)
class Run:
    setting: str
    condition: str  # quiet or load
    load_avg: float
    ttft_ms: float  # p50
    itl_ms: float  # p50
    tokens_per_s: float


@dataclasses.dataclass(frozen=True)
class _Request:
    ttft_s: float
    latency_s: float
    output_tokens: int


def _prompt(i: int) -> str:
    """A distinct prompt per request (its first words): the prefix cache does not serve it."""
    words = " ".join(f"word{(i * 7 + n) % 97}" for n in range(_PROMPT_WORDS))
    return f"request {i}: {words}"


async def _stream_one(session: aiohttp.ClientSession, url: str, key: str, prompt: str) -> _Request:
    body = {
        "model": _MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": _OUTPUT_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = None
    tokens = 0
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as reply:
        reply.raise_for_status()
        async for line in reply.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif first is None and event.get("choices"):
                first = time.perf_counter()
    ended = time.perf_counter()
    assert first is not None, "a stream without a chunk"
    return _Request(first - started, ended - started, tokens)


async def _own_load(
    base_url: str, key: str, concurrency: int, requests: int, issue_for_s: float
) -> Run:
    """Closed-loop clients streaming ``requests`` chats in all, none started past ``issue_for_s``;
    the Run's setting and condition are filled in by the caller."""
    url = f"{base_url}/chat/completions"
    todo = iter(range(requests))
    done: list[_Request] = []
    deadline = time.perf_counter() + issue_for_s

    async def client(session: aiohttp.ClientSession) -> None:
        for i in todo:
            if time.perf_counter() > deadline:
                return
            done.append(await _stream_one(session, url, key, _prompt(i)))

    load_avg = os.getloadavg()[0]
    async with aiohttp.ClientSession() as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return Run(
        "",
        "",
        load_avg,
        statistics.median(r.ttft_s for r in done) * 1e3,
        statistics.median((r.latency_s - r.ttft_s) / max(1, r.output_tokens - 1) for r in done)
        * 1e3,
        sum(r.output_tokens for r in done) / wall,
    )


def _aiperf_load(aiperf: str, base_url: str, key: str, out: Path) -> Run:
    """The load by aiperf (concurrency 4, 40 requests, 200 prompt / 64 output tokens)."""
    load_avg = os.getloadavg()[0]
    subprocess.run(
        [
            aiperf,
            "profile",
            "--model",
            _MODEL,
            "--url",
            base_url.removesuffix("/v1"),
            "--endpoint-type",
            "chat",
            "--streaming",
            "--concurrency",
            "4",
            "--request-count",
            "40",
            "--benchmark-duration",
            str(_ISSUE_FOR_S),
            "--benchmark-grace-period",
            "60",
            "--isl",
            "200",
            "--isl-stddev",
            "0",
            "--osl",
            str(_OUTPUT_TOKENS),
            "--osl-stddev",
            "0",
            "--tokenizer",
            DEFAULT_MODEL_PATH,
            "--use-server-token-count",
            "--api-key",
            key,
            "--artifact-dir",
            str(out),
            "--ui-type",
            "none",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=900,
    )
    export = json.loads((out / "profile_export_aiperf.json").read_text())
    return Run(
        "",
        "",
        load_avg,
        export["time_to_first_token"]["p50"],
        export["inter_token_latency"]["p50"],
        export["output_token_throughput"]["avg"],
    )


@contextmanager
def _burners(count: int) -> Iterator[None]:
    """``count`` processes spinning on the CPU while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _mesh(redis_url: str, log_dir: Path, worker_env: Mapping[str, str]) -> Mesh:
    return Mesh(
        MeshSpec(
            redis_url=redis_url,
            model_path=DEFAULT_MODEL_PATH,
            gateway_port=free_port(),
            router_port=free_port(),
            worker_ports=(free_port(),),
            env={"INFERMESH_LOG_FORMAT": "text"},
            worker_env=({**dev_worker_env(), **worker_env},),
            log_dir=log_dir,
            certs=log_dir / "certs",  # mutual TLS on every hop, as `make run`
        )
    )


def _measure(
    setting: str, redis_url: str, work: Path, aiperf: str | None, burner: int
) -> list[Run]:
    log_dir = Path(tempfile.mkdtemp(prefix=f"{setting}-", dir=work))
    with _mesh(redis_url, log_dir, SETTINGS[setting]) as mesh:
        base_url = mesh.spec.base_url
        key = asyncio.run(create_key_at(redis_url, f"bench {setting}"))
        # warm-up: the first forward passes
        asyncio.run(_own_load(base_url, key, 1, 2, _QUIET_ISSUE_FOR_S))
        quiet = asyncio.run(_own_load(base_url, key, 1, 8, _QUIET_ISSUE_FOR_S))
        with _burners(burner):
            if aiperf:
                load = _aiperf_load(aiperf, base_url, key, log_dir / "aiperf")
            else:
                load = asyncio.run(_own_load(base_url, key, 4, 40, _ISSUE_FOR_S))
        threads_line = next(
            line for line in mesh.log("worker0").splitlines() if "torch threads:" in line
        )
    print(f"    {setting}: {threads_line[threads_line.index('torch threads:') :]}")
    return [
        dataclasses.replace(quiet, setting=setting, condition="quiet"),
        dataclasses.replace(load, setting=setting, condition="load"),
    ]


def _row(run: Run) -> str:
    return (
        f"| {run.setting} | {run.condition} | {run.load_avg:.1f} | {run.ttft_ms:.1f} | "
        f"{run.itl_ms:.2f} | {run.tokens_per_s:.1f} |"
    )


def _summary(runs: list[Run], settings: list[str]) -> dict[tuple[str, str], Run]:
    """Per (setting, condition): the median of each figure over the rounds; prints it with the
    best tokens/s."""
    print(
        "\n| setting | condition | TTFT p50 ms (median) | ITL p50 ms (median, best) "
        "| tok/s (median, best) |"
    )
    print("|---|---|---:|---:|---:|")
    medians = {}
    for setting in settings:
        for condition in ("quiet", "load"):
            mine = [r for r in runs if r.setting == setting and r.condition == condition]
            median = Run(
                setting,
                condition,
                statistics.median(r.load_avg for r in mine),
                statistics.median(r.ttft_ms for r in mine),
                statistics.median(r.itl_ms for r in mine),
                statistics.median(r.tokens_per_s for r in mine),
            )
            medians[setting, condition] = median
            print(
                f"| {setting} | {condition} | {median.ttft_ms:.1f} | {median.itl_ms:.2f}, "
                f"{min(r.itl_ms for r in mine):.2f} | {median.tokens_per_s:.1f}, "
                f"{max(r.tokens_per_s for r in mine):.1f} |"
            )
    return medians


def _verdict(medians: dict[tuple[str, str], Run], settings: list[str]) -> None:
    if "policy" not in settings:
        return
    quiet, load = medians["policy", "quiet"], medians["policy", "load"]
    best = max(settings, key=lambda s: medians[s, "load"].tokens_per_s)
    itl_ratio = load.itl_ms / quiet.itl_ms
    tps_ratio = load.tokens_per_s / medians[best, "load"].tokens_per_s
    print(
        f"\npolicy under load: ITL p50 {load.itl_ms:.2f} ms = {itl_ratio:.2f}x its quiet "
        f"{quiet.itl_ms:.2f} ms (target <= 2x: {'met' if itl_ratio <= 2 else 'NOT met'}); "
        f"{load.tokens_per_s:.1f} tok/s = {tps_ratio:.2f}x the best setting's ({best}, "
        f"{medians[best, 'load'].tokens_per_s:.1f}) (target >= 0.7x: "
        f"{'met' if tps_ratio >= 0.7 else 'NOT met'})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aiperf", help="aiperf's executable (e.g. /tmp/aiperf/bin/aiperf)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burner", type=int, default=0, help="CPU-spinning processes under load")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ns = parser.parse_args()
    print(
        f"load generator: {'aiperf ' + ns.aiperf if ns.aiperf else 'own aiohttp client'}, "
        f"burner {ns.burner}, {_CORES} cores, torch {version('torch')}, "
        f"{ns.rounds} rounds"
    )
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="thread-policy-") as tmp:
        work = Path(tmp)
        with RedisServer(workdir=work) as redis_server:
            print("| setting | condition | load avg | TTFT p50 ms | ITL p50 ms | tok/s |")
            print("|---|---|---:|---:|---:|---:|")
            for round_ in range(ns.rounds):
                shift = round_ % len(ns.settings)
                for setting in ns.settings[shift:] + ns.settings[:shift]:
                    measured = _measure(setting, redis_server.url, work, ns.aiperf, ns.burner)
                    runs += measured
                    for run in measured:
                        print(_row(run), flush=True)
    medians = _summary(runs, ns.settings)
    _verdict(medians, ns.settings)


if __name__ == "__main__":
    main()
