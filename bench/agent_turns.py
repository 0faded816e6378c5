"""Agent-sized prompts on the default model (issue #27): a coding agent's first turn, then its
second (the same history and one exchange), through each API a coding agent speaks.

    .venv/bin/python bench/agent_turns.py [--base-url http://127.0.0.1:8000 --api-key sk-...]
        [--prompt-tokens 20000] [--repeats 1]

Without --base-url it starts Redis, the router, one worker on the default model (the torch
engine, models/tiny-deepseek-v3) and the gateway as processes (devtools.mesh), with a key of its
own. The first turn is the shape Codex CLI and Claude Code open a session with: a long English
system prompt (an agent's guide, then the project's own docs as the AGENTS.md/CLAUDE.md it
reads, cut to about --prompt-tokens tokens) and 15 tool definitions; sent as a Responses API
request with the openai SDK (instructions, function tools) and as a Messages request with the
anthropic SDK (Claude Code's shape, tests/helpers/claude_code.py). The second turn adds one
exchange: the model's call of Read and its result. Each turn streams; TTFT is the time to the
first output delta. Each of --repeats sessions opens with a system prompt of its own, so that its
first turn is computed afresh and its second finds the first's history in the prefix cache. Prints
the median TTFT of each turn, the ratio second / first (the target: <= 0.2), the input and cached
tokens the usage reports, and the characters per token of the system prompt and tool schemas in
the model's tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
from openai.types.responses import FunctionToolParam
from tokenizers import Tokenizer

from devtools.mesh import one_worker_mesh
from tests.helpers import claude_code
from worker_svc.config import DEFAULT_MODEL_PATH

_ROOT = Path(__file__).resolve().parents[1]
_DOCS = ("README.md", "docs/ARCHITECTURE.md", "docs/RELIABILITY.md", "docs/HARDWARE.md")
_MODEL = "tiny-deepseek-v3"
_MAX_OUTPUT_TOKENS = 16
_GUIDE = """\
You are a coding agent running in the user's terminal, working in their repository. You and the \
user share the same workspace and collaborate to achieve the user's goals.

# How you work
- Read the code before you change it: find the files a task touches, read them, and read the \
tests that cover them. Never guess a file's content; use the tools for every file and shell \
operation.
- Keep changes small and focused on the task. Fix the root cause rather than the symptom, avoid \
unneeded complexity, and keep to the style of the code around you.
- Run the tests that cover what you changed, and the linters the project uses, before you say \
that a change is done. When a test fails, read its output and fix the cause.
- Do not commit, push or delete branches unless the user asks you to.
- When you are unsure what the user wants, ask one short question instead of guessing.

# Answers
Be concise and direct. Say what you changed, in which files, and how you checked it. Quote file \
paths and commands in backticks. Do not repeat the content of files the user can open.

# Tools
Call a tool with a JSON object that matches its parameters' schema. Prefer the dedicated tools \
over shell commands for reading, writing and searching files; use the shell for builds, tests \
and git.

# Project instructions
The repository's own documentation follows; follow its conventions.

"""
_FOLLOW_UP = "Read README.md and tell me how to start the mesh."
# Claude Code's dozen tools and three more of its kind: 15 definitions
_EXTRA_TOOLS = [
    {
        "name": "NotebookEdit",
        "description": "Replaces, inserts or deletes one cell of a Jupyter notebook.",
        "input_schema": {
            "type": "object",
            "properties": {
                "notebook_path": {"type": "string"},
                "cell_id": {"type": "string"},
                "new_source": {"type": "string"},
                "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]},
            },
            "required": ["notebook_path", "new_source"],
            "additionalProperties": False,
        },
    },
    {
        "name": "TodoWrite",
        "description": "Replaces the session's to-do list: each item with its status.",
        "input_schema": {
            "type": "object",
            "properties": {
                "todos": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "content": {"type": "string", "minLength": 1},
                            "status": {
                                "type": "string",
                                "enum": ["pending", "in_progress", "completed"],
                            },
                        },
                        "required": ["content", "status"],
                    },
                }
            },
            "required": ["todos"],
            "additionalProperties": False,
        },
    },
    {
        "name": "ExitPlanMode",
        "description": "Presents the plan to the user for approval and leaves planning mode.",
        "input_schema": {
            "type": "object",
            "properties": {"plan": {"type": "string"}},
            "required": ["plan"],
            "additionalProperties": False,
        },
    },
]
TOOLS = claude_code.TOOLS + _EXTRA_TOOLS
_DELTAS = {
    "response.output_text.delta",
    "response.function_call_arguments.delta",
    "response.reasoning_text.delta",
    "content_block_delta",
}


@dataclass
class Turn:
    ttft_s: float
    input_tokens: int  # the whole prompt, cached tokens included
    cached_tokens: int


def system_prompt(tokenizer: Tokenizer, prompt_tokens: int) -> str:
    """The agent's guide, then the project's docs, cut to about ``prompt_tokens`` tokens with the
    tool schemas."""
    docs = "\n\n".join((_ROOT / name).read_text(encoding="utf-8") for name in _DOCS)
    budget = prompt_tokens - len(tokenizer.encode(_GUIDE + json.dumps(TOOLS)).ids)
    ids = tokenizer.encode(docs).ids
    if budget > len(ids):
        raise SystemExit(f"--prompt-tokens: the docs hold {len(ids)} tokens, fewer than asked")
    return _GUIDE + tokenizer.decode(ids[: max(budget, 0)])


def chars_per_token(tokenizer: Tokenizer, system: str) -> float:
    text = system + json.dumps(TOOLS, indent=2)
    return len(text) / len(tokenizer.encode(text).ids)


def _exchange_read() -> tuple[dict[str, Any], str]:
    arguments = {"file_path": str(_ROOT / "README.md"), "limit": 40}
    lines = (_ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:40]
    return arguments, "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines, 1))


async def _timed(events: Any, started: float) -> tuple[float, Any]:
    """Time to the first output delta of a stream, which is then read to its end; and its last
    event."""
    ttft = event = None
    async for event in events:
        if ttft is None and event.type in _DELTAS:
            ttft = time.perf_counter() - started
    return time.perf_counter() - started if ttft is None else ttft, event


async def responses_turn(client: openai.AsyncOpenAI, system: str, user: str, second: bool) -> Turn:
    """Codex's shape: instructions, function tools, a user message; the second turn adds the
    model's call and its output."""
    tools = [
        FunctionToolParam(
            type="function",
            name=t["name"],
            description=t["description"],
            parameters=t["input_schema"],
            strict=False,
        )
        for t in TOOLS
    ]
    items: list[Any] = [{"type": "message", "role": "user", "content": user}]
    if second:
        arguments, result = _exchange_read()
        items += [
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "Read",
                "arguments": json.dumps(arguments),
            },
            {"type": "function_call_output", "call_id": "call_1", "output": result},
        ]
    started = time.perf_counter()
    stream = await client.responses.create(
        model=_MODEL,
        instructions=system,
        input=items,
        tools=tools,
        tool_choice="auto",
        parallel_tool_calls=False,
        store=False,
        stream=True,
        max_output_tokens=_MAX_OUTPUT_TOKENS,
    )
    ttft, last = await _timed(stream, started)
    usage = last.response.usage  # response.completed, or .incomplete at max_output_tokens
    return Turn(ttft, usage.input_tokens, usage.input_tokens_details.cached_tokens)


