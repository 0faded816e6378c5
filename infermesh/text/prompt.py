"""A request's prompt as token ids: the one rendering both the gateway (from the GenerateRequest
it sends) and the worker (from the same message, converted by ``chat_message`` and
``tool_definition``) do, so that the two produce the same ids."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from infermesh.pb import common_pb2

if TYPE_CHECKING:  # transformers brings torch, which a simulated worker never imports
    from infermesh.text.tokenizer import Tokenizer


class UnrenderableToolsError(ValueError):
    """The request has tools and the served chat template cannot render their definitions."""

    def __init__(self) -> None:
        super().__init__("tools: this model's chat template cannot render tool definitions")


def chat_message(m: common_pb2.ChatMessage) -> dict[str, Any]:
    """A chat message in OpenAI's shape, as chat templates take it."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


def tool_definition(name: str, description: str, parameters_json: str) -> dict[str, Any]:
    """A tool as HF chat templates take it (OpenAI's shape)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": json.loads(parameters_json),
        },
    }


def render_token_ids(
    tokenizer: Tokenizer,
    messages: Sequence[dict[str, Any]] | None,
    prompt: str | None,
    tools: Sequence[dict[str, Any]],
    thinking: bool | None = None,
) -> list[int]:
    """Chat messages (with ``tools``, as ``tool_definition`` shapes them; ``thinking``, the
    template's thinking flag, None: its default) rendered with the served template, or raw text;
    UnrenderableToolsError for tools the template cannot render."""
    if messages:
        if tools and not tokenizer.renders_tools:
            raise UnrenderableToolsError()
        return tokenizer.encode_chat(
            [_template_message(m) for m in messages], list(tools), thinking
        )
    assert prompt is not None, "exactly one of messages and prompt"
    return tokenizer.encode(prompt)


def request_token_ids(tokenizer: Tokenizer, request: common_pb2.GenerateRequest) -> list[int]:
    """The ids a worker with ``tokenizer`` renders ``request`` to."""
    return render_token_ids(
        tokenizer,
        [chat_message(m) for m in request.messages],
        request.prompt,
        [tool_definition(t.name, t.description, t.parameters_json) for t in request.tools],
        request.thinking if request.HasField("thinking") else None,
    )


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as HF chat templates take it: an assistant turn of only tool calls has no
    content."""
    if message.get("tool_calls") and not message["content"]:
        return {**message, "content": None}
    return message
