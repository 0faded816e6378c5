"""What publishing the torch engine's cache events costs a step (issue #28), on the default model.

    .venv/bin/python bench/cache_events_cost.py [--prompts 8] [--prompt-tokens 512]
        [--max-tokens 32] [--repeats 20]

Serves --prompts distinct prompts at once on the torch engine (models/tiny-deepseek-v3, this
machine's device) and times its steps. Prefill steps (each computes up to prefill_chunk_size
prompt tokens and registers the whole blocks they complete): the gaps between the engine's
cache-event batches while the prompts prefill, one batch flushed as each step ends, with the
blocks each registered. Decode steps (one block per 16 tokens of each sequence): the median gap
between a sequence's tokens. Then registers the same prompts' blocks on a BlockManager alone,
publishing (prefix_hash names, CacheEvents, one flush per step) and not, and prints what
publishing adds per block and what that is of each kind of step, as measured.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Steps:
    prefill_s: list[float]  # each prefill step's time
    prefill_blocks: list[int]  # the blocks each of those registered
    decode_s: float  # the median gap between a sequence's tokens once all have their first


async def _steps(engine: Engine, prompts: list[str], max_tokens: int) -> Steps:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    flushed: list[tuple[float, int]] = []  # (when, blocks stored) of each step's batch

    async def follow() -> None:
        async for batch in engine.cache_events.subscribe():
            if not batch.snapshot:
                flushed.append((time.perf_counter(), len(batch.stored)))

    async def one(i: int, prompt: str) -> list[float]:
        times = []
        async for _ in engine.generate(GenerationRequest(str(i), None, prompt, params)):
            times.append(time.perf_counter())
        return times

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0)  # subscribed before the first step
    started = time.perf_counter()
    runs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    follower.cancel()
    await asyncio.gather(follower, return_exceptions=True)
    prefilled = max(t[0] for t in runs)  # every prompt's last chunk is done
    prefill = [(at, blocks) for at, blocks in flushed if at <= prefilled]
    ends = [started] + [at for at, _ in prefill]
    gaps = [b - a for t in runs for a, b in itertools.pairwise(t) if a >= prefilled]
    return Steps(
        [b - a for a, b in itertools.pairwise(ends)],
        [blocks for _, blocks in prefill],
        statistics.median(gaps),
    )


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
        await _steps(engine, _prompts(engine, 2, 64), 4)  # warm up
        steps = await _steps(engine, prompts, args.max_tokens)
        ids = [engine.tokenizer.encode(p) for p in prompts]
    finally:
        await engine.close()
    blocks = sum(len(seq) // 16 for seq in ids)
    plain = _register_s(ids, None, args.repeats)
    publishing = _register_s(ids, CacheEvents(), args.repeats)
    per_block_s = (publishing - plain) / blocks
    decode_blocks = args.prompts / 16  # blocks a decode step registers, on average
    prefill_s = statistics.median(steps.prefill_s)
    shares = [
        per_block_s * n / step_s
        for step_s, n in zip(steps.prefill_s, steps.prefill_blocks, strict=True)
    ]
    print(
        f"device: {engine.capabilities.device_name}, "
        f"{args.prompts} prompts of ~{args.prompt_tokens} tokens"
    )
    print(
        f"prefill: {len(steps.prefill_s)} steps, median {prefill_s * 1e3:.1f} ms "
        f"({min(steps.prefill_s) * 1e3:.1f}-{max(steps.prefill_s) * 1e3:.1f}), "
        f"registering {statistics.median(steps.prefill_blocks):.0f} blocks each "
        f"({sum(steps.prefill_blocks)} of the {blocks} in all)"
    )
    print(
        f"decode step: {steps.decode_s * 1e3:.2f} ms, "
        f"registers {decode_blocks:.2f} blocks on average"
    )
    print(
        f"publishing: {per_block_s * 1e6:.2f} us a block "
        f"({plain * 1e3:.2f} ms -> {publishing * 1e3:.2f} ms for {blocks})"
    )
    print(
        f"overhead: a prefill step {statistics.median(shares):.3%} (median; "
        f"{min(shares):.3%}-{max(shares):.3%}), "
        f"a decode step {per_block_s * decode_blocks / steps.decode_s:.3%}"
    )


if __name__ == "__main__":
    asyncio.run(main())
