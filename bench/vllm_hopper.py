"""vLLM behind the worker against our torch engine on the same device, on the tiny FP8 checkpoint.

    .venv/bin/python bench/vllm_hopper.py [--out-dir /tmp/vllm-hopper] [--prompts 8]

Checks what is installed first: without vLLM it says so and exits 0 (bench/hopper_suite.py records
it). Writes the tiny DeepSeek-V3 checkpoint with DeepSeek's attention head sizes and FP8
block-quantized weights (as the real checkpoint ships) under --out-dir when missing, then serves it
with one worker at a time, `[engine] kind = "vllm"` and `"checkpoint"` (dtype auto: the policy's
choice; the checkpoint engine's fp8 on a Hopper GPU), and writes --out-dir/vllm.json and prints:
- the precision each worker reports (Info): fp8 on a Hopper GPU for both, else what the policy
  chose (vLLM serves a dequantized copy where its FP8 kernels do not run);
- greedy agreement: how many leading greedy tokens the two engines share per prompt (FP8 GEMMs of
  two implementations round differently, so a random model's near-ties may split);
- TTFT and TPOT (p50) at concurrency 1 and --prompts, streamed over gRPC.
The exit status is 1 on a Hopper GPU where either engine did not run FP8.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.vllm_vs_torch import Side, _generate, _prompts, _start_worker
from devtools.tiny_model import write_tiny_checkpoint
from infermesh.pb import common_pb2, worker_pb2
from tests.helpers.worker_client import WorkerClient, worker_client

_Timed = tuple[float, float, list[int]]  # TTFT, TPOT, token ids
_MODEL = "tiny-deepseek-v3-mla-fp8"


async def _timed(
    client: WorkerClient, address: str, model: str, prompt: str, max_tokens: int
) -> _Timed:
    """(TTFT, TPOT, token ids) of one greedy streamed request."""
    started = time.perf_counter()
    first, tokens = await _generate(client, address, model, prompt, max_tokens)
    total = time.perf_counter() - started
    return first, (total - first) / max(len(tokens) - 1, 1), tokens


@dataclasses.dataclass
class _Served:
    precision: str
    device: str
    single: list[_Timed]  # one prompt alone
    batch: list[_Timed]  # all prompts at once


async def _run(port: int, model: str, prompts: list[str], max_tokens: int) -> _Served:
    address = f"127.0.0.1:{port}"
    async with worker_client() as client:
        info = await client.stub(address).Info(worker_pb2.InfoRequest(), timeout=10)
        await _timed(client, address, model, "warm up", 8)
        single = [await _timed(client, address, model, p, max_tokens) for p in prompts[:1]]
        batch = await asyncio.gather(
            *(_timed(client, address, model, p, max_tokens) for p in prompts)
        )
        return _Served(
            precision=common_pb2.Precision.Name(info.worker.capabilities.precision),
            device=info.worker.capabilities.device_name,
            single=single,
            batch=list(batch),
        )


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] == 9


def measure(out_dir: Path, prompts: int, max_tokens: int) -> dict[str, Any]:
    """Serves the tiny FP8 checkpoint with each engine in turn -> the figures, with a printable
    "report"; {"installed": False} without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return {"installed": False, "report": "vLLM is not installed here: nothing measured"}
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = out_dir / _MODEL
    if not (model_dir / "config.json").exists():
        write_tiny_checkpoint(model_dir, mla=True)
    texts = _prompts(prompts)
    served: dict[str, _Served] = {}
    # on Hopper the torch engine serves FP8 even where the policy's measured table keeps its
    # "auto" on BF16 (worker_svc/model/precision.py): FP8 against FP8 is the comparison
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    dtypes = {"vllm": "auto", "checkpoint": "fp8" if hopper else "auto"}
    for kind in ("vllm", "checkpoint"):
        side = Side(kind, kind, {"INFERMESH_WORKER_MODEL_DTYPE": dtypes[kind]})
        proc, port = _start_worker(side, str(model_dir), prompts, out_dir / f"{kind}.log")
        try:
            served[kind] = asyncio.run(_run(port, _MODEL, texts, max_tokens))
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    greedy = [[t for _, _, t in served[k].batch] for k in ("vllm", "checkpoint")]
    agree = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(*greedy, strict=True)
    ]
    result: dict[str, Any] = {"installed": True, "agree": agree, "max_tokens": max_tokens}
    lines = [f"{kind:>10}: {r.precision} on {r.device}" for kind, r in served.items()]
    lines.append(f"greedy tokens identical from the start, per prompt: {agree} of {max_tokens}")
    for label, concurrency in (("single", 1), ("batch", prompts)):
        for kind, r in served.items():
            runs = r.single if label == "single" else r.batch
            ttft = statistics.median(t for t, _, _ in runs) * 1000
            tpot = statistics.median(t for _, t, _ in runs) * 1000
            result[f"{kind} c={concurrency}"] = {"ttft_ms": ttft, "tpot_ms": tpot}
            lines.append(
                f"c={concurrency:<3} {kind:>10}: TTFT p50 {ttft:7.1f} ms  TPOT p50 {tpot:6.2f} ms"
            )
    result |= {f"{kind} precision": r.precision for kind, r in served.items()}
    result["report"] = "\n".join(lines)
    (out_dir / "vllm.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/vllm-hopper"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    result = measure(args.out_dir, args.prompts, args.max_tokens)
    print(result["report"])
    fp8 = all(result.get(f"{k} precision") == "PRECISION_FP8" for k in ("vllm", "checkpoint"))
    if result["installed"] and hopper():
        print(f"FP8 in effect on both: {'yes' if fp8 else 'NO'}")
        return 0 if fp8 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
