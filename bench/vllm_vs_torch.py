"""Our torch engine against vLLM on the same checkpoint and CPU, each behind a real worker process.

    .venv/bin/python bench/vllm_vs_torch.py [--model-dir models/tiny-deepseek-v3-mla] [--concurrency
    1 8 32]
    .venv/bin/python bench/vllm_vs_torch.py --fp8 [--model-dir DIR]   # vLLM in FP8 against BF16

vLLM is the engine a user would pick instead of ours, so it is our engine's honest reference. One
worker runs at a time (`[engine] kind = "checkpoint"`, then `"vllm"`), in the same dtype (the
precision policy's for this machine unless --dtype), with the same limits (max_parallel = the
largest concurrency). For each concurrency, that many greedy chat requests of distinct prompts start
together as gRPC Generate streams; aggregate tokens/s is all completion tokens over the wall time
from the start to the last token, TTFT is per request (p50 and p99); each concurrency runs --repeats
times and the median run is shown, after a warm-up of every batch shape. Also prints how many
leading greedy tokens the two engines agree on per prompt (the models' numerics differ from the
first token where they diverge).

`--fp8` compares vLLM with itself instead, on an FP8 checkpoint (the tiny one with DeepSeek's head
sizes, written under --model-dir when missing): its FP8 weights (`use_native_fp8 = true`: a CPU
with AMX) against its BF16 copy (`use_native_fp8 = false`, `dtype = "bfloat16"`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from devtools.tiny_model import CORPUS, write_tiny_checkpoint
from infermesh.pb import common_pb2, worker_pb2, worker_pb2_grpc
from infermesh.ports import free_port
from tests.helpers.worker_client import WorkerClient, worker_client

ROOT = Path(__file__).resolve().parents[1]

_START_TIMEOUT_S = 300.0
_FP8_MODEL_DIR = "models/tiny-deepseek-v3-mla-fp8"


@dataclass(frozen=True)
class Side:
    """One worker of the comparison: its name in the table, engine kind and config overrides."""

    name: str
    kind: str
    env: dict[str, str]


def _sides(args: argparse.Namespace) -> tuple[Side, Side]:
    if not args.fp8:
        dtype = {"INFERMESH_WORKER_MODEL_DTYPE": args.dtype}
        return Side("torch", "checkpoint", dtype), Side("vLLM", "vllm", dtype)
    return (
        Side(
            "vLLM fp8",
            "vllm",
            {
                "INFERMESH_WORKER_MODEL_DTYPE": "auto",
                "INFERMESH_WORKER_QUANTIZATION_USE_NATIVE_FP8": "true",
            },
        ),
        Side(
            "vLLM bf16",
            "vllm",
            {
                "INFERMESH_WORKER_MODEL_DTYPE": "bfloat16",
                "INFERMESH_WORKER_QUANTIZATION_USE_NATIVE_FP8": "false",
                "INFERMESH_WORKER_QUANTIZATION_DEQUANT_CACHE_DIR": str(
                    Path(args.log_dir) / "dequant"
                ),
            },
        ),
    )


@dataclass
class Run:
    concurrency: int
    tokens: int
    wall_s: float
    ttft_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def _prompts(count: int) -> list[str]:
    lines = [line for line in CORPUS.splitlines() if line]
    return [f"Request {i}: {lines[i % len(lines)]}" for i in range(count)]


async def _generate(
    client: WorkerClient, address: str, model: str, prompt: str, max_tokens: int
) -> tuple[float, list[int]]:
    """(TTFT, the token ids) of one greedy streamed request."""
    request = common_pb2.GenerateRequest(
        request_id=f"bench-{time.monotonic_ns()}",
        model=model,
        messages=[common_pb2.ChatMessage(role="user", content=prompt)],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
    )
    started = time.perf_counter()
    first = 0.0
    tokens: list[int] = []
    async for chunk in client.generate(address, request, timeout_s=600):
        if chunk.token_ids and not first:
            first = time.perf_counter() - started
        tokens.extend(chunk.token_ids)
    return first, tokens


async def _measure(
    port: int, model: str, concurrencies: list[int], max_tokens: int, repeats: int
) -> tuple[list[Run], list[list[int]]]:
    """The median run (by tokens/s) of `repeats` per concurrency, and the greedy outputs of up to 8
    prompts."""
    address = f"127.0.0.1:{port}"
    async with worker_client() as client:
        for c in sorted(set(concurrencies)):  # warm up every batch shape once
            await asyncio.gather(*(_generate(client, address, model, p, 8) for p in _prompts(c)))
        runs = []
        greedy: list[list[int]] = []
        for c in concurrencies:
            tries = []
            for _ in range(repeats):
                started = time.perf_counter()
                results = await asyncio.gather(
                    *(_generate(client, address, model, p, max_tokens) for p in _prompts(c))
                )
                wall = time.perf_counter() - started
                tries.append(
                    Run(c, sum(len(t) for _, t in results), wall, [ttft for ttft, _ in results])
                )
            runs.append(sorted(tries, key=lambda r: r.tokens_per_s)[len(tries) // 2])
            if c <= 8 and len(results) > len(greedy):  # the widest run up to 8 prompts
                greedy = [t for _, t in results]
        return runs, greedy


def _start_worker(
    side: Side, model_dir: str, max_parallel: int, log: Path
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {
        **os.environ,
        **side.env,
        "INFERMESH_WORKER_ENGINE_KIND": side.kind,
        "INFERMESH_WORKER_MODEL_PATH": model_dir,
        "INFERMESH_WORKER_SERVER_PORT": str(port),
        "INFERMESH_WORKER_PARALLEL_MAX_PARALLEL": str(max_parallel),
        "INFERMESH_WORKER_ATTENTION_MAX_MODEL_LEN": "1024",
        "INFERMESH_WORKER_ROUTER_ADDRESS": f"127.0.0.1:{free_port()}",
        "INFERMESH_WORKER_TLS_PLAINTEXT": "true",  # its client calls without certificates
    }  # no router: the worker serves anyway
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker_svc"],
        env=env,
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + _START_TIMEOUT_S
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        while True:
            try:
                worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=2)
                return proc, port
            except grpc.RpcError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"{side.name} worker did not start; see {log}") from None
                time.sleep(0.5)


def _serve_and_measure(
    side: Side, args: argparse.Namespace
) -> tuple[float, list[Run], list[list[int]]]:
    started = time.perf_counter()
    log = Path(args.log_dir) / f"{side.name.replace(' ', '-')}.log"
    proc, port = _start_worker(side, args.model_dir, max(args.concurrency), log)
    start_s = time.perf_counter() - started
    try:
        runs, greedy = asyncio.run(
            _measure(
                port, Path(args.model_dir).name, args.concurrency, args.max_tokens, args.repeats
            )
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return start_s, runs, greedy


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="default models/tiny-deepseek-v3-mla (--fp8: -fp8)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per concurrency; the median is shown"
    )
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--fp8", action="store_true", help="vLLM's FP8 against its BF16 copy")
    args = parser.parse_args()
    if args.model_dir is None:
        args.model_dir = _FP8_MODEL_DIR if args.fp8 else "models/tiny-deepseek-v3-mla"
    if args.fp8 and not (Path(args.model_dir) / "config.json").exists():
        write_tiny_checkpoint(args.model_dir, mla=True)
    first, second = _sides(args)
    results = {side.name: _serve_and_measure(side, args) for side in (first, second)}
    a, b = first.name, second.name
    print(
        f"model {args.model_dir}, dtype {args.dtype}, {args.max_tokens} new tokens, greedy; "
        f"{os.cpu_count()} CPUs"
    )
    for name, (start_s, _, _) in results.items():
        print(f"{name:>10} worker start: {start_s:.1f} s")
    print(
        f"{'c':>4} {f'tokens {a}/{b}':>17} {f'{a} tok/s':>12} {f'{b} tok/s':>11} "
        f"{f'{a}/{b}':>11} "
        f"{f'TTFT p50 {a}':>15} {b:>8} {f'TTFT p99 {a}':>15} {b:>8}"
    )
    for ours, theirs in zip(results[a][1], results[b][1], strict=True):
        tokens = f"{ours.tokens}/{theirs.tokens}"
        print(
            f"{ours.concurrency:>4} {tokens:>17} {ours.tokens_per_s:>12.1f} "
            f"{theirs.tokens_per_s:>11.1f} {ours.tokens_per_s / theirs.tokens_per_s:>11.2f} "
            f"{_p(ours.ttft_s, 50) * 1000:>12.0f} ms "
            f"{_p(theirs.ttft_s, 50) * 1000:>5.0f} ms {_p(ours.ttft_s, 99) * 1000:>12.0f} ms "
            f"{_p(theirs.ttft_s, 99) * 1000:>5.0f} ms"
        )
    agree = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(results[a][2], results[b][2], strict=True)
    ]
    print(f"greedy tokens identical from the start, per prompt: {agree} of {args.max_tokens}")


if __name__ == "__main__":
    main()
