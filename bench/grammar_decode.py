"""Constrained decoding (issue #15): what a grammar costs a decode step, and what compiling one costs.

    .venv/bin/python bench/grammar_decode.py [--model-dir models/bench-deepseek-v3] [--concurrency 1 32]

1. Decode time per token on the ~73M-parameter benchmark checkpoint (written when missing), --concurrency
   requests started together, --new-tokens each, sampled with fixed seeds: free text against every request
   under a json_schema grammar (same prompt), and under a tool_choice=required grammar (its prompt longer by
   the rendered tool definition); both schemas include a long string, so no request ends early. The ratio
   constrained / free is the grammar's share of a step (mask computation, applying it, advancing the
   matcher), measured in the same run.
2. The mask alone: per-step mask time of the same grammar over a 32k-token byte-level BPE vocabulary
   trained here on installed Python sources (the tiny checkpoints' tokenizer has 1k tokens, which would
   flatter the mask), against the free step time of (1).
3. Grammar compile time for a typical tool set (8 functions), cold and from the compiler's cache.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import importlib.metadata
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import llguidance
import llguidance.hf
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_svc.config import ParallelSection  # noqa: E402
from worker_svc.engine import Engine  # noqa: E402
from worker_svc.engine_api import Constraints, GenerationRequest, SamplingParams, Tool  # noqa: E402
from worker_svc.grammar import GrammarCompiler, apply_masks, lark_grammar  # noqa: E402
from infermesh.cli.tiny_model import write_bench_checkpoint  # noqa: E402
from worker_svc.tokenizer import Tokenizer  # noqa: E402

_DEFAULT_DIR = Path(__file__).resolve().parents[1] / "models" / "bench-deepseek-v3"
_LONG = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}, "notes": {"type": "string", "minLength": 4000}},
    "required": ["city", "unit", "days", "notes"], "additionalProperties": False}  # fmt: skip


def typical_tools() -> tuple[Tool, ...]:
    """Eight functions with the schemas agents send: strings, enums, numbers, arrays, nested objects."""
    def obj(props: dict, required: list[str]) -> str:
        return json.dumps({"type": "object", "properties": props, "required": required, "additionalProperties": False})

    s, i = {"type": "string"}, {"type": "integer", "minimum": 0}
    return (
        Tool("get_weather", "", obj({"city": s, "unit": {"enum": ["c", "f"]}}, ["city"])),
        Tool("search_web", "", obj({"query": s, "max_results": i}, ["query"])),
        Tool("read_file", "", obj({"path": s, "offset": i, "limit": i}, ["path"])),
        Tool("write_file", "", obj({"path": s, "content": s}, ["path", "content"])),
        Tool("run_command", "", obj({"command": s, "timeout_s": {"type": "number"}, "env": {
            "type": "object", "additionalProperties": s}}, ["command"])),
        Tool("send_email", "", obj({"to": {"type": "array", "items": s, "minItems": 1}, "subject": s, "body": s},
                                   ["to", "subject", "body"])),
        Tool("create_event", "", obj({"title": s, "start": {"type": "string", "format": "date-time"},
                                      "attendees": {"type": "array", "items": {"type": "object", "properties": {
                                          "email": s, "optional": {"type": "boolean"}}, "required": ["email"]}}},
                                     ["title", "start"])),
        Tool("query_db", "", obj({"sql": s, "params": {"type": "array", "items": {"anyOf": [s, i, {"type": "null"}]}}},
                                 ["sql"])),
    )  # fmt: skip


async def decode_s_per_token(engine: Engine, n: int, new_tokens: int, constraints: Constraints) -> float:
    """Wall time per decode step with n requests together (prefill excluded: timed from every first token)."""
    firsts: list[float] = []

    async def one(i: int) -> int:
        request = GenerationRequest(f"r{i}", [{"role": "user", "content": f"weather in city {i}?"}], None,
                                    SamplingParams(max_tokens=new_tokens, seed=i), constraints=constraints)
        count = 0
        async for chunk in engine.generate(request):
            if count == 0:
                firsts.append(time.perf_counter())
            count += len(chunk.token_ids)
        return count

    counts = await asyncio.gather(*(one(i) for i in range(n)))
    end = time.perf_counter()
    assert min(counts) == new_tokens, f"a request ended early: {counts}"
    return (end - max(firsts)) / (new_tokens - 1)


def big_tokenizer() -> PreTrainedTokenizerFast:
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["purelib"]) / "*" / "*.py")))[:1500]
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((Path(f).read_text(errors="replace") for f in files), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def mask_s_per_step(steps: int) -> tuple[float, float, int]:
    """Median and p99 time to compute and apply one mask over a 32k vocabulary along a sampled path of the
    json_schema grammar of _LONG (tool-call markers need the checkpoint's tokens, so JSON only here)."""
    hf = big_tokenizer()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
    grammar = llguidance.LLMatcher.grammar_from_lark(lark_grammar(Constraints(json_schema=json.dumps(_LONG)), None))
    matcher = llguidance.LLMatcher(lltok, grammar)
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(1, len(hf), generator=generator)
        start = time.perf_counter()
        masked = apply_masks(logits, [matcher])
        times.append(time.perf_counter() - start)
        token = int(torch.multinomial(masked[0].softmax(-1), 1, generator=generator))
        assert matcher.consume_token(token), matcher.get_error()
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))], len(hf)


