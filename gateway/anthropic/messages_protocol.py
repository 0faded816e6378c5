"""Anthropic Messages on the wire (``POST /v1/messages``): the request model, the
``message`` object and the streaming events, in Anthropic's own shapes."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, model_validator

from gateway.accounts.usage import TokenUsage
from gateway.api.tools import ToolName, check_schema
from gateway.api.wire import Name, TextPart, UInt32, joined_text, sampling_params
from gateway.http.errors import InvalidRequestError
from gateway.http.validation import STRICT, parse_body, refuse_fields
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


class ThinkingBlock(BaseModel):
    """Thinking of an earlier assistant turn: left out of the prompt, as DeepSeek's templates
    drop the reasoning of earlier turns (and a chat turn has no place for it)."""

    model_config = STRICT
    type: Literal["thinking"]
    thinking: str = ""
    signature: str = ""


class RedactedThinkingBlock(BaseModel):
    model_config = STRICT
    type: Literal["redacted_thinking"]
    data: str = ""


Block = Annotated[
    TextPart | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]
# the blocks each role's turns may hold
_ROLE_BLOCKS = {
    "user": {"text", "tool_result"},
    "assistant": {"text", "tool_use", "thinking", "redacted_thinking"},
    "system": {"text"},
}


class Message(BaseModel):
    """A turn. Claude Code also sends ``system`` turns among the messages: they join the system
    prompt, as DeepSeek's templates gather every system message there."""

    model_config = STRICT
    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[Block], Field(min_length=1)]

    @model_validator(mode="after")
    def _blocks_of_role(self) -> Message:
        kinds = {b.type for b in self.content} if isinstance(self.content, list) else set()
        misplaced = sorted(kinds - _ROLE_BLOCKS[self.role])
        if misplaced:
            raise ValueError(f"{misplaced[0]} blocks do not belong in {self.role} turns")
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
    # accepted and ignored: a DeepSeek model thinks or not (`thinking`), never more or less hard
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


# Anthropic's least thinking budget
MIN_BUDGET_TOKENS = 1024


class Thinking(BaseModel):
    """Extended thinking: ``enabled`` turns a reasoning model's thinking on, at most
    ``budget_tokens`` of it; ``adaptive`` (the model's own choice) turns it on too, as a
    DeepSeek model's thinking is on or off; ``disabled`` off. ``display``: ``omitted`` (and
    ``updates``, whose progress notes this model does not write) leaves the blocks' text out."""

    model_config = STRICT
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    display: Literal["summarized", "omitted", "updates"] | None = None

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class InputTokens(BaseModel):
    model_config = STRICT
    type: Literal["input_tokens"]
    value: UInt32


class ToolUses(BaseModel):
    model_config = STRICT
    type: Literal["tool_uses"]
    value: UInt32


class ThinkingTurns(BaseModel):
    model_config = STRICT
    type: Literal["thinking_turns", "all"]
    value: UInt32 | None = None


class ClearToolUses(BaseModel):
    """Clears the results (and optionally the inputs) of the oldest tool uses once the prompt
    grows past ``trigger``, keeping the last ``keep``; Anthropic's defaults."""

    model_config = STRICT
    type: Literal["clear_tool_uses_20250919"]
    trigger: Annotated[InputTokens | ToolUses, Field(discriminator="type")] = InputTokens(
        type="input_tokens", value=100_000
    )
    keep: ToolUses = ToolUses(type="tool_uses", value=3)
    clear_at_least: InputTokens | None = None
    clear_tool_inputs: bool | list[str] | None = None
    exclude_tools: list[str] | None = None


class ClearThinking(BaseModel):
    """Clears thinking blocks of earlier turns: the prompt never holds any
    (gateway.anthropic.context_editing)."""

    model_config = STRICT
    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | ThinkingTurns | None = None


class ContextManagement(BaseModel):
    """Server-side context editing (beta context-management-2025-06-27). Edit types not listed
    here (compaction, ...) are a 400 naming the type."""

    model_config = STRICT
    edits: list[Annotated[ClearToolUses | ClearThinking, Field(discriminator="type")]] = []


class Metadata(BaseModel):
    model_config = STRICT
    user_id: str | None = None  # accepted; the session comes from X-Claude-Code-Session-Id


