"""What the router's side of "no ask decided blind" costs (issue #43): an ask that comes without
block hashes is rendered, tokenized and hashed on the router (infermesh.prompt_tokens, the code
the gateway runs) before its decision; this times that step per ask against the decision itself.

    .venv/bin/python bench/router_tokenize.py [--model-dir models/tiny-deepseek-v3] \
        [--tokens 1000 8000 32000] [--rounds 20] [--workers 1000]

Per prompt size, a chat of about that many tokens (bench/prompt_tokens.py's) asked as text alone:
``PromptTokens.fill`` with the fleet's tokenizer loaded (the tiny checkpoint's, its files served as
a worker serves them; a prompt over THREAD_CHARS characters is tokenized in a thread, so the
router's event loop goes on), and with a simulated fleet's tokens ("bytes:4"); against the
reference in the same run, the decision on the filled request (``Chooser.choose``, balanced, over
``--workers`` workers of bench/router_decision.py's fleet, no prefix index). Medians of --rounds,
microseconds per ask: the wall time an ask waits for its tokens, the event loop thread's CPU time
in it (what tokenizing holds the loop for, the rest is in the thread), the simulated tokens' wall
time, the decision, and the ratio of the wait to the decision.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable

from bench.prompt_tokens import _chat
from bench.router_decision import _MODELS, build_fleet
from infermesh.pb import common_pb2, router_pb2
from infermesh.prompt_tokens import PromptTokens
from infermesh.sim_tokens import SIM_TOKENIZER
from infermesh.text.tokenizer import Tokenizer
from router_svc.config import RoutingSection
from router_svc.routing import Chooser, RouteRequest
from worker_svc.config import DEFAULT_MODEL_PATH


class _OneWorker:
    """A fleet of one worker serving ``model`` with the tokenizer ``digest`` (files: its own)."""

    def __init__(self, model: str, digest: str, files: dict[str, bytes]) -> None:
        info = common_pb2.WorkerInfo(worker_id="w", address="w:1", models=[model])
        info.capabilities.tokenizer = digest
        self._status = router_pb2.WorkerStatus(worker=info)
        self._files = files

    async def list_workers(self) -> list[router_pb2.WorkerStatus]:
        return [self._status]

    async def text_files(self, address: str) -> dict[str, bytes]:
        return self._files


async def _loaded(model: str, digest: str, files: dict[str, bytes]) -> PromptTokens:
    # as the router has it: every prompt tokenized in a thread
    tokens = PromptTokens(_OneWorker(model, digest, files), refresh_s=3600.0, thread_chars=0)
    tokens.learn()
    assert await tokens.loaded_renderer(model) is not None, "the tokenizer did not load"
    return tokens


async def _median_us(work: Callable[[], Awaitable[object]], rounds: int) -> tuple[float, float]:
    """Medians of the wall time and of the event loop thread's CPU time (what the work holds
    the loop for: the rest runs in the tokenizing thread)."""
    walls, loop_cpu = [], []
    for _ in range(rounds):
        started, started_cpu = time.perf_counter(), time.thread_time()
        await work()
        walls.append(time.perf_counter() - started)
        loop_cpu.append(time.thread_time() - started_cpu)
    return statistics.median(walls) * 1e6, statistics.median(loop_cpu) * 1e6


async def _fill_us(
    tokens: PromptTokens, request: common_pb2.GenerateRequest, rounds: int
) -> tuple[float, float]:
    async def fill() -> None:
        ask = common_pb2.GenerateRequest()
        ask.CopyFrom(request)
        await tokens.fill(ask)
        assert ask.prefix_hashes, "not hashed"

    return await _median_us(fill, rounds)


def _decide_us(
    chooser: Chooser, fleet: object, request: common_pb2.GenerateRequest, rounds: int
) -> float:
    times = []
    prefix_bytes = RoutingSection().prefix_bytes
    for _ in range(rounds):
        started = time.perf_counter()
        chooser.choose(fleet, RouteRequest.of(request, prefix_bytes))  # type: ignore[arg-type]
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


async def main_async(args: argparse.Namespace) -> None:
    model = _MODELS[False]
    tokenizer = Tokenizer(args.model_dir)
    files = tokenizer.text_files
    real = await _loaded(model, files.digest, dict(files.files))
    sim = await _loaded(model, SIM_TOKENIZER, {})
    fleet = build_fleet(args.workers, random.Random(1))
    chooser = Chooser(RoutingSection())
    print(f"{args.model_dir} ({files.digest[:19]}...), {args.workers} workers; µs per ask (median)")
    header = ("tokens", "chars", "tokenize+hash", "loop CPU", "sim tokens", "decision", "ratio")
    print(" | ".join(f"{h:>13}" for h in header))
    for i, size in enumerate(args.tokens):
        request = _chat(tokenizer, size, seed=i)
        request.model = model
        chars = sum(len(m.content) for m in request.messages)
        tokenizing = await _fill_us(real, request, args.rounds)
        simulated = await _fill_us(sim, request, args.rounds)
        hashed = common_pb2.GenerateRequest()
        hashed.CopyFrom(request)
        await real.fill(hashed)
        deciding = _decide_us(chooser, fleet, hashed, args.rounds)
        row = (len(hashed.prompt_token_ids), chars, *tokenizing, simulated[0], deciding)
        print(" | ".join([*(f"{v:>13,.0f}" for v in row), f"{tokenizing[0] / deciding:>12.1f}x"]))
    await real.close()
    await sim.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=DEFAULT_MODEL_PATH)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000, 8000, 32000])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1000)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
