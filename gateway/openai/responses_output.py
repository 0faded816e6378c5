"""The Responses API's answer: the ``response`` object, its output items, and the stream events
that build them, in exactly the shapes of the openai SDK's models.

``OutputBuilder`` turns one generation's chunks into output items, each step returning the stream
events that build the same items; the non-streamed answer runs the same steps and keeps only the
items, so what ``responses.stream()`` assembles is what ``responses.create()`` answers. Events
carry no ``sequence_number`` here: the stream numbers them as it sends them.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from gateway.accounts.usage import TokenUsage
from gateway.openai.chat_protocol import now_s, token_logprobs
from gateway.openai.responses_protocol import ResponsesRequest, ToolSet
from infermesh.pb import common_pb2

Status = Literal["in_progress", "completed", "incomplete", "failed"]
Event = dict[str, Any]

# The response's metadata entry (and header) naming the tools left out of the prompt.
UNSUPPORTED_TOOLS = "x-infermesh-unsupported-tools"
UNSUPPORTED_TOOLS_METADATA = "infermesh_unsupported_tools"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(tokens: TokenUsage) -> dict[str, Any]:
    """The Responses API's usage object (the input counts the cached tokens)."""
    return {
        "input_tokens": tokens.prompt_tokens,
        # the prefix cache is automatic: nothing is written to it on request
        "input_tokens_details": {
            "cached_tokens": tokens.cached_prompt_tokens,
            "cache_write_tokens": 0,
        },
        "output_tokens": tokens.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": tokens.reasoning_tokens},
        "total_tokens": tokens.prompt_tokens + tokens.completion_tokens,
    }


class ResponseShell:
    """The fields of one response that do not change while it is written: ``object(...)`` is
    the response object in any of its states."""

    def __init__(self, body: ResponsesRequest, response_id: str, created_at: int) -> None:
        self.id = response_id
        self._fields = _echo(body)
        self._fields["created_at"] = created_at
        unoffered = body.tool_set.unoffered
        if unoffered:
            self._fields["metadata"] = {
                **body.metadata,
                UNSUPPORTED_TOOLS_METADATA: ",".join(unoffered),
            }

    def object(
        self,
        status: Status,
        output: list[dict[str, Any]],
        tokens: TokenUsage | None = None,
        error: str | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            **self._fields,
            "status": status,
            "completed_at": now_s() if status == "completed" else None,
            "error": None if error is None else {"code": "server_error", "message": error},
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "output": output,
            "usage": None if tokens is None else responses_usage(tokens),
        }


def _echo(body: ResponsesRequest) -> dict[str, Any]:
    """What the response repeats of its request (OpenAI's defaults where it sent nothing)."""
    text_format = body.text.format if body.text and body.text.format else None
    return {
        "background": False,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "metadata": body.metadata,
        "model": body.model,
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "prompt_cache_key": body.prompt_cache_key,
        # the Response object's reasoning: effort and summary (a request's context is not echoed)
        "reasoning": body.reasoning.model_dump(include={"effort", "summary"})
        if body.reasoning
        else {"effort": None, "summary": None},
        "safety_identifier": body.safety_identifier,
        "service_tier": "default",
        "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {
            "format": text_format.model_dump(by_alias=True) if text_format else {"type": "text"},
            "verbosity": body.text.verbosity if body.text and body.text.verbosity else "medium",
        },
        "tool_choice": body.tool_choice.model_dump()
        if body.tool_choice is not None and not isinstance(body.tool_choice, str)
        else body.tool_choice or "auto",
        "tools": body.tool_set.echo,
        "top_logprobs": body.top_logprobs or 0,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        "user": body.user,
    }


