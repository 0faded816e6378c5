"""Anthropic's server-side context editing (``context_management``), applied before the prompt
reaches the mesh, as Anthropic applies it before the prompt reaches the model. The client keeps its
whole history and resends it; only what the model sees is edited.

- ``clear_tool_uses_20250919``: once the prompt exceeds ``trigger`` (input tokens, as the worker
  counts them, or tool uses), the results of all but the last ``keep`` tool uses are replaced by a
  placeholder (and their inputs emptied, with ``clear_tool_inputs``), except those of
  ``exclude_tools``; not at all when that would clear fewer than ``clear_at_least`` tokens.
- ``clear_thinking_20251015``: thinking blocks of earlier turns never reach the prompt (DeepSeek's
  templates drop earlier turns' thinking), so there is nothing to clear.

Counting tokens asks a worker (``Router.Tokenize``), only when an edit could apply.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gateway.anthropic.messages_protocol import (
    ClearToolUses,
    InputTokens,
    Message,
    MessagesBody,
    ToolResultBlock,
    ToolUseBlock,
)

CLEARED_RESULT = "[tool result cleared to save context]"

B = TypeVar("B", bound=MessagesBody)
Counter = Callable[[MessagesBody], Awaitable[int]]  # a prompt's input tokens, as billed


async def apply_edits(body: B, count: Counter) -> tuple[B, list[dict[str, Any]]]:
    """``body`` with its edits applied in order, and the edits that changed it in Anthropic's
    ``applied_edits`` shape."""
    applied: list[dict[str, Any]] = []
    for edit in body.context_management.edits if body.context_management else ():
        if isinstance(edit, ClearToolUses):
            edited = await _clear_tool_uses(body, edit, count)
            if edited is not None:
                body, cleared = edited
                applied.append(cleared)
    return body, applied


async def _clear_tool_uses(
    body: B, edit: ClearToolUses, count: Counter
) -> tuple[B, dict[str, Any]] | None:
    uses = [
        b
        for m in body.messages
        if isinstance(m.content, list)
        for b in m.content
        if isinstance(b, ToolUseBlock)
    ]
    excluded = set(edit.exclude_tools or ())
    kept = len(uses) - edit.keep.value
    cleared = [u.id for u in uses[: max(kept, 0)] if u.name not in excluded]
    if not cleared:
        return None
    if not isinstance(edit.trigger, InputTokens) and len(uses) <= edit.trigger.value:
        return None
    before = await count(body)
    if isinstance(edit.trigger, InputTokens) and before <= edit.trigger.value:
        return None
    inputs = edit.clear_tool_inputs
    clear_inputs = (
        set(cleared) if inputs is True else {u.id for u in uses if u.name in (inputs or ())}
    )
    edited = body.model_copy(
        update={"messages": [_cleared(m, set(cleared), clear_inputs) for m in body.messages]}
    )
    saved = before - await count(edited)
    if edit.clear_at_least is not None and saved < edit.clear_at_least.value:
        return None
    return edited, {
        "type": edit.type,
        "cleared_tool_uses": len(cleared),
        "cleared_input_tokens": max(saved, 0),
    }


def _cleared(message: Message, results: set[str], inputs: set[str]) -> Message:
    """The turn with the results of ``results`` (tool use ids) replaced by the placeholder and the
    inputs of ``inputs`` emptied."""
    if not isinstance(message.content, list):
        return message
    blocks = [
        b.model_copy(update={"content": CLEARED_RESULT, "is_error": False})
        if isinstance(b, ToolResultBlock) and b.tool_use_id in results
        else b.model_copy(update={"input": {}})
        if isinstance(b, ToolUseBlock) and b.id in inputs
        else b
        for b in message.content
    ]
    return message.model_copy(update={"content": blocks})
