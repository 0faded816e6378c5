"""What the default chat model does with prompts its training never saw (issue #36), through the
whole mesh, greedy, with the openai SDK.

    .venv/bin/python bench/chat_model.py [--model models/tiny-deepseek-v3-chat] [--cases 40]
        [--base-url http://127.0.0.1:8000 --api-key sk-... --served-name NAME]

Without --base-url it starts Redis, the router, one worker on --model (the torch engine) and the
gateway as processes (devtools.mesh), with a key of its own. The held-out requests come from
devtools.chat_model.corpus.eval_cases (phrasings and values the training split never uses), --cases
of each kind, every one with max_tokens 64 and temperature 0:
- short: instructions, greetings, a persona's questions, a coding agent's prompt with its tools;
- tool: three tools, a question one of them answers (tool_choice auto, no grammar forcing a call);
- recall: a name told in the first turn, asked for one to three turns later;
- json: a JSON schema in the system prompt, no response_format (no constrained decoding);
and --long-cases greetings behind a coding agent's 8k-token system prompt with 16 tools (the
training's dialogues are at most 1,280 tokens long).
Prints the share of the replies that end (finish_reason stop or tool_calls) within the 64 tokens,
of tool questions answered by a call of the right tool with the question's arguments (and by a
call of the right tool whatever its arguments), of recall questions whose answer holds the name,
of JSON answers valid against the schema, and of the long prompts' replies that end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import jsonschema
import openai

from devtools.chat_model import SERVED_PATH
from devtools.chat_model.corpus import EvalCase, eval_cases
from devtools.mesh import one_worker_mesh

KINDS = ("short", "tool", "recall", "json")
LONG = "long"
MAX_TOKENS = 64
_SEED = 2026


def judge(case: EvalCase, reply: Any) -> tuple[bool, bool]:
    """(the reply ended within MAX_TOKENS, it is right for its kind)."""
    choice = reply.choices[0]
    ended = choice.finish_reason in ("stop", "tool_calls")
    message = choice.message
    if case.kind == "tool":
        calls = message.tool_calls or []
        if not calls:
            return ended, False
        try:
            arguments = json.loads(calls[0].function.arguments)
        except json.JSONDecodeError:
            return ended, False
        return ended, calls[0].function.name == case.tool and arguments == case.arguments
    text = message.content or ""
    if case.kind == "recall":
        return ended, case.recall.lower() in text.lower()
    if case.kind == "json":
        try:
            jsonschema.validate(json.loads(text), case.schema or {})
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return ended, False
        return ended, True
    return ended, ended


async def run(
    base_url: str, api_key: str, model: str, cases: int, long_cases: int, concurrency: int
) -> None:
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=300
    )
    todo = [case for kind in KINDS for case in eval_cases(kind, cases, _SEED)]
    todo += eval_cases(LONG, long_cases, _SEED)
    results: dict[str, list[tuple[bool, bool, int]]] = defaultdict(list)
    examples: dict[str, str] = {}
    tools_named: list[bool] = []  # a tool question's first call names its tool, whatever its args
    gate = asyncio.Semaphore(concurrency)

    async def ask(case: EvalCase) -> None:
        async with gate:
            reply = await client.chat.completions.create(
                model=model,
                messages=case.messages,  # type: ignore[arg-type]
                tools=case.tools or openai.omit,  # type: ignore[arg-type]
                temperature=0,
                max_tokens=MAX_TOKENS,
            )
        ended, right = judge(case, reply)
        tokens = reply.usage.completion_tokens if reply.usage else 0
        results[case.kind].append((ended, right, tokens))
        message = reply.choices[0].message
        if case.kind == "tool":
            named = [c.function.name for c in message.tool_calls or [] if c.type == "function"]
            tools_named.append(named[:1] == [case.tool])
        calls = [
            f"{c.function.name}({c.function.arguments})"
            for c in message.tool_calls or []
            if c.type == "function"
        ]
        examples.setdefault(
            case.kind,
            f"{case.messages[-1]['content']!r} -> {message.content or ''!r} {' '.join(calls)}",
        )

    started = time.monotonic()
    await asyncio.gather(*(ask(case) for case in todo))
    wall = time.monotonic() - started
    every = [r for kind in KINDS for r in results[kind]]
    print(f"{len(every)} held-out requests, greedy, max_tokens {MAX_TOKENS}, {wall:.0f} s")
    ended = sum(e for e, _, _ in every)
    mean = sum(t for _, _, t in every) / len(every)
    print(
        f"ended within {MAX_TOKENS} tokens: {ended}/{len(every)} = {ended / len(every):.0%} "
        f"(mean {mean:.1f} completion tokens)"
    )
    labels = {
        "tool": "right tool with the right arguments (of 3 tools)",
        "recall": "recall of a name from an earlier turn",
        "json": "JSON valid against the system prompt's schema, unconstrained",
    }
    for kind, label in labels.items():
        right = sum(r for _, r, _ in results[kind])
        print(f"{label}: {right}/{len(results[kind])} = {right / len(results[kind]):.0%}")
    named = sum(tools_named)
    print(
        f"right tool named, whatever its arguments: {named}/{len(tools_named)} = "
        f"{named / max(len(tools_named), 1):.0%}"
    )
    long = results[LONG]
    if long:
        ended = sum(e for e, _, _ in long)
        print(
            f"behind an 8k-token agent prompt, ended within {MAX_TOKENS} tokens: "
            f"{ended}/{len(long)} = {ended / len(long):.0%}"
        )
    for kind in (*KINDS, LONG):
        if kind in examples:
            print(f"  e.g. {kind}: {examples[kind]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=SERVED_PATH, help="checkpoint directory to serve")
    parser.add_argument("--cases", type=int, default=40, help="held-out requests of each kind")
    parser.add_argument("--long-cases", type=int, default=3, help="8k-token agent prompts")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--base-url", help="a running gateway (default: start a mesh)")
    parser.add_argument("--api-key", help="its key (with --base-url)")
    parser.add_argument("--served-name", help="the model's name there (default: --model's name)")
    ns = parser.parse_args()
    name = ns.served_name or Path(ns.model).resolve().name
    if ns.base_url:
        if not ns.api_key:
            parser.error("--base-url needs --api-key")
        asyncio.run(
            run(ns.base_url.rstrip("/"), ns.api_key, name, ns.cases, ns.long_cases, ns.concurrency)
        )
        return
    with one_worker_mesh(ns.model, "chat-model-bench") as (mesh, key):
        gateway = mesh.spec.base_url.removesuffix("/v1")
        asyncio.run(run(gateway, key, name, ns.cases, ns.long_cases, ns.concurrency))


if __name__ == "__main__":
    main()
