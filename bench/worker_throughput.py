"""Worker scheduler throughput (issue #3): our continuous-batching engine vs transformers'
generate().

    .venv/bin/python bench/worker_throughput.py [--model-dir models/bench-deepseek-v3] \
        [--concurrency 1 8 32]

On the ~73M-parameter benchmark checkpoint (written by `devtools.tiny_model --bench` when
missing), in the dtype the precision policy picks for this machine, greedy, prompts of
--prompt-tokens tokens (distinct from their first token, so the prefix cache does not help) and
--new-tokens new tokens:

- ours: --concurrency requests started together through Engine.generate(); aggregate tokens/s is
  all completion tokens over the wall time from the start to the last token; TTFT per request;
- transformers: DeepseekV3ForCausalLM (DeepseekV2ForCausalLM for a deepseek_v2 --model-dir, e.g.
  `make model-v2`'s) loaded by transformers from the same checkpoint, generate() on a static
  batch of the same prompts (its best case for that many concurrent requests), timed the same way.

Prints a table with the ratio ours / transformers, TTFT p50/p99, peak RSS (after our runs, then
after transformers'), and the KV cache bytes per token against an un-absorbed per-head cache.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import time
from pathlib import Path

import torch
from transformers import PreTrainedModel

from devtools.tiny_model import CORPUS, write_bench_checkpoint
from tests.helpers.hf_reference import transformers_reference
from worker_svc.config import ParallelSection
from worker_svc.engine.api import GenerationRequest, SamplingParams
from worker_svc.torch_engine.engine import Engine
from worker_svc.torch_engine.kv_cache import bytes_per_token, unabsorbed_bytes_per_token

_DEFAULT_DIR = Path(__file__).resolve().parents[1] / "models" / "bench-deepseek-v3"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def prompts(engine: Engine, count: int, length: int) -> list[str]:
    """`count` prompts of exactly `length` tokens (BOS included), each from a different first
    word."""
    words = list(dict.fromkeys(CORPUS.split()))
    out = []
    for i in range(count):
        text, j = words[i], i
        while (n := len(engine.tokenizer.encode(text))) < length and j < i + 50 * length:
            j += 1
            candidate = f"{text} {words[j % len(words)]}"
            if len(engine.tokenizer.encode(candidate)) <= length:
                text = candidate
        assert n == length, f"no {length}-token prompt starting with {words[i]!r}"
        out.append(text)
    return out


async def run_ours(
    engine: Engine, texts: list[str], new_tokens: int
) -> tuple[float, list[float], int]:
    """(wall seconds, TTFT per request, completion tokens) for all prompts at once."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    start = time.perf_counter()

    async def one(i: int, text: str) -> tuple[float, int]:
        ttft, tokens = 0.0, 0
        async for chunk in engine.generate(GenerationRequest(f"bench-{i}", None, text, params)):
            if not tokens:
                ttft = time.perf_counter() - start
            tokens = chunk.completion_tokens
        return ttft, tokens

    results = await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
    return time.perf_counter() - start, [r[0] for r in results], sum(r[1] for r in results)


def run_hf(hf: PreTrainedModel, ids: torch.Tensor, new_tokens: int) -> tuple[float, int]:
    """(wall seconds, completion tokens) of one generate() over the batch `ids` [B, S]."""
    start = time.perf_counter()
    with torch.inference_mode():
        # the model is a *ForCausalLM typed as PreTrainedModel, which has no generate()
        out = hf.generate(  # type: ignore[operator]
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )
    return time.perf_counter() - start, (out.size(1) - ids.size(1)) * ids.size(0)


def percentile(values: list[float], q: int) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=_DEFAULT_DIR)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    ns = parser.parse_args()
    if not (ns.model_dir / "config.json").exists():
        print(f"writing the benchmark checkpoint to {ns.model_dir}")
        write_bench_checkpoint(ns.model_dir)
    engine = Engine.from_checkpoint(
        ns.model_dir, parallel=ParallelSection(max_parallel=max(ns.concurrency))
    )
    dtype = engine.model.lm_head.weight.dtype
    print(
        f"load average {os.getloadavg()[0]:.2f} at the start; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {engine.capabilities.device_name}, "
        f"precision {engine.capabilities.precision}, "
        f"{sum(p.numel() for p in engine.model.parameters()) / 1e6:.1f}M parameters"
    )
    texts = prompts(engine, max(ns.concurrency), ns.prompt_tokens)
    asyncio.run(run_ours(engine, texts[:2], 4))  # warm-up
    ours: dict[int, tuple[float, list[float], int]] = {}
    for c in ns.concurrency:
        ours[c] = asyncio.run(run_ours(engine, texts[:c], ns.new_tokens))
    rss_ours = peak_rss_mib()
    # its step-loop thread ends: transformers computes alone (Engine.from_checkpoint)
    asyncio.run(engine.close())

    # the checkpoint as transformers loads it, in our dtype
    # transformers types to() as taking the model itself
    hf = transformers_reference(ns.model_dir).to(dtype)  # type: ignore[arg-type]
    hf.set_attn_implementation("sdpa")  # transformers' default attention (the test pins eager)
    ids = torch.tensor([engine.tokenizer.encode(t) for t in texts])
    run_hf(hf, ids[:1], 4)  # warm-up
    theirs = {c: run_hf(hf, ids[:c], ns.new_tokens) for c in ns.concurrency}
    rss_all = peak_rss_mib()

    print(
        f"\n{ns.prompt_tokens}-token prompts, {ns.new_tokens} "
        f"new tokens, greedy; aggregate tokens/s = "
        "completion tokens / wall time from the start to the last token"
    )
    print(
        f"{'concurrency':>11} {'ours tok/s':>11} {'hf tok/s':>9} "
        f"{'ratio':>6} {'ttft p50 s':>10} {'ttft p99 s':>10}"
        f" {'ours tokens':>11}"
    )
    for c in ns.concurrency:
        wall, ttfts, tokens = ours[c]
        hf_wall, hf_tokens = theirs[c]
        rate, hf_rate = tokens / wall, hf_tokens / hf_wall
        print(
            f"{c:>11} {rate:>11.1f} {hf_rate:>9.1f} "
            f"{rate / hf_rate:>5.2f}x {percentile(ttfts, 50):>10.3f} "
            f"{percentile(ttfts, 99):>10.3f} {tokens:>11}"
        )
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end (1 minute)")
    args = engine.model.args
    ours_kv, per_head_kv = bytes_per_token(args, dtype), unabsorbed_bytes_per_token(args, dtype)
    print(
        f"\npeak RSS: {rss_ours:.0f} MiB after our runs, "
        f"{rss_all:.0f} MiB with transformers' model too"
    )
    print(
        f"KV cache per token ({dtype}): {ours_kv} bytes latent "
        f"(kv_lora_rank + qk_rope_head_dim per layer) vs "
        f"{per_head_kv} bytes per-head K/V: {per_head_kv / ours_kv:.1f}x smaller"
    )


if __name__ == "__main__":
    main()
