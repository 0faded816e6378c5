"""vLLM behind the worker on an H100/H200, against our torch engine on the same GPU.

    .venv/bin/python bench/vllm_hopper.py [--model-dir /tmp/tiny-deepseek-v3-mla-fp8] [--prompts 8]

Needs a Hopper GPU (compute capability 9.x) and the CUDA build of vLLM in .venv. Writes the tiny
DeepSeek-V3 checkpoint with DeepSeek's attention head sizes and FP8 block-quantized weights (as the
real checkpoint ships) when missing, then serves it with one worker at a time, `[engine] kind =
"vllm"` and
`"checkpoint"`, and prints:
- FP8 in effect: the precision each worker reports (Info) must be fp8;
- greedy agreement: how many leading greedy tokens the two engines share per prompt (FP8 GEMMs of
two
  implementations round differently, so a random model's near-ties may split);
- TTFT and TPOT (p50) at concurrency 1 and --prompts, streamed over gRPC.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import grpc
import torch

from bench.vllm_vs_torch import _generate, _prompts, _start_worker
from devtools.tiny_model import write_tiny_checkpoint
from infermesh.pb import common_pb2, worker_pb2, worker_pb2_grpc

_Timed = tuple[float, float, list[int]]  # TTFT, TPOT, token ids


async def _timed(
    stub: worker_pb2_grpc.WorkerStub, model: str, prompt: str, max_tokens: int
) -> _Timed:
    """(TTFT, TPOT, token ids) of one greedy streamed request."""
    started = time.perf_counter()
    first, tokens = await _generate(stub, model, prompt, max_tokens)
    total = time.perf_counter() - started
    return first, (total - first) / max(len(tokens) - 1, 1), tokens


@dataclasses.dataclass
class _Served:
    precision: str
    device: str
    single: list[_Timed]  # one prompt alone
    batch: list[_Timed]  # all prompts at once


async def _run(port: int, model: str, prompts: list[str], max_tokens: int) -> _Served:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        info = await stub.Info(worker_pb2.InfoRequest(), timeout=10)
        await _timed(stub, model, "warm up", 8)
        single = [await _timed(stub, model, p, max_tokens) for p in prompts[:1]]
        batch = await asyncio.gather(*(_timed(stub, model, p, max_tokens) for p in prompts))
        return _Served(
            precision=common_pb2.Precision.Name(info.worker.capabilities.precision),
            device=info.worker.capabilities.device_name,
            single=single,
            batch=list(batch),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="/tmp/tiny-deepseek-v3-mla-fp8")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--log-dir", default="/tmp")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0)[0] != 9:
        sys.exit("needs a Hopper GPU (H100/H200, compute capability 9.x)")
    if not (Path(args.model_dir) / "config.json").exists():
        write_tiny_checkpoint(args.model_dir, mla=True)
    model, prompts = Path(args.model_dir).name, _prompts(args.prompts)
    results: dict[str, _Served] = {}
    for kind in ("vllm", "checkpoint"):
        proc, port = _start_worker(
            kind, args.model_dir, "auto", args.prompts, Path(args.log_dir) / f"{kind}.log"
        )
        try:
            results[kind] = asyncio.run(_run(port, model, prompts, args.max_tokens))
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    for kind, r in results.items():
        print(f"{kind:>10}: {r.precision} on {r.device}")
    fp8 = all(r.precision == "PRECISION_FP8" for r in results.values())
    print(f"FP8 in effect on both: {'yes' if fp8 else 'NO'}")
    greedy = [[t for _, _, t in results[k].batch] for k in ("vllm", "checkpoint")]
    agree = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(*greedy, strict=True)
    ]
    print(f"greedy tokens identical from the start, per prompt: {agree} of {args.max_tokens}")
    for label, c in (("single", 1), ("batch", args.prompts)):
        for kind, r in results.items():
            runs = r.single if label == "single" else r.batch
            ttft = statistics.median(t for t, _, _ in runs) * 1000
            tpot = statistics.median(t for _, t, _ in runs) * 1000
            print(f"c={c:<3} {kind:>10}: TTFT p50 {ttft:7.1f} ms  TPOT p50 {tpot:6.2f} ms")
    if not fp8:
        sys.exit(1)


if __name__ == "__main__":
    main()