async def messages_turn(
    client: anthropic.AsyncAnthropic, system: str, user: str, second: bool
) -> Turn:
    """Claude Code's shape (its system blocks, betas and settings) with the long system prompt;
    the second turn adds the model's tool_use and its tool_result."""
    request = claude_code.request(_MODEL, max_tokens=_MAX_OUTPUT_TOKENS, tools=TOOLS)
    request["system"] = copy.deepcopy(request["system"])
    request["system"][-1]["text"] = system
    messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": user}]}]
    if second:
        arguments, result = _exchange_read()
        messages += [
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": arguments}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}],
            },
        ]
    request["messages"] = messages
    started = time.perf_counter()
    async with client.beta.messages.stream(**request) as stream:
        ttft, _ = await _timed(stream, started)
        usage = (await stream.get_final_message()).usage
    cached = usage.cache_read_input_tokens or 0
    return Turn(ttft, usage.input_tokens + cached, cached)  # Anthropic's input_tokens: uncached


TurnFn = Callable[[str, str, bool], Awaitable[Turn]]


async def _sessions(api: str, turn: TurnFn, system: str, repeats: int) -> None:
    """``repeats`` sessions of two turns, each under a system prompt of its own (a session line
    first, as an agent puts its environment there), so that its first turn is computed afresh;
    prints the figures."""
    firsts, seconds = [], []
    for i in range(repeats):
        session = f"Session {i} of a {api} run at {time.time():.0f}.\n{system}"
        firsts.append(await turn(session, _FOLLOW_UP, False))
        seconds.append(await turn(session, _FOLLOW_UP, True))
    first = statistics.median(t.ttft_s for t in firsts)
    second = statistics.median(t.ttft_s for t in seconds)
    print(
        f"{api:<10} first turn TTFT {first * 1000:8.0f} ms ({firsts[-1].input_tokens} input, "
        f"{firsts[-1].cached_tokens} cached) | second turn {second * 1000:7.0f} ms "
        f"({seconds[-1].input_tokens} input, {seconds[-1].cached_tokens} cached) | "
        f"second/first {second / first:5.3f}"
    )


async def run(base_url: str, api_key: str, prompt_tokens: int, repeats: int) -> None:
    tokenizer = Tokenizer.from_file(str(Path(DEFAULT_MODEL_PATH) / "tokenizer.json"))
    system = system_prompt(tokenizer, prompt_tokens)
    print(
        f"system prompt {len(system)} chars, {len(TOOLS)} tools; "
        f"{chars_per_token(tokenizer, system):.2f} chars/token (system prompt + tool schemas)"
    )
    timeout = 600.0
    responses = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout
    )
    messages = anthropic.AsyncAnthropic(
        base_url=base_url, auth_token=api_key, max_retries=0, timeout=timeout
    )

    async def respond(system: str, user: str, second: bool) -> Turn:
        return await responses_turn(responses, system, user, second)

    async def message(system: str, user: str, second: bool) -> Turn:
        return await messages_turn(messages, system, user, second)

    await _sessions("responses", respond, system, repeats)
    await _sessions("messages", message, system, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running gateway (default: start a mesh)")
    parser.add_argument("--api-key", help="its key (with --base-url)")
    parser.add_argument("--prompt-tokens", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=1)
    ns = parser.parse_args()
    if ns.base_url:
        if not ns.api_key:
            parser.error("--base-url needs --api-key")
        asyncio.run(run(ns.base_url.rstrip("/"), ns.api_key, ns.prompt_tokens, ns.repeats))
        return
    with one_worker_mesh(DEFAULT_MODEL_PATH, "agent-turns") as (mesh, key):
        gateway = mesh.spec.base_url.removesuffix("/v1")
        asyncio.run(run(gateway, key, ns.prompt_tokens, ns.repeats))


if __name__ == "__main__":
    main()