class OutputBuilder:
    """One generation's output items (``output``), written from the worker's chunks: a reasoning
    model's thinking is a ``reasoning`` item, its text a ``reasoning_text`` content part (as
    open-weight reasoning models' are served), streamed with OpenAI's
    ``response.reasoning_text.*`` events (which Open Responses names ``response.reasoning.*``),
    and with ``summary`` its summary too (the model writes no other)."""

    def __init__(self, tools: ToolSet, logprobs: bool, summary: bool = False) -> None:
        self.output: list[dict[str, Any]] = []
        self._tools = tools
        self._logprobs = logprobs
        self._summary = summary
        self._open: dict[str, Any] | None = None  # the item being written, in its final shape

    def add(self, chunk: common_pb2.GenerateResponse) -> list[Event]:
        """The events of one worker chunk."""
        events: list[Event] = []
        if chunk.reasoning_text:
            events += self._reasoning(chunk.reasoning_text)
        if chunk.text:
            logprobs = token_logprobs(chunk.logprobs) if self._logprobs else []
            events += self._text(chunk.text, logprobs)
        for piece in chunk.tool_calls:
            if piece.id:  # a call's first piece
                events += self._close("completed")
                events += self._open_call(piece)
            if piece.arguments and self._open is not None:
                self._open["arguments"] += piece.arguments
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self._open["id"],
                        "output_index": len(self.output),
                        "delta": piece.arguments,
                    }
                )
        return events

    def finish(self, incomplete: bool) -> list[Event]:
        """The events that close the output: an answer of nothing is one empty message; the
        item cut by max_output_tokens is ``incomplete``."""
        events = [] if self.output or self._open else self._text("", [])
        return events + self._close("incomplete" if incomplete else "completed")

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != "message":
            events += self._close("completed")
            events += self._open_message()
        assert self._open is not None, "a message is open"
        part = self._open["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        if text:
            events.append(
                {
                    **self._where(),
                    "type": "response.output_text.delta",
                    "content_index": 0,
                    "delta": text,
                    "logprobs": logprobs,
                }
            )
        return events

    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._close("completed")
            events += self._open_reasoning()
        assert self._open is not None, "a reasoning item is open"
        self._open["content"][0]["text"] += text
        events.append(
            {
                **self._where(),
                "type": "response.reasoning_text.delta",
                "content_index": 0,
                "delta": text,
            }
        )
        if self._summary:
            self._open["summary"][0]["text"] += text
            events.append(
                {
                    **self._where(),
                    "type": "response.reasoning_summary_text.delta",
                    "summary_index": 0,
                    "delta": text,
                }
            )
        return events

    def _open_reasoning(self) -> list[Event]:
        self._open = {
            "id": new_id("rs"),
            "type": "reasoning",
            "status": "in_progress",
            "summary": [_summary_part("")] if self._summary else [],
            "content": [_reasoning_part("")],
        }
        events = [
            self._added({**self._open, "summary": [], "content": []}),
            {
                **self._where(),
                "type": "response.content_part.added",
                "content_index": 0,
                "part": _reasoning_part(""),
            },
        ]
        if self._summary:
            events.append(
                {
                    **self._where(),
                    "type": "response.reasoning_summary_part.added",
                    "summary_index": 0,
                    "part": _summary_part(""),
                }
            )
        return events

    def _open_message(self) -> list[Event]:
        self._open = {
            "id": new_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [_text_part("", [])],
        }
        return [
            self._added({**self._open, "content": []}),
            {
                **self._where(),
                "type": "response.content_part.added",
                "content_index": 0,
                "part": _text_part("", []),
            },
        ]

    def _open_call(self, piece: common_pb2.ToolCallDelta) -> list[Event]:
        namespace, name = self._tools.call_name(piece.name)
        self._open = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": piece.id,
            "name": name,
            "arguments": "",
        }
        if namespace:
            self._open["namespace"] = namespace
        return [self._added(dict(self._open))]

    def _close(self, status: Status) -> list[Event]:
        """Ends the open item, if any, with ``status``."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.output)}
        events: list[Event]
        if item["type"] == "function_call":
            events = [
                {
                    **where,
                    "type": "response.function_call_arguments.done",
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            ]
        else:  # a message or a reasoning item: one text part
            part = item["content"][0]
            done = {**where, "type": _TEXT_DONE[item["type"]], "content_index": 0}
            done["text"] = part["text"]
            if "logprobs" in part:
                done["logprobs"] = part["logprobs"]
            events = [
                done,
                {**where, "type": "response.content_part.done", "content_index": 0, "part": part},
            ]
            for summary in item.get("summary", ()):
                events += [
                    {
                        **where,
                        "type": "response.reasoning_summary_text.done",
                        "summary_index": 0,
                        "text": summary["text"],
                    },
                    {
                        **where,
                        "type": "response.reasoning_summary_part.done",
                        "summary_index": 0,
                        "part": summary,
                    },
                ]
        events.append(
            {"type": "response.output_item.done", "output_index": len(self.output), "item": item}
        )
        self.output.append(item)
        return events

    def _added(self, item: dict[str, Any]) -> Event:
        return {
            "type": "response.output_item.added",
            "output_index": len(self.output),
            "item": item,
        }

    def _where(self) -> dict[str, Any]:
        assert self._open is not None, "an item is open"
        return {"item_id": self._open["id"], "output_index": len(self.output)}


# the event that ends an item's text part
_TEXT_DONE = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _summary_part(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}