def compile_s(tokenizer: Tokenizer, vocab_size: int) -> tuple[float, float]:
    """Cold compile of the typical tool set's tool_choice=auto grammar, then a cached one."""
    compiler = GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id or 1])
    constraints = Constraints(typical_tools())
    start = time.perf_counter()
    compiler.matcher(constraints)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher(constraints)
    return cold, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=_DEFAULT_DIR)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--mask-steps", type=int, default=300)
    ns = parser.parse_args()
    if not (ns.model_dir / "config.json").exists():
        write_bench_checkpoint(ns.model_dir)
    engine = Engine.from_checkpoint(ns.model_dir, parallel=ParallelSection(max_parallel=max(ns.concurrency)))
    tool = Tool("get_weather", "Weather in a city", json.dumps(_LONG))
    schema = Constraints(json_schema=json.dumps(_LONG))
    call = Constraints((tool,), "required", parallel_tool_calls=False)
    print(f"model {ns.model_dir.name} ({engine.capabilities.precision}, {engine.capabilities.device_name}), "
          f"torch {torch.__version__}, llguidance {importlib.metadata.version('llguidance')}, "
          f"{ns.new_tokens} new tokens per request")  # fmt: skip
    print("concurrency | free ms/step | json_schema ms/step (ratio) | tool_choice=required ms/step (ratio)")
    free_steps = []
    for n in ns.concurrency:
        asyncio.run(decode_s_per_token(engine, n, 4, Constraints()))  # warm-up
        free = asyncio.run(decode_s_per_token(engine, n, ns.new_tokens, Constraints()))
        shaped = asyncio.run(decode_s_per_token(engine, n, ns.new_tokens, schema))
        called = asyncio.run(decode_s_per_token(engine, n, ns.new_tokens, call))
        free_steps.append(free)
        print(f"{n:11d} | {free * 1e3:12.2f} | {shaped * 1e3:9.2f} ({shaped / free:.3f}) | "
              f"{called * 1e3:9.2f} ({called / free:.3f})")
    cold, cached = compile_s(engine.tokenizer, engine.model.args.vocab_size)
    print(f"compile, 8-tool auto grammar: cold {cold * 1e3:.1f} ms, cached {cached * 1e3:.3f} ms")
    asyncio.run(engine.close())
    median, p99, vocab = mask_s_per_step(ns.mask_steps)
    print(f"mask over a {vocab}-token vocabulary, per sequence and step: median {median * 1e3:.3f} ms, "
          f"p99 {p99 * 1e3:.3f} ms = {median / free_steps[0]:.1%} of a concurrency-1 free step")


if __name__ == "__main__":
    main()
