"""Constrained decoding (issue #15): what a grammar costs a decode step, and what compiling one
costs.

    .venv/bin/python bench/grammar_decode.py [--model-dir models/bench-deepseek-v3] \
        [--concurrency 1 32] [--rounds 3]

1. Decode time per step on the ~73M-parameter benchmark checkpoint (written when missing),
   --concurrency requests started together, --new-tokens each, sampled with fixed seeds: free
   text, every request under a json_schema grammar, and under a tool_choice=required grammar.
   Like with like: all three modes send the same prompts (the chat with the tool definition
   rendered, so the steps attend over the same cache), generate the same number of tokens (both
   schemas include a long string, so no request ends early), and run interleaved for --rounds
   rounds, so that a change in the machine's load hits every mode alike. Per mode the best and the
   median round's wall time per step, and the median process CPU time (which a loaded machine
   inflates less, but OpenMP's spinning threads more); their ratios constrained / free are the
   grammar's share of a step (mask computation, applying it, advancing the matcher). On a shared
   machine the best round is the one least disturbed.
2. The grammar's work alone, in the same rounds: masks computed and applied for as many sequences,
   each matcher advanced, per step, over a 32k-token byte-level BPE vocabulary trained here on
   installed Python sources (the tiny checkpoints' tokenizer has 1k tokens, which would flatter
   the mask), against the free step time of (1) at the same concurrency.
3. Grammar compile time for a typical tool set (8 functions), cold and from the compiler's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import glob
import importlib.metadata
import json
import statistics
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from devtools.tiny_model import write_bench_checkpoint
from infermesh.text.tokenizer import Tokenizer
from worker_svc.config import ParallelSection
from worker_svc.decoding.grammar import GrammarCompiler, apply_masks, lark_grammar
from worker_svc.engine.api import Constraints, GenerationRequest, SamplingParams, Tool
from worker_svc.torch_engine.engine import Engine

_DEFAULT_DIR = Path(__file__).resolve().parents[1] / "models" / "bench-deepseek-v3"
_LONG = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "notes": {"type": "string", "minLength": 4000},
    },
    "required": ["city", "unit", "days", "notes"],
    "additionalProperties": False,
}


def typical_tools() -> tuple[Tool, ...]:
    """Eight functions with the schemas agents send: strings, enums, numbers, arrays, nested
    objects."""

    def obj(props: dict[str, Any], required: list[str]) -> str:
        return json.dumps(
            {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": False,
            }
        )

    s, i = {"type": "string"}, {"type": "integer", "minimum": 0}
    return (
        Tool("get_weather", "", obj({"city": s, "unit": {"enum": ["c", "f"]}}, ["city"])),
        Tool("search_web", "", obj({"query": s, "max_results": i}, ["query"])),
        Tool("read_file", "", obj({"path": s, "offset": i, "limit": i}, ["path"])),
        Tool("write_file", "", obj({"path": s, "content": s}, ["path", "content"])),
        Tool(
            "run_command",
            "",
            obj(
                {
                    "command": s,
                    "timeout_s": {"type": "number"},
                    "env": {"type": "object", "additionalProperties": s},
                },
                ["command"],
            ),
        ),
        Tool(
            "send_email",
            "",
            obj(
                {"to": {"type": "array", "items": s, "minItems": 1}, "subject": s, "body": s},
                ["to", "subject", "body"],
            ),
        ),
        Tool(
            "create_event",
            "",
            obj(
                {
                    "title": s,
                    "start": {"type": "string", "format": "date-time"},
                    "attendees": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"email": s, "optional": {"type": "boolean"}},
                            "required": ["email"],
                        },
                    },
                },
                ["title", "start"],
            ),
        ),
        Tool(
            "query_db",
            "",
            obj(
                {
                    "sql": s,
                    "params": {"type": "array", "items": {"anyOf": [s, i, {"type": "null"}]}},
                },
                ["sql"],
            ),
        ),
    )


@dataclass(frozen=True)
class StepTime:
    wall_s: float
    cpu_s: float  # the process's CPU time (every thread), so other processes' load counts less


async def decode_step_time(
    engine: Engine, prompts: list[str], new_tokens: int, constraints: Constraints
) -> StepTime:
    """Time per decode step with one request per prompt, all together (prefill excluded: timed from
    every first token)."""
    firsts: list[tuple[float, float]] = []

    async def one(i: int, prompt: str) -> int:
        sampling = SamplingParams(max_tokens=new_tokens, seed=i)
        request = GenerationRequest(f"r{i}", None, prompt, sampling, constraints=constraints)
        count = 0
        async for chunk in engine.generate(request):
            if count == 0:
                firsts.append((time.perf_counter(), time.process_time()))
            count += len(chunk.token_ids)
        return count

    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall, cpu = time.perf_counter(), time.process_time()
    assert min(counts) == new_tokens, f"a request ended early: {counts}"
    start_wall, start_cpu = max(firsts)
    return StepTime((wall - start_wall) / (new_tokens - 1), (cpu - start_cpu) / (new_tokens - 1))


def same_prompts(tokenizer: Tokenizer, tool: Tool, n: int) -> list[str]:
    """n chats rendered with the tool's definition, as raw prompts (BOS comes from encoding)."""
    parameters = json.loads(tool.parameters)
    function = {"name": tool.name, "description": tool.description, "parameters": parameters}
    bos = tokenizer.hf.bos_token or ""
    tools = [{"type": "function", "function": function}]
    chats = ([{"role": "user", "content": f"weather in city {i}?"}] for i in range(n))
    return [tokenizer.render_chat(chat, tools).removeprefix(bos) for chat in chats]


