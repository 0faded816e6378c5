"""Long prompts' prefill by MLA's attention form (issue #36): the time to the first token of one
fresh prompt when prefill chunks attend over keys and values expanded from the cached latents (the
default) and when they attend absorbed, over the latents, as decode does; both in one run.

    nice -n 10 .venv/bin/python bench/mla_prefill.py [--model-dir models/tiny-deepseek-v3-mla] \
        [--prompt-tokens 3370 13497 32000] [--prefill-chunk-size 256] [--repeats 1]

The engine a worker serves (worker_svc.torch_engine.Engine) in this process, in the dtype the
precision policy picks for this machine, on the tiny model with DeepSeek's MLA sizes (`make
model-mla`: 4 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim and v_head_dim 128).
Each prompt is --prompt-tokens token ids of the benchmark corpus, sent as ids in the engine's
tokenizer, its first token different in every run so that the prefix cache never helps; one new
token, greedy. Each repeat runs the absorbed form, then the expanded one, on the same length.
Prints per length the median TTFT of each form, prefill tokens/s and the ratio expanded / absorbed
(the issue's target: <= 0.25 at 13.5k and 32k tokens), and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import time
from pathlib import Path

import torch

from devtools.tiny_model import CORPUS
from worker_svc.config import CacheSection, ParallelSection
from worker_svc.engine.api import GenerationRequest, SamplingParams
from worker_svc.torch_engine.engine import Engine

_DEFAULT_DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-deepseek-v3-mla"


def prompt_ids(engine: Engine, length: int) -> list[int]:
    """`length` token ids of the corpus, repeated as often as it takes."""
    corpus = engine.tokenizer.encode(CORPUS)
    return list(itertools.islice(itertools.cycle(corpus), length))


async def ttft(engine: Engine, ids: list[int], run: int) -> float:
    """Seconds from the request to its first token; `run` makes the first token its own."""
    request = GenerationRequest(
        f"prefill-{run}",
        None,
        CORPUS,  # not rendered: the ids below are in the engine's own tokenizer
        SamplingParams(temperature=0, max_tokens=1),
        prompt_token_ids=(5 + run, *ids[1:]),
        tokenizer=engine.text_files.digest,
    )
    start, first = time.perf_counter(), 0.0
    async for _ in engine.generate(request):  # one token: one chunk
        first = first or time.perf_counter() - start
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=_DEFAULT_DIR)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[3370, 13497, 32000])
    parser.add_argument("--prefill-chunk-size", type=int, default=256)
    parser.add_argument(
        "--idle-prefill-chunk-size",
        type=int,
        default=ParallelSection.idle_prefill_chunk_size,
        help="prompt tokens per step with nothing decoding (the worker's default)",
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="[model] dtype: auto is the policy's")
    ns = parser.parse_args()
    longest = max(ns.prompt_tokens)
    engine = Engine.from_checkpoint(
        ns.model_dir,
        dtype=ns.dtype,
        max_model_len=longest + 1,
        parallel=ParallelSection(
            max_parallel=1,
            prefill_chunk_size=ns.prefill_chunk_size,
            idle_prefill_chunk_size=max(ns.prefill_chunk_size, ns.idle_prefill_chunk_size),
        ),
        cache=CacheSection(enable_prefix_caching=False),
    )
    print(
        f"load average {os.getloadavg()[0]:.2f} at the start; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {engine.capabilities.device_name}, "
        f"precision {engine.capabilities.precision}, prefill chunks of {ns.prefill_chunk_size}"
    )
    runs = itertools.count()
    asyncio.run(ttft(engine, prompt_ids(engine, 64), next(runs)))  # warm-up
    header = ("tokens", "absorbed s", "tok/s", "expanded s", "tok/s", "ratio")
    print(" ".join(f"{name:>10}" for name in header))
    for length in ns.prompt_tokens:
        ids = prompt_ids(engine, length)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(ns.repeats):
            for absorbed in (True, False):
                engine.model.absorb_prefill = absorbed
                times[absorbed].append(asyncio.run(ttft(engine, ids, next(runs))))
        absorbed_s, expanded_s = (statistics.median(times[form]) for form in (True, False))
        print(
            f"{length:>10} {absorbed_s:>10.2f} {length / absorbed_s:>10.0f} "
            f"{expanded_s:>10.2f} {length / expanded_s:>10.0f} {expanded_s / absorbed_s:>9.2f}x"
        )
    print(f"load average {os.getloadavg()[0]:.2f} at the end (1 minute)")
    asyncio.run(engine.close())


if __name__ == "__main__":
    main()
