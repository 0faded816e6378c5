"""Anthropic Messages on the wire (``POST /v1/messages``): the request model, the
``message`` object and the streaming events, in Anthropic's own shapes."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from gateway.errors import InvalidRequestError
from gateway.openai_protocol import Name, TextPart, UInt32, joined_text
from gateway.sampling import sampling_params
from gateway.tools import ToolName, check_schema
from gateway.usage import TokenUsage
from gateway.validation import STRICT, parse_body, refuse_fields
from infermesh.pb import common_pb2

StopReason = Literal["end_turn", "max_tokens", "tool_use"]
# The worker does not say whether a stop string or the end-of-sequence token
# stopped it, so a stop is reported as the end of the turn.
STOP_REASONS: dict[int, StopReason] = {
    common_pb2.FINISH_REASON_STOP: "end_turn",
    common_pb2.FINISH_REASON_LENGTH: "max_tokens",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_use",
}


class ToolUseBlock(BaseModel):
    """A call in an assistant turn of the history."""

    model_config = STRICT
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """A call's result, in a user turn."""

    model_config = STRICT
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[TextPart] = ""
    is_error: bool = False


Block = Annotated[TextPart | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(BaseModel):
    model_config = STRICT
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]

    @model_validator(mode="after")
    def _blocks_of_role(self) -> Message:
        kinds = {b.type for b in self.content} if isinstance(self.content, list) else set()
        if self.role == "user" and "tool_use" in kinds:
            raise ValueError("tool_use blocks belong in assistant turns")
        if self.role == "assistant" and "tool_result" in kinds:
            raise ValueError("tool_result blocks belong in user turns")
        return self

    def router_messages(self) -> list[common_pb2.ChatMessage]:
        """Tool results become tool turns (before the user's text, as Anthropic orders them);
        tool_use blocks the assistant turn's calls."""
        if isinstance(self.content, str):
            return [common_pb2.ChatMessage(role=self.role, content=self.content)]
        text = "\n".join(b.text for b in self.content if isinstance(b, TextPart))
        results = [
            common_pb2.ChatMessage(
                role="tool",
                tool_call_id=b.tool_use_id,
                content=("Error: " if b.is_error else "") + joined_text(b.content),
            )
            for b in self.content
            if isinstance(b, ToolResultBlock)
        ]
        calls = [
            common_pb2.ToolCall(id=b.id, name=b.name, arguments=json.dumps(b.input))
            for b in self.content
            if isinstance(b, ToolUseBlock)
        ]
        own = (
            []
            if self.role == "user" and results and not text
            else [common_pb2.ChatMessage(role=self.role, content=text, tool_calls=calls)]
        )
        return results + own


class ToolDefinition(BaseModel):
    model_config = STRICT
    type: Literal["custom"] | None = None  # server tools (web search, ...) are not run here
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = STRICT
    format: OutputFormat | None = None
    # `effort` is accepted and ignored: how long to think, for a model that does not think


