"""One tokenization per request (issue #28): what rendering, tokenizing and hashing a prompt
costs the gateway, and what the worker saves when it serves the ids it is sent.

    .venv/bin/python bench/prompt_tokens.py [--model-dir models/tiny-deepseek-v3] \
        [--tokens 1000 8000 32000 80000] [--rounds 5]

Per prompt size: a chat of alternating turns of varied words (and two tool definitions) of about
that many tokens, rendered with the checkpoint's served template (``render``), tokenized
(``tokenize``), its 16-token blocks hashed (``hash``, infermesh.prefix_hash.chain), and the three
together as the gateway does them (``gateway``: infermesh.text.prompt.request_token_ids from the
GenerateRequest, then chain). The worker's side: its prompt ids rendered from the request
(``worker renders``) against the ids it is sent with its tokenizer's digest (``worker given``,
a check and a copy); their difference is what the worker saves. Each figure is the median of
--rounds, in microseconds per request.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

from infermesh.pb import common_pb2
from infermesh.prefix_hash import chain
from infermesh.text.prompt import chat_message, request_token_ids, tool_definition
from infermesh.text.tokenizer import Tokenizer
from worker_svc.config import DEFAULT_MODEL_PATH
from worker_svc.engine.api import Constraints, GenerationRequest, SamplingParams, Tool
from worker_svc.engine.prompt_ids import prompt_token_ids

# made-up words of common syllables: the BPE merges them into a few tokens each, as prose
_WORDS = [
    a + b for a in ("ka", "lo", "mi", "re", "tu", "san", "vel") for b in ("n", "ro", "th", "s", "")
]
_TOOL = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}


def _chat(tokenizer: Tokenizer, tokens: int, seed: int) -> common_pb2.GenerateRequest:
    """A chat of about ``tokens`` prompt tokens: turns of ~400 tokens added until it has them."""
    rng = random.Random(seed)
    request = common_pb2.GenerateRequest(request_id="bench", model="bench")
    request.messages.add(role="system", content="You are a careful assistant.")
    for name in ("get_weather", "get_time"):
        request.tools.add(
            name=name, description=f"{name} of a city", parameters_json=json.dumps(_TOOL)
        )
    while len(request_token_ids(tokenizer, request)) < tokens:
        role = "user" if len(request.messages) % 2 else "assistant"
        words = " ".join(rng.choice(_WORDS) for _ in range(300))
        request.messages.add(role=role, content=words)
    if request.messages[-1].role != "user":
        request.messages.add(role="user", content="Summarize.")
    return request


def _median_us(work: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def _engine_request(
    request: common_pb2.GenerateRequest, ids: list[int], digest: str
) -> GenerationRequest:
    return GenerationRequest(
        request_id=request.request_id,
        messages=[chat_message(m) for m in request.messages],
        prompt=None,
        sampling=SamplingParams(),
        constraints=Constraints(
            tools=tuple(Tool(t.name, t.description, t.parameters_json) for t in request.tools)
        ),
        prompt_token_ids=tuple(ids),
        tokenizer=digest,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=DEFAULT_MODEL_PATH)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000, 8000, 32000, 80000])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tokenizer = Tokenizer(args.model_dir)
    digest = tokenizer.text_files.digest
    print(f"{args.model_dir}: {tokenizer.vocab_size} tokens, {digest[:19]}...; µs per request")
    header = ("tokens", "render", "tokenize", "hash", "gateway", "worker renders", "worker given")
    print(" | ".join(f"{h:>14}" for h in header))
    for i, tokens in enumerate(args.tokens):
        print(" | ".join(_row(tokenizer, _chat(tokenizer, tokens, seed=i), args.rounds)))


def _row(tokenizer: Tokenizer, request: common_pb2.GenerateRequest, rounds: int) -> list[str]:
    messages = [chat_message(m) for m in request.messages]
    tools = [tool_definition(t.name, t.description, t.parameters_json) for t in request.tools]
    rendered = tokenizer.render_chat(messages, tools)
    ids = tokenizer.encode_rendered(rendered)
    given = _engine_request(request, ids, tokenizer.text_files.digest)
    rendering = _engine_request(request, [], "")
    assert prompt_token_ids(tokenizer, rendering) == ids == request_token_ids(tokenizer, request)
    figures = (
        _median_us(lambda: tokenizer.render_chat(messages, tools), rounds),
        _median_us(lambda: tokenizer.encode_rendered(rendered), rounds),
        _median_us(lambda: chain(ids), rounds),
        _median_us(lambda: chain(request_token_ids(tokenizer, request)), rounds),
        _median_us(lambda: prompt_token_ids(tokenizer, rendering), rounds),
        _median_us(lambda: prompt_token_ids(tokenizer, given), rounds),
    )
    return [f"{len(ids):>14,}", *(f"{f:>14,.0f}" for f in figures)]


if __name__ == "__main__":
    main()