@functools.cache
def big_tokenizer() -> PreTrainedTokenizerFast:
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["purelib"]) / "*" / "*.py")))[:1500]
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32000,
        special_tokens=["<s>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((Path(f).read_text(errors="replace") for f in files), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@functools.cache
def json_grammar_32k() -> tuple[llguidance.LLTokenizer, str]:
    hf = big_tokenizer()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
    lark = lark_grammar(Constraints(json_schema=json.dumps(_LONG)), None)
    return lltok, llguidance.LLMatcher.grammar_from_lark(lark)


def grammar_s_per_step(n: int, steps: int) -> float:
    """Median time of one step's grammar work for n sequences over a 32k vocabulary: their masks
    computed and applied, each matcher advanced by its sampled token; along sampled paths of the
    json_schema grammar of _LONG (tool-call markers need the checkpoint's tokens: JSON only)."""
    lltok, grammar = json_grammar_32k()
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(n)]
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(n, lltok.vocab_size, generator=generator)
        start = time.perf_counter()
        masked = apply_masks(logits, matchers)
        mask_s = time.perf_counter() - start
        tokens = torch.multinomial(masked.softmax(-1), 1, generator=generator).flatten().tolist()
        start = time.perf_counter()
        for matcher, token in zip(matchers, tokens, strict=True):
            assert matcher.consume_token(token), matcher.get_error()
        times.append(mask_s + time.perf_counter() - start)
    return statistics.median(times)


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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mask-steps", type=int, default=100)
    ns = parser.parse_args()
    if not (ns.model_dir / "config.json").exists():
        write_bench_checkpoint(ns.model_dir)
    engine = Engine.from_checkpoint(
        ns.model_dir, parallel=ParallelSection(max_parallel=max(ns.concurrency))
    )
    tool = Tool("get_weather", "Weather in a city", json.dumps(_LONG))
    modes = {
        "free": Constraints(),
        "json_schema": Constraints(json_schema=json.dumps(_LONG)),
        "tool_choice=required": Constraints((tool,), "required", parallel_tool_calls=False),
    }
    print(
        f"model {ns.model_dir.name} ({engine.capabilities.precision}, "
        f"{engine.capabilities.device_name}), "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), llguidance "
        f"{importlib.metadata.version('llguidance')}, {ns.new_tokens} new tokens per request, "
        f"{ns.rounds} interleaved rounds"
    )
    print(
        "grammar alone: masks computed and applied, matchers advanced, for as many sequences "
        "over a 32000-token vocabulary (share: of the free step)"
    )
    print(
        "concurrency | mode                 | best wall ms/step (ratio) | median wall (ratio) | "
        "median CPU (ratio) | each round's wall ms"
    )
    json_grammar_32k()  # trains the tokenizer outside the rounds
    for n in ns.concurrency:
        prompts = same_prompts(engine.tokenizer, tool, n)
        asyncio.run(decode_step_time(engine, prompts, 4, Constraints()))  # warm-up
        runs: dict[str, list[StepTime]] = {mode: [] for mode in modes}
        alone = []
        for _ in range(ns.rounds):
            for mode, constraints in modes.items():
                step = decode_step_time(engine, prompts, ns.new_tokens, constraints)
                runs[mode].append(asyncio.run(step))
            alone.append(grammar_s_per_step(n, ns.mask_steps))
        best = {mode: min(r.wall_s for r in rs) for mode, rs in runs.items()}
        wall = {mode: statistics.median(r.wall_s for r in rs) for mode, rs in runs.items()}
        cpu = {mode: statistics.median(r.cpu_s for r in rs) for mode, rs in runs.items()}
        for mode, rs in runs.items():
            best_, wall_, cpu_ = (
                f"{d[mode] * 1e3:7.2f} ({d[mode] / d['free']:.3f})" for d in (best, wall, cpu)
            )
            rounds = " ".join(f"{r.wall_s * 1e3:.1f}" for r in rs)
            print(f"{n:11d} | {mode:20s} | {best_:25s} | {wall_:19s} | {cpu_:18s} | {rounds}")
        grammar, share = min(alone), min(alone) / best["free"]
        rounds = " ".join(f"{a * 1e3:.2f}" for a in alone)
        print(
            f"{n:11d} | grammar alone        | {grammar * 1e3:7.2f} (share {share:.1%}) "
            f"| {'':19s} | {'':18s} | {rounds}"
        )
    cold, cached = compile_s(engine.tokenizer, engine.model.args.vocab_size)
    print(f"compile, 8-tool auto grammar: cold {cold * 1e3:.1f} ms, cached {cached * 1e3:.3f} ms")
    asyncio.run(engine.close())


if __name__ == "__main__":
    main()