class MessagesBody(BaseModel):
    """What ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` share: the prompt."""

    model_config = STRICT
    model: Name
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None
    metadata: Metadata | None = None

    def router_messages(self) -> list[common_pb2.ChatMessage]:
        messages = [r for m in self.messages for r in m.router_messages()]
        if self.system:
            messages.insert(
                0, common_pb2.ChatMessage(role="system", content=joined_text(self.system))
            )
        return messages

    def prompt_request(self, request_id: str) -> common_pb2.GenerateRequest:
        """The worker's request for this prompt, without sampling: what count_tokens counts
        (thinking included: a template's thinking flag changes the prompt's end)."""
        request = common_pb2.GenerateRequest(
            request_id=request_id,
            model=self.model,
            messages=self.router_messages(),
            **self._tools(),
        )
        if self.thinking is not None:
            request.thinking = self.thinking.on
        return request

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
                    parameters_json=check_schema(
                        t.input_schema, f"tools.{i}.input_schema", tool=True
                    ),
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


class MessagesRequest(MessagesBody):
    """The body of ``POST /v1/messages``."""

    max_tokens: UInt32
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    stream: bool = False

    def thinking_blocks(self) -> ThinkingBlocks | None:
        """How the answer shows the model's thinking: None, left out (thinking disabled, which
        an R1, thinking always, cannot honour otherwise); else as ``display`` says."""
        thinking = self.thinking
        if thinking is not None and not thinking.on:
            return None
        return ThinkingBlocks(shown=thinking is None or thinking.display in (None, "summarized"))

    def check_budget(self) -> None:
        """Anthropic's checks of an enabled thinking's budget, 400s in its own words."""
        thinking = self.thinking
        if thinking is None or thinking.type != "enabled":
            return
        param = "thinking.budget_tokens"
        if thinking.budget_tokens is None:
            raise InvalidRequestError("thinking.enabled.budget_tokens: Field required", param=param)
        if thinking.budget_tokens < MIN_BUDGET_TOKENS:
            raise InvalidRequestError(
                "thinking.enabled.budget_tokens: Input should be greater than or equal to "
                f"{MIN_BUDGET_TOKENS}",
                param=param,
            )
        if thinking.budget_tokens >= self.max_tokens:
            raise InvalidRequestError(
                "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our "
                "documentation at https://docs.claude.com/en/docs/build-with-claude/"
                "extended-thinking#max-tokens-and-context-window-size",
                param=param,
            )

    def generate_request(self, request_id: str) -> common_pb2.GenerateRequest:
        request = self.prompt_request(request_id)
        if self.thinking is not None and self.thinking.budget_tokens is not None:
            request.thinking_budget_tokens = self.thinking.budget_tokens
        request.sampling.CopyFrom(
            sampling_params(
                stop=self.stop_sequences or [],
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                max_tokens=self.max_tokens,
            )
        )
        return request


# Anthropic fields this gateway does not implement (server-side tools and containers): refused
# rather than dropped (docs/API.md lists the fields still ignored)
UNSUPPORTED_MESSAGES_FIELDS = ("container", "mcp_servers")

B = TypeVar("B", bound=MessagesBody)


def parse_messages_request(body: Any, model: type[B]) -> B:
    request = parse_body(model, body)
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


def anthropic_usage(tokens: TokenUsage) -> dict[str, int]:
    """Anthropic's counts: ``input_tokens`` are the prompt's tokens read from no cache, so the
    prompt is ``input_tokens + cache_read_input_tokens`` (+ creation, always 0 here)."""
    return {
        "input_tokens": tokens.prompt_tokens - tokens.cached_prompt_tokens,
        "output_tokens": tokens.completion_tokens,
        "cache_read_input_tokens": tokens.cached_prompt_tokens,
        "cache_creation_input_tokens": 0,
    }