class Thinking(BaseModel):
    """Only what a model without thinking blocks serves: none, or the model's own choice."""

    model_config = STRICT
    type: Literal["disabled", "adaptive"]


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
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: Thinking | None = None

    def router_messages(self) -> list[common_pb2.ChatMessage]:
        messages = [r for m in self.messages for r in m.router_messages()]
        if self.system:
            messages.insert(
                0, common_pb2.ChatMessage(role="system", content=joined_text(self.system))
            )
        return messages

    def generate_request(self, request_id: str) -> common_pb2.GenerateRequest:
        sampling = sampling_params(
            stop=self.stop_sequences or [],
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
        )
        return common_pb2.GenerateRequest(
            request_id=request_id,
            model=self.model,
            messages=self.router_messages(),
            sampling=sampling,
            **self._tools(),
        )

    def _tools(self) -> dict[str, Any]:
        """The request's tools, tool choice and output format; 400s naming the bad parameter."""
        tools = self.tools or []
        names = [t.name for t in tools]
        if len(set(names)) < len(names):
            raise InvalidRequestError(
                "Invalid value for 'tools': duplicate tool names", param="tools"
            )
        fields: dict[str, Any] = {
            "tools": [
                common_pb2.Tool(
                    name=t.name,
                    description=t.description or "",
                    parameters_json=check_schema(t.input_schema, f"tools.{i}.input_schema"),
                )
                for i, t in enumerate(tools)
            ]
        }
        output = self.output_config.format if self.output_config else None
        if output is not None:
            fields["json_schema"] = check_schema(output.schema_, "output_config.format.schema")
        choice = self.tool_choice
        if choice is None:
            return fields
        if choice.type in ("any", "tool") and not tools:
            raise InvalidRequestError(
                f"Invalid value for 'tool_choice': '{choice.type}' needs tools", param="tool_choice"
            )
        if choice.type == "tool" and choice.name not in names:
            raise InvalidRequestError(
                f"Invalid value for 'tool_choice.name': no tool named {choice.name!r} in 'tools'",
                param="tool_choice.name",
            )
        fields.update(
            tool_choice=_TOOL_CHOICES[choice.type],
            tool_name=choice.name or "",
            single_tool_call=choice.disable_parallel_tool_use,
        )
        return fields


# Anthropic fields this gateway does not implement (server-side tools and context editing):
# refused rather than dropped (README lists the fields still ignored)
UNSUPPORTED_MESSAGES_FIELDS = ("container", "mcp_servers", "context_management")


def parse_messages_request(body: Any) -> MessagesRequest:
    request = parse_body(MessagesRequest, body)
    refuse_fields(body, UNSUPPORTED_MESSAGES_FIELDS)
    return request


_TOOL_CHOICES = {
    "auto": common_pb2.TOOL_CHOICE_AUTO,
    "any": common_pb2.TOOL_CHOICE_REQUIRED,
    "tool": common_pb2.TOOL_CHOICE_NAMED,
    "none": common_pb2.TOOL_CHOICE_NONE,
}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def usage(tokens: TokenUsage) -> dict[str, int]:
    return {
        "input_tokens": tokens.prompt_tokens,
        "output_tokens": tokens.completion_tokens,
        "cache_read_input_tokens": tokens.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def message(
    mid: str,
    model: str,
    text: str | None,
    stop_reason: StopReason | None,
    tokens: TokenUsage,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A ``message`` object; without text (``None``) the start of a stream. ``tool_calls`` in
    OpenAI's shape (gateway.tools.ToolCalls) become tool_use blocks after the text."""
    content = [] if text is None else [{"type": "text", "text": text}]
    content += [
        tool_use(c["id"], c["function"]["name"], _input(c["function"]["arguments"]))
        for c in tool_calls or ()
    ]
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage(tokens),
    }


def tool_use(call_id: str, name: str, input: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": input}


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its input; arguments cut short by max_tokens give an empty input."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stream_start(mid: str, model: str) -> list[dict[str, Any]]:
    """The events before the first text delta."""
    return [
        {"type": "message_start", "message": message(mid, model, None, None, TokenUsage())},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
    ]


def text_delta(text: str) -> dict[str, Any]:
    return {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": text},
    }


def tool_use_start(index: int, call_id: str, name: str) -> list[dict[str, Any]]:
    """The previous block ends, a tool_use block begins (its input comes as JSON deltas)."""
    return [
        {"type": "content_block_stop", "index": index - 1},
        {
            "type": "content_block_start",
            "index": index,
            "content_block": tool_use(call_id, name, {}),
        },
    ]


def input_json_delta(index: int, partial_json: str) -> dict[str, Any]:
    return {
        "type": "content_block_delta",
        "index": index,
        "delta": {"type": "input_json_delta", "partial_json": partial_json},
    }


def stream_end(
    stop_reason: StopReason,
    tokens: TokenUsage,
    last_block: int = 0,
) -> list[dict[str, Any]]:
    """The events after the last delta; usage counts are the totals."""
    return [
        {"type": "content_block_stop", "index": last_block},
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": usage(tokens),
        },
        {"type": "message_stop"},
    ]
