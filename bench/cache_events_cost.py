"""What publishing the torch engine's cache events costs a step (issue #28), on the default model.

    .venv/bin/python bench/cache_events_cost.py [--prompts 8] [--prompt-tokens 512]
        [--max-tokens 32] [--repeats 20]

Serves --prompts distinct prompts at once on the torch engine (models/tiny-deepseek-v3, this
machine's device) and times its steps: the first token (the prefill, which registers every whole
block of the prompts) and the mean gap between the next ones (decode steps, which register one
block per 16 tokens of each sequence). Then registers the same prompts' blocks on a BlockManager
alone, publishing (prefix_hash names, CacheEvents, one flush per step) and not, and prints what
publishing adds per block and what that is of each kind of step.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time

from worker_svc.cache_events import CacheEvents
from worker_svc.config import DEFAULT_MODEL_PATH
from worker_svc.engine_api import GenerationRequest, SamplingParams
from worker_svc.torch_engine.engine import Engine
from worker_svc.torch_engine.kv_cache import BlockManager, BlockTable


def _prompts(engine: Engine, count: int, tokens: int) -> list[str]:
    prompts = []
    for i in range(count):
        text = f"Request {i}:"
        while len(engine.tokenizer.encode(text)) < tokens:
            text += f" word{i}x{len(text)}"
        prompts.append(text)
    return prompts


async def _step_times(engine: Engine, prompts: list[str], max_tokens: int) -> tuple[float, float]:
    """Seconds to the first token (the prefill) and the median gap between the later ones."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)

    async def one(i: int, prompt: str) -> list[float]:
        times = []
        async for _ in engine.generate(GenerationRequest(str(i), None, prompt, params)):
            times.append(time.perf_counter())
        return times

    started = time.perf_counter()
    runs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    first = statistics.median(t[0] - started for t in runs)
    gaps = [b - a for t in runs for a, b in itertools.pairwise(t)]
    return first, statistics.median(gaps)


def _register_s(ids: list[list[int]], events: CacheEvents | None, repeats: int) -> float:
    """Seconds to register every whole block of `ids` (and flush once), the median of repeats."""
    total_tokens = sum(map(len, ids))
    runs = []
    for _ in range(repeats):
        blocks = BlockManager(total_tokens // 16 + len(ids), 16, True, events)
        tables = [BlockTable() for _ in ids]
        for table, seq in zip(tables, ids, strict=True):
            blocks.allocate(table, len(seq))
        started = time.perf_counter()
        for table, seq in zip(tables, ids, strict=True):
            blocks.cache_full_blocks(table, seq, len(seq))
        if events is not None:
            events.flush()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    engine = Engine.from_checkpoint(DEFAULT_MODEL_PATH)
    try:
        prompts = _prompts(engine, args.prompts, args.prompt_tokens)
        await _step_times(engine, _prompts(engine, 2, 64), 4)  # warm up
        prefill_s, decode_s = await _step_times(engine, prompts, args.max_tokens)
        ids = [engine.tokenizer.encode(p) for p in prompts]
    finally:
        await engine.close()
    blocks = sum(len(seq) // 16 for seq in ids)
    plain = _register_s(ids, None, args.repeats)
    publishing = _register_s(ids, CacheEvents(), args.repeats)
    per_block_s = (publishing - plain) / blocks
    decode_blocks = args.prompts / 16  # blocks a decode step registers, on average
    caps = engine.capabilities
    print(f"device: {caps.device_name}, {args.prompts} prompts of ~{args.prompt_tokens} tokens")
    print(f"prefill (to the first token): {prefill_s * 1e3:.1f} ms, registers {blocks} blocks")
    print(f"decode step: {decode_s * 1e3:.2f} ms, registers {decode_blocks:.2f} blocks on average")
    print(
        f"publishing: {per_block_s * 1e6:.2f} us a block "
        f"({plain * 1e3:.2f} ms -> {publishing * 1e3:.2f} ms for {blocks})"
    )
    print(
        f"overhead: prefill {per_block_s * blocks / prefill_s:.3%}, "
        f"decode {per_block_s * decode_blocks / decode_s:.3%}"
    )


if __name__ == "__main__":
    asyncio.run(main())
