"""Chat completions on the wire: request models and OpenAI-format response builders.

Requests are validated strictly (a string where a number belongs is a 400, not
a conversion); unknown top-level fields are ignored, as OpenAI clients send
fields this gateway does not use. Responses are plain dicts in exactly the
shape the OpenAI API returns.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.errors import InvalidRequestError

Precision = Literal["fp8", "bf16", "fp16", "fp32"]
FinishReason = Literal["stop", "length"]
PRECISION_HEADER = "x-infermesh-precision"

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The body of ``POST /v1/chat/completions``."""
    model_config = _STRICT
    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1, le=2**32 - 1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=2**32 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    n: int | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    precision: Precision | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def parse_chat_request(body: Any, headers: dict[str, str] | Any) -> ChatCompletionRequest:
    """Validates a decoded JSON body; the precision header applies when the body names none."""
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object")
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise _invalid(e, body) from None
    header = headers.get(PRECISION_HEADER)
    if request.precision is None and header is not None:
        if header not in ("fp8", "bf16", "fp16", "fp32"):
            raise InvalidRequestError(
                f"Invalid header {PRECISION_HEADER}: expected fp8, bf16, fp16 or fp32",
                param=PRECISION_HEADER)
        request = request.model_copy(update={"precision": header})
    return request


def _invalid(error: ValidationError, body: dict[str, Any]) -> InvalidRequestError:
    # For a union (content, stop) pydantic reports one error per member; the
    # member that matched the input's shape went deepest or failed on more
    # than the type.
    errors = error.errors(include_url=False)
    first = _param(errors[0]["loc"], body)
    chosen = max((e for e in errors if _param(e["loc"], body).startswith(first)),
                 key=lambda e: (len(_param(e["loc"], body)), not e["type"].endswith("_type")))
    param = _param(chosen["loc"], body)
    message = chosen["msg"].removeprefix("Value error, ")
    if chosen["type"] == "missing":
        return InvalidRequestError(f"Missing required parameter '{param}'", param=param)
    return InvalidRequestError(f"Invalid value for '{param}': {message}", param=param or None)


def _param(loc: tuple[int | str, ...], body: Any) -> str:
    """The loc as a path in the input ("messages.0.role"), without union member tags."""
    parts: list[str] = []
    node = body
    for item in loc:
        if isinstance(node, dict) and isinstance(item, str):
            parts.append(item)
            node = node.get(item)
        elif isinstance(node, list) and isinstance(item, int) and item < len(node):
            parts.append(str(item))
            node = node[item]
        # else: a union member's tag such as 'str' or 'list[TextPart]'
    return ".".join(parts)


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_completion(cid: str, created: int, model: str, text: str,
                    finish_reason: FinishReason, usage: dict[str, Any]) -> dict[str, Any]:
    """A whole ``chat.completion`` object."""
    return {
        "id": cid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": text, "refusal": None},
                     "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage, "system_fingerprint": None,
    }


def chat_chunk(cid: str, created: int, model: str, delta: dict[str, Any],
               finish_reason: FinishReason | None = None,
               with_usage_field: bool = False) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``usage: null`` when the stream ends with a usage chunk."""
    chunk: dict[str, Any] = {
        "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "logprobs": None,
                     "finish_reason": finish_reason}],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(cid: str, created: int, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None, "choices": [], "usage": usage}


def model_object(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "infermesh"}


def model_list(models: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": models}
