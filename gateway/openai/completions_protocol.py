"""Legacy text completions on the wire (``POST /v1/completions``): the request
model and OpenAI-format ``text_completion`` builders."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from pydantic import Field, field_validator

from gateway.api.wire import UInt32
from gateway.http.validation import parse_body
from gateway.openai.chat_protocol import OpenAIGeneration, with_precision_header
from infermesh.names import FinishReason
from infermesh.pb import common_pb2

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


class CompletionRequest(OpenAIGeneration):
    """The body of ``POST /v1/completions``; a list of prompts is one batch, each
    prompt with ``n`` choices (choice ``p * n + j``)."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=128)]
    max_tokens: UInt32 | None = _DEFAULT_MAX_TOKENS
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: None = None  # insertion is not supported: any other value is a 400
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[str]) -> str | list[str]:
        if any(not p for p in ([prompt] if isinstance(prompt, str) else prompt)):
            raise ValueError("prompts must not be empty")
        return prompt

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: Any) -> int | None:
        if best_of is not None and best_of != info.data.get("n", 1):
            raise ValueError("only best_of equal to n is supported")
        return best_of

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def sampling(self, choice: int) -> common_pb2.SamplingParams:
        sampling = super().sampling(choice)
        if self.logprobs is not None:
            sampling.logprobs = True
            sampling.top_logprobs = self.logprobs
        return sampling


def parse_completion_request(body: Any, headers: Mapping[str, str]) -> CompletionRequest:
    return with_precision_header(parse_body(CompletionRequest, body), headers)


def completion_logprobs(
    items: Iterable[common_pb2.TokenLogprob], text_offset: int
) -> dict[str, list[Any]]:
    """The legacy ``logprobs`` object; offsets count characters from ``text_offset``."""
    out: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for t in items:
        out["tokens"].append(t.token)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({a.token: a.logprob for a in t.top})
        out["text_offset"].append(text_offset)
        text_offset += len(t.token)
    return out


def merge_logprobs(into: dict[str, list[Any]], more: dict[str, list[Any]]) -> None:
    for field, values in more.items():
        into[field].extend(values)


def completion_choice(
    index: int, text: str, finish_reason: FinishReason | None, logprobs: dict[str, list[Any]] | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def text_completion(
    cid: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """A ``text_completion`` object: the whole answer, or one streamed chunk."""
    completion = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if usage is not None:
        completion["usage"] = usage
    return completion
