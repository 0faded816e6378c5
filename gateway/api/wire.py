"""Wire types both APIs' request models share, and the headers that pick a precision and a
GPU kind (asked for by a request, answered with where it ran)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from gateway.http.validation import STRICT

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
