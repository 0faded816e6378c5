"""Anthropic Messages on the wire (``POST /v1/messages``): the request model, the
``message`` object and the streaming events, in Anthropic's own shapes."""
from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from gateway.limits import TokenUsage
from gateway.protocol import Name, TextPart, UInt32, joined_text
from gateway.validation import STRICT
from infermesh.pb import common_pb2

StopReason = Literal["end_turn", "max_tokens"]
# The worker does not say whether a stop string or the end-of-sequence token
# stopped it, so a stop is reported as the end of the turn.
STOP_REASONS: dict[int, StopReason] = {
    common_pb2.FINISH_REASON_STOP: "end_turn", common_pb2.FINISH_REASON_LENGTH: "max_tokens",
}


class Message(BaseModel):
    model_config = STRICT
    role: Literal["user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]


class MessagesRequest(BaseModel):
    """The body of ``POST /v1/messages``."""
    model_config = STRICT
    model: Name
    max_tokens: UInt32
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    stream: bool = False

    def router_messages(self) -> list[common_pb2.ChatMessage]:
        messages = [common_pb2.ChatMessage(role=m.role, content=joined_text(m.content))
                    for m in self.messages]
        if self.system:
            messages.insert(0, common_pb2.ChatMessage(role="system",
                                                      content=joined_text(self.system)))
        return messages

    def generate_request(self, request_id: str) -> common_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(max_tokens=self.max_tokens,
                                             stop=self.stop_sequences or [])
        if self.temperature is not None:
            sampling.temperature = self.temperature
        if self.top_p is not None:
            sampling.top_p = self.top_p
        if self.top_k is not None:
            sampling.top_k = self.top_k
        return common_pb2.GenerateRequest(request_id=request_id, model=self.model,
                                          messages=self.router_messages(), sampling=sampling)


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def usage(tokens: TokenUsage) -> dict[str, int]:
    return {"input_tokens": tokens.prompt_tokens, "output_tokens": tokens.completion_tokens,
            "cache_read_input_tokens": tokens.cached_tokens, "cache_creation_input_tokens": 0}


def message(mid: str, model: str, text: str | None, stop_reason: StopReason | None,
            tokens: TokenUsage) -> dict[str, Any]:
    """A ``message`` object; without text (``None``) the start of a stream."""
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": [] if text is None else [{"type": "text", "text": text}],
            "stop_reason": stop_reason, "stop_sequence": None, "usage": usage(tokens)}


def stream_start(mid: str, model: str) -> list[dict[str, Any]]:
    """The events before the first text delta."""
    return [{"type": "message_start", "message": message(mid, model, None, None, TokenUsage())},
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "text", "text": ""}},
            {"type": "ping"}]


def text_delta(text: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": text}}


def stream_end(stop_reason: StopReason, tokens: TokenUsage) -> list[dict[str, Any]]:
    """The events after the last text delta; usage counts are the totals."""
    return [{"type": "content_block_stop", "index": 0},
            {"type": "message_delta",
             "delta": {"stop_reason": stop_reason, "stop_sequence": None},
             "usage": usage(tokens)},
            {"type": "message_stop"}]