def message(
    mid: str,
    model: str,
    content: list[dict[str, Any]],
    stop_reason: StopReason | None,
    tokens: TokenUsage,
    context_management: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``message`` object; without a stop reason the start of a stream."""
    body = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": anthropic_usage(tokens),
    }
    if context_management is not None:
        body["context_management"] = context_management
    return body


def content(
    text: str, tool_calls: list[dict[str, Any]] | None, thinking: ThinkingBlocks | None = None
) -> list[dict[str, Any]]:
    """A message's blocks: its thinking (as ``thinking`` has it shown), its text, then its calls
    (``tool_calls`` in OpenAI's shape, as gateway.api.tools.ToolCalls assembles them). No empty text
    block: Anthropic's API refuses one when a client sends the history back."""
    blocks = [thinking.block()] if thinking is not None and thinking.text else []
    if text:
        blocks.append({"type": "text", "text": text})
    return blocks + [
        tool_use(c["id"], c["function"]["name"], _input(c["function"]["arguments"]))
        for c in tool_calls or ()
    ]


class ThinkingBlocks:
    """The model's thinking as a message shows it: a ``thinking`` block whose text is the
    thinking, or empty where ``display`` omits it, and whose ``signature`` (which clients must
    send back with the block) is an opaque digest of the whole thinking, checked by no one: the
    thinking of earlier turns never reaches the prompt."""

    def __init__(self, shown: bool) -> None:
        self.shown = shown
        self.text = ""

    def add(self, text: str) -> str:
        """Adds a piece; what of it the block shows."""
        self.text += text
        return text if self.shown else ""

    def signature(self) -> str:
        return base64.b64encode(hashlib.sha256(self.text.encode()).digest()).decode()

    def block(self) -> dict[str, Any]:
        return {
            "type": "thinking",
            "thinking": self.text if self.shown else "",
            "signature": self.signature(),
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


def stream_start(mid: str, model: str, tokens: TokenUsage) -> list[dict[str, Any]]:
    """The events before the first content block; ``tokens``: the prompt's, known by then."""
    return [
        {"type": "message_start", "message": message(mid, model, [], None, tokens)},
        {"type": "ping"},
    ]


class StreamBlocks:
    """A streamed message's content blocks, each started when its first content arrives (so no
    empty text block) and stopped when the next starts: the thinking (its text in
    ``thinking_delta`` events, its signature in a ``signature_delta`` as it stops), the text, then
    one block per call whose input streams as JSON deltas. ``thinking`` None: the thinking is
    left out."""

    def __init__(self, thinking: ThinkingBlocks | None) -> None:
        self._thinking = thinking
        self._started = 0  # blocks started
        self._open: int | None = None  # the index of the block open now
        self._thinking_index: int | None = None  # the thinking block's index, once started
        self._text: int | None = None  # the text block's index, once started
        self._calls: dict[int, int] = {}  # call index -> its block's index

    def thinking(self, text: str) -> list[dict[str, Any]]:
        if not text or self._thinking is None:
            return []
        events = []
        if self._thinking_index is None:
            self._thinking_index = self._next()
            start = {"type": "thinking", "thinking": "", "signature": ""}
            events = [*self.stop(), _block_start(self._thinking_index, start)]
            self._open = self._thinking_index
        shown = self._thinking.add(text)
        if shown:
            delta = {"type": "thinking_delta", "thinking": shown}
            events.append(
                {"type": "content_block_delta", "index": self._thinking_index, "delta": delta}
            )
        return events

    def text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = []
        if self._text is None:
            self._text = self._next()
            events = [*self.stop(), _block_start(self._text, {"type": "text", "text": ""})]
            self._open = self._text
        delta = {"type": "text_delta", "text": text}
        return [*events, {"type": "content_block_delta", "index": self._text, "delta": delta}]

    def tool_call(self, call: int, call_id: str, name: str, arguments: str) -> list[dict[str, Any]]:
        """A piece of call ``call``: its first carries id and name, every one argument text."""
        events = []
        if call_id:
            self._calls[call] = self._next()
            events = [*self.stop(), _block_start(self._calls[call], tool_use(call_id, name, {}))]
            self._open = self._calls[call]
        if arguments:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            events.append(
                {"type": "content_block_delta", "index": self._calls[call], "delta": delta}
            )
        return events

    def stop(self) -> list[dict[str, Any]]:
        """Stops the open block, if any."""
        if self._open is None:
            return []
        index, self._open = self._open, None
        events = []
        if index == self._thinking_index and self._thinking is not None:
            delta = {"type": "signature_delta", "signature": self._thinking.signature()}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        return [*events, {"type": "content_block_stop", "index": index}]

    def _next(self) -> int:
        self._started += 1
        return self._started - 1


def _block_start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def stream_end(
    stop_reason: StopReason, tokens: TokenUsage, context_management: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The events after the last block stopped; usage counts are the totals."""
    delta: dict[str, Any] = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": None},
        "usage": anthropic_usage(tokens),
    }
    if context_management is not None:
        delta["context_management"] = context_management
    return [delta, {"type": "message_stop"}]
