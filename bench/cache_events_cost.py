"""What publishing the torch engine's cache events costs a step (issue #28), on the default model.

    .venv/bin/python bench/cache_events_cost.py [--prompts 8] [--prompt-tokens 512]
        [--max-tokens 32] [--repeats 20]

Serves --prompts distinct prompts at once on the torch engine (models/tiny-deepseek-v3, this
machine's device, one torch thread) and times its steps, on the wall's clock and in this process's
CPU time (which other jobs on a shared machine do not stretch). Prefill steps (each computes up to
prefill_chunk_size prompt tokens and registers the whole blocks they complete): the spans between
the engine's cache-event batches while the prompts prefill, one batch flushed as each step ends,
with the blocks each registered. Decode steps (one block per 16 tokens of each sequence): the
median gap between a sequence's tokens, and the decode phase's CPU over its steps. Then registers
the same prompts' blocks on a BlockManager alone, publishing (prefix_hash names, CacheEvents, one
flush per step) and not, and prints what publishing adds per block and what that is of each kind
of step.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import statistics
import time
from typing import NamedTuple

import torch

from worker_svc.config import DEFAULT_MODEL_PATH
from worker_svc.engine.api import GenerationRequest, SamplingParams
from worker_svc.engine.cache_events import CacheEvents
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


class Tick(NamedTuple):
    """A moment or a span on two clocks: the wall's, and this process's CPU time (every thread's:
    the step loop's, with one torch thread), which the machine's other jobs do not stretch."""

    wall_s: float
    cpu_s: float

    @classmethod
    def now(cls) -> Tick:
        return cls(time.perf_counter(), time.process_time())

    def __sub__(self, other: tuple[float, ...]) -> Tick:
        return Tick(self.wall_s - other[0], self.cpu_s - other[1])


@dataclasses.dataclass(frozen=True)
class Steps:
    prefill: list[tuple[Tick, int]]  # each prefill step's time, and the blocks it registered
    decode: Tick  # one decode step's: the wall's median, the decode phase's CPU over its steps


async def _steps(engine: Engine, prompts: list[str], max_tokens: int) -> Steps:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    flushed: list[tuple[Tick, int]] = []  # when each step's batch came, and its blocks

    async def follow() -> None:
        async for batch in engine.cache_events.subscribe():
            if not batch.snapshot:
                flushed.append((Tick.now(), len(batch.stored)))

    async def one(i: int, prompt: str) -> list[Tick]:
        return [
            Tick.now()
            async for _ in engine.generate(GenerationRequest(str(i), None, prompt, params))
        ]

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0)  # subscribed before the first step
    started = Tick.now()
    runs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    follower.cancel()
    await asyncio.gather(follower, return_exceptions=True)
    prefilled = max((t[0] for t in runs), key=lambda tick: tick.wall_s)  # every prompt's done
    prefill = [(at, blocks) for at, blocks in flushed if at.wall_s <= prefilled.wall_s]
    ends = [started] + [at for at, _ in prefill]
    decoding = [[tick for tick in t if tick.wall_s > prefilled.wall_s] for t in runs]
    last = max((t[-1] for t in runs), key=lambda tick: tick.wall_s)
    gaps = [
        b.wall_s - a.wall_s
        for t in runs
        for a, b in itertools.pairwise(t)
        if a.wall_s >= prefilled.wall_s
    ]
    return Steps(
        [
            (b - a, blocks)
            for (a, b), (_, blocks) in zip(itertools.pairwise(ends), prefill, strict=True)
        ],
        Tick(statistics.median(gaps), (last - prefilled).cpu_s / max(map(len, decoding))),
    )


def _register_s(ids: list[list[int]], events: CacheEvents | None, repeats: int) -> Tick:
    """Time to register every whole block of `ids` (and flush once), the median of repeats; its
    CPU is this thread's, where publishing runs."""
    total_tokens = sum(map(len, ids))
    runs = []
    for _ in range(repeats):
        blocks = BlockManager(total_tokens // 16 + len(ids), 16, True, events)
        tables = [BlockTable() for _ in ids]
        for table, seq in zip(tables, ids, strict=True):
            blocks.allocate(table, len(seq))
        started = Tick(time.perf_counter(), time.thread_time())
        for table, seq in zip(tables, ids, strict=True):
            blocks.cache_full_blocks(table, seq, len(seq))
        if events is not None:
            events.flush()
        runs.append(Tick(time.perf_counter(), time.thread_time()) - started)
    return Tick(statistics.median(r.wall_s for r in runs), statistics.median(r.cpu_s for r in runs))


def _share(per_block: Tick, blocks: float, step: Tick) -> str:
    """What publishing ``blocks`` adds to ``step``, on each clock."""
    return (
        f"{per_block.wall_s * blocks / step.wall_s:.3%} of its wall time, "
        f"{per_block.cpu_s * blocks / step.cpu_s:.3%} of its CPU"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    # one torch thread: a step's CPU time is its own, with no pool spinning between ops
    torch.set_num_threads(1)
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
    per_block = Tick(
        (publishing.wall_s - plain.wall_s) / blocks, (publishing.cpu_s - plain.cpu_s) / blocks
    )
    prefill_step = Tick(
        statistics.median(t.wall_s for t, _ in steps.prefill),
        statistics.median(t.cpu_s for t, _ in steps.prefill),
    )
    prefill_blocks = statistics.median(n for _, n in steps.prefill)
    decode_blocks = args.prompts / 16  # blocks a decode step registers, on average
    print(
        f"device: {engine.capabilities.device_name}, 1 torch thread, "
        f"{args.prompts} prompts of ~{args.prompt_tokens} tokens"
    )
    print(
        f"prefill step (median of {len(steps.prefill)}): {prefill_step.wall_s * 1e3:.1f} ms "
        f"({prefill_step.cpu_s * 1e3:.1f} ms CPU), registers {prefill_blocks:.0f} blocks "
        f"({sum(n for _, n in steps.prefill)} of the {blocks} in all)"
    )
    print(
        f"decode step: {steps.decode.wall_s * 1e3:.1f} ms ({steps.decode.cpu_s * 1e3:.1f} ms CPU), "
        f"registers {decode_blocks:.2f} blocks on average"
    )
    print(
        f"publishing: {per_block.wall_s * 1e6:.2f} us a block ({per_block.cpu_s * 1e6:.2f} us CPU; "
        f"{plain.wall_s * 1e3:.2f} ms -> {publishing.wall_s * 1e3:.2f} ms for {blocks})"
    )
    print(f"publishing adds to a prefill step {_share(per_block, prefill_blocks, prefill_step)}")
    print(f"publishing adds to a decode step {_share(per_block, decode_blocks, steps.decode)}")


if __name__ == "__main__":
    asyncio.run(main())
