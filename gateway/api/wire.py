"""Wire fields both APIs' request models share: their types, the router's sampling parameters
from any wire format's fields, and the headers that pick a precision and a GPU kind (asked for by
a request, answered with where it ran)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from gateway.http.validation import STRICT
from infermesh.pb import common_pb2

PRECISION_HEADER = "x-infermesh-precision"
GPU_HEADER = "x-infermesh-gpu"

UInt32 = Annotated[int, Field(ge=1, le=2**32 - 1)]
# Names travel to the router and back in gRPC statuses, whose metadata is size-limited.
Name = Annotated[str, Field(min_length=1, max_length=256)]


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


def joined_text(content: str | list[TextPart]) -> str:
    """A message's text: text parts are joined with newlines."""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def sampling_params(
    *,
    stop: list[str],
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    max_tokens: int | None = None,
    seed: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
) -> common_pb2.SamplingParams:
    """Only the fields the client gave are set: an unset one means the worker's default."""
    given: dict[str, Any] = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "max_tokens": max_tokens,
        "seed": seed,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
    }
    return common_pb2.SamplingParams(stop=stop, **{k: v for k, v in given.items() if v is not None})
