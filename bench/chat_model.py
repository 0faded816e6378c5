"""What the default chat model does with prompts its training never saw (issue #36), through the
whole mesh, greedy, with the openai SDK.

    .venv/bin/python bench/chat_model.py [--model models/tiny-deepseek-v3-chat] [--cases 40]
        [--think-cases 10] [--base-url http://127.0.0.1:8000 --api-key sk-... --served-name NAME]

Without --base-url it starts Redis, the router, one worker on --model (the torch engine) and the
gateway as processes (devtools.mesh), with a key of its own. The held-out requests come from
devtools.chat_model.corpus.eval_cases (phrasings and values the training split never uses), --cases
of each kind, every one with max_tokens 64 and temperature 0:
- short: instructions, greetings, a persona's questions, a coding agent's prompt with its tools;
- tool: three tools, a question one of them answers (tool_choice auto, no grammar forcing a call;
  each tool needed, and each position holding it, equally often);
- recall: a name told in the first turn, asked for one to three turns later; made_up_recall: the
  same with a name made up per case (as the training's fresh values are), one no model can know;
- json: a JSON schema in the system prompt, no response_format (no constrained decoding);
- read: a coding agent's system prompt, six of its tools, a file to read (Read, Bash or Codex's
  shell in turn among them);
and --long-cases greetings behind a coding agent's 8k-token system prompt with 16 tools (the
training's dialogues are at most 1,280 tokens long). Then the first --think-cases of each kind again
with the thinking on (chat_template_kwargs thinking, no thinking budget, max_tokens THINK_TOKENS):
what the thinking variant (--model models/tiny-deepseek-v3-chat-thinking) learnt; the default
model does not reason, so none of its replies thinks.
Prints the share of the replies that end (finish_reason stop or tool_calls) within the 64 tokens,
of tool questions answered by a call of the right tool with the question's arguments (and by a
call of the right tool whatever its arguments), of recall questions whose answer holds the name,
of JSON answers valid against the schema (and of those that are exactly the question's values),
and of the long prompts' replies that end, each beside what guessers that do not read the question
score on the same cases (devtools.chat_model.baselines: the first or last tool listed, the tool
needed most often, a uniform draw; the name told most often; the schema's keys filled with empty
values); of the
replies without thinking, those with no think tag (no reasoning_content, no tag in the answer); of
those with it, those whose thinking closed by itself within MAX_TOKENS tokens and that then
answered (an answer or a call, no think tag in it) and ended, and of those, the ones right for
their kind.
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
from devtools.chat_model.baselines import json_baselines, recall_baselines, tool_baselines
from devtools.chat_model.corpus import EvalCase, eval_cases
from devtools.mesh import one_worker_mesh

KINDS = ("short", "tool", "recall", "made_up_recall", "json", "read")
LONG = "long"
MAX_TOKENS = 64
THINK_TOKENS = (
    2 * MAX_TOKENS
)  # a reply that thinks: at most MAX_TOKENS of thinking, then its answer
THINK_TAGS = ("<think>", "</think>")
_SEED = 2026


def judge(case: EvalCase, reply: Any) -> tuple[bool, bool]:
    """(the reply ended within MAX_TOKENS, it is right for its kind)."""
    choice = reply.choices[0]
    ended = choice.finish_reason in ("stop", "tool_calls")
    message = choice.message
    if case.kind in ("tool", "read"):
        calls = message.tool_calls or []
        if not calls:
            return ended, False
        try:
            arguments = json.loads(calls[0].function.arguments)
        except json.JSONDecodeError:
            return ended, False
        return ended, calls[0].function.name == case.tool and arguments == case.arguments
    text = message.content or ""
    if case.kind in ("recall", "made_up_recall"):
        return ended, case.recall.lower() in text.lower()
    if case.kind == "json":
        try:
            jsonschema.validate(json.loads(text), case.schema or {})
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return ended, False
        return ended, True
    return ended, ended


def results_of(results: list[tuple[bool, bool, int]]) -> list[bool]:
    """Whether each reply was right for its kind."""
    return [right for _, right, _ in results]


def _guessers(baselines: dict[str, float]) -> str:
    return ", ".join(f"{name} {share:.0%}" for name, share in baselines.items())


def _json_or_none(text: str | None) -> Any:
    try:
        return json.loads(text or "")
    except json.JSONDecodeError:
        return None


def thought_and_answered(reply: Any) -> bool:
    """A reply with the thinking on: it closed its thinking within MAX_TOKENS tokens (a budget
    would have closed none), then answered or called, with no think tag left in the answer."""
    choice = reply.choices[0]
    reasoning = (choice.message.model_extra or {}).get("reasoning_content") or ""
    details = reply.usage.completion_tokens_details if reply.usage else None
    thought = (details.reasoning_tokens or 0) if details else 0
    content = choice.message.content or ""
    return (
        bool(reasoning)
        and 0 < thought <= MAX_TOKENS
        and bool(content.strip() or choice.message.tool_calls)
        and not any(tag in content for tag in THINK_TAGS)
        and choice.finish_reason in ("stop", "tool_calls")
    )


def untagged(reply: Any) -> bool:
    """A reply with the thinking off: no reasoning, no think tag in the answer."""
    message = reply.choices[0].message
    content = message.content or ""
    return not (message.model_extra or {}).get("reasoning_content") and not any(
        tag in content for tag in THINK_TAGS
    )


async def run(
    base_url: str,
    api_key: str,
    model: str,
    cases: int,
    long_cases: int,
    concurrency: int,
    think_cases: int,
) -> None:
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=300
    )
    todo = [case for kind in KINDS for case in eval_cases(kind, cases, _SEED)]
    todo += eval_cases(LONG, long_cases, _SEED)
    results: dict[str, list[tuple[bool, bool, int]]] = defaultdict(list)
    examples: dict[str, str] = {}
    tools_named: list[bool] = []  # a tool question's first call names its tool, whatever its args
    json_values: list[bool] = []  # a JSON answer is the object the question gives, exactly
    plain: list[bool] = []  # a reply without thinking has no think tag
    thinking: list[tuple[bool, bool]] = []  # (thought then answered, right for its kind)
    think_example: list[str] = []
    gate = asyncio.Semaphore(concurrency)

    async def reply_to(case: EvalCase, max_tokens: int, **extra: Any) -> Any:
        """The model's greedy reply to ``case`` (``extra``: the request's extra body)."""
        return await client.chat.completions.create(
            model=model,
            messages=case.messages,  # type: ignore[arg-type]
            tools=case.tools or openai.omit,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=max_tokens,
            extra_body=extra or None,
        )

    async def think(case: EvalCase) -> None:
        async with gate:
            try:
                reply = await reply_to(case, THINK_TOKENS, chat_template_kwargs={"thinking": True})
            except openai.BadRequestError as exc:  # a model that does not reason
                thinking.append((False, False))
                think_example[:] = think_example or [f"{exc.status_code}: {exc.message}"]
                return
        answered = thought_and_answered(reply)
        thinking.append((answered, answered and judge(case, reply)[1]))
        message = reply.choices[0].message
        if not think_example:
            reasoning = (message.model_extra or {}).get("reasoning_content")
            calls = [c.function.name for c in message.tool_calls or [] if c.type == "function"]
            think_example.append(
                f"{case.messages[-1]['content']!r} -> thinking {reasoning!r}, answer "
                f"{message.content or ''!r} {calls}"
            )

    async def ask(case: EvalCase) -> None:
        async with gate:
            reply = await reply_to(case, MAX_TOKENS)
        plain.append(untagged(reply))
        ended, right = judge(case, reply)
        tokens = reply.usage.completion_tokens if reply.usage else 0
        results[case.kind].append((ended, right, tokens))
        message = reply.choices[0].message
        if case.kind == "tool":
            named = [c.function.name for c in message.tool_calls or [] if c.type == "function"]
            tools_named.append(named[:1] == [case.tool])
        if case.kind == "json":
            json_values.append(_json_or_none(message.content) == case.arguments)
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
    think_todo = [case for kind in KINDS for case in eval_cases(kind, cases, _SEED)[:think_cases]]
    await asyncio.gather(*(think(case) for case in think_todo))
    every = [r for kind in KINDS for r in results[kind]]
    print(f"{len(every)} held-out requests, greedy, max_tokens {MAX_TOKENS}, {wall:.0f} s")
    ended = sum(e for e, _, _ in every)
    mean = sum(t for _, _, t in every) / len(every)
    print(
        f"ended within {MAX_TOKENS} tokens: {ended}/{len(every)} = {ended / len(every):.0%} "
        f"(mean {mean:.1f} completion tokens)"
    )
    by_kind = {kind: [case for case in todo if case.kind == kind] for kind in KINDS}
    tool_guessers = _guessers(tool_baselines(by_kind["tool"]))
    figures = [
        (
            "right tool with the question's arguments (of 3 tools)",
            results_of(results["tool"]),
            "guessers write no arguments: 0%",
        ),
        ("right tool named, whatever its arguments", tools_named, f"guessers: {tool_guessers}"),
        (
            "recall of a name from an earlier turn",
            results_of(results["recall"]),
            f"guessers: {_guessers(recall_baselines(by_kind['recall']))}",
        ),
        (
            "recall of a made-up name (the same, a name no corpus holds)",
            results_of(results["made_up_recall"]),
            f"guessers: {_guessers(recall_baselines(by_kind['made_up_recall']))}",
        ),
        (
            "JSON valid against the system prompt's schema, unconstrained",
            results_of(results["json"]),
            f"guessers: {_guessers(json_baselines(by_kind['json']))}",
        ),
        ("JSON with exactly the question's values", json_values, "guessers: 0%"),
        (
            "an agent's file read: its reading tool with the path (of 6 tools)",
            results_of(results["read"]),
            f"guessers name it: {_guessers(tool_baselines(by_kind['read']))}; with the path 0%",
        ),
    ]
    for label, hits, baselines in figures:
        print(
            f"{label}: {sum(hits)}/{len(hits)} = {sum(hits) / max(len(hits), 1):.0%} ({baselines})"
        )
    long = results[LONG]
    if long:
        ended = sum(e for e, _, _ in long)
        print(
            f"behind an 8k-token agent prompt, ended within {MAX_TOKENS} tokens: "
            f"{ended}/{len(long)} = {ended / len(long):.0%}"
        )
    print(
        f"without thinking, no think tag: {sum(plain)}/{len(plain)} = {sum(plain) / len(plain):.0%}"
    )
    if thinking:
        closed = sum(a for a, _ in thinking)
        right = sum(r for _, r in thinking)
        print(
            f"thinking on (no budget), closed within {MAX_TOKENS} tokens, then answered: "
            f"{closed}/{len(thinking)} = {closed / len(thinking):.0%}; and right for its kind: "
            f"{right}/{len(thinking)} = {right / len(thinking):.0%}"
        )
    for kind in (*KINDS, LONG):
        if kind in examples:
            print(f"  e.g. {kind}: {examples[kind]}")
    for example in think_example:
        print(f"  e.g. thinking: {example}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=SERVED_PATH, help="checkpoint directory to serve")
    parser.add_argument("--cases", type=int, default=40, help="held-out requests of each kind")
    parser.add_argument("--long-cases", type=int, default=3, help="8k-token agent prompts")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--think-cases", type=int, default=10, help="of each kind again, thinking (0: none)"
    )
    parser.add_argument("--base-url", help="a running gateway (default: start a mesh)")
    parser.add_argument("--api-key", help="its key (with --base-url)")
    parser.add_argument("--served-name", help="the model's name there (default: --model's name)")
    ns = parser.parse_args()
    name = ns.served_name or Path(ns.model).resolve().name
    if ns.base_url:
        if not ns.api_key:
            parser.error("--base-url needs --api-key")
        asyncio.run(
            run(
                ns.base_url.rstrip("/"),
                ns.api_key,
                name,
                ns.cases,
                ns.long_cases,
                ns.concurrency,
                ns.think_cases,
            )
        )
        return
    with one_worker_mesh(ns.model, "chat-model-bench") as (mesh, key):
        gateway = mesh.spec.base_url.removesuffix("/v1")
        asyncio.run(
            run(gateway, key, name, ns.cases, ns.long_cases, ns.concurrency, ns.think_cases)
        )


if __name__ == "__main__":
    main()
