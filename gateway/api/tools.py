"""Tool calling and structured outputs on OpenAI's wire: the request fields (``tools``,
``tool_choice``, ``parallel_tool_calls``, ``response_format``), their checks, what the worker is
asked, and the assembly of the worker's tool-call pieces into OpenAI's ``tool_calls``.

Every schema is checked here (a valid JSON schema, and one the worker's grammar library can
enforce), so a bad one is a 400 naming its parameter rather than an error from the worker.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Annotated, Any, Literal

import jsonschema
import llguidance
from pydantic import BaseModel, Field

from gateway.http.errors import InvalidRequestError
from gateway.http.validation import STRICT
from infermesh.pb import common_pb2

ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
_JSON_OBJECT = {"type": "object"}


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # schemas are always enforced


class FunctionTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class TextFormat(BaseModel):
    """Free text (chat's response_format and Responses' text.format alike)."""

    model_config = STRICT
    type: Literal["text"]

    def answer_schema(self) -> None:
        return None


class JsonObjectFormat(BaseModel):
    """Any JSON object (chat's response_format and Responses' text.format alike)."""

    model_config = STRICT
    type: Literal["json_object"]

    def answer_schema(self) -> dict[str, Any]:
        return _JSON_OBJECT


class JsonSchema(BaseModel):
    model_config = STRICT
    name: ToolName
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # enforced either way


class JsonSchemaFormat(BaseModel):
    """Chat's response_format for a JSON schema (Responses' names it flat, beside its type)."""

    model_config = STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchema

    def answer_schema(self) -> dict[str, Any]:
        return self.json_schema.schema_


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class ToolCallFunction(BaseModel):
    model_config = STRICT
    name: Annotated[str, Field(min_length=1)]
    arguments: str


class AssistantToolCall(BaseModel):
    """A call in an assistant turn of the history."""

    model_config = STRICT
    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"]
    function: ToolCallFunction


def check_schema(schema: dict[str, Any], param: str, *, tool: bool = False) -> str:
    """The schema as JSON text; a 400 naming ``param`` when it is not a valid JSON schema or uses
    what the grammar library cannot enforce. A ``tool``'s arguments are decoded leniently (the
    worker's grammar leaves out the keywords it cannot enforce, as ``propertyNames`` in Claude
    Code's tools), so that one such tool does not refuse an agent's every request."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise InvalidRequestError(
            f"Invalid JSON schema in '{param}': {e.message}", param=param
        ) from None
    text = json.dumps(schema)
    checked = {**schema, "x-guidance": {"lenient": True}} if tool else schema
    error = llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_json_schema(json.dumps(checked))
    )
    if error:
        raise InvalidRequestError(
            f"The JSON schema in '{param}' cannot be enforced: {error}", param=param
        )
    return text


def structure(
    tools: list[FunctionTool] | None,
    tool_choice: ToolChoice | None,
    parallel: bool,
    answer_schema: dict[str, Any] | None,
    *,
    tool_params: list[str] | None = None,
    schema_param: str = "response_format.json_schema.schema",
) -> dict[str, Any]:
    """The ``GenerateRequest`` fields for these request fields (``answer_schema``: the JSON schema
    the answer must fit, a response format's ``answer_schema()``; None: free text); 400s naming
    the bad one. ``tool_params`` and ``schema_param`` name where the request holds each tool's
    parameters schema and the answer's schema, when not where chat completions holds them."""
    tools = tools or []
    names = [t.function.name for t in tools]
    params = tool_params or [f"tools.{i}.function.parameters" for i in range(len(tools))]
    fields: dict[str, Any] = {
        "tools": [
            common_pb2.Tool(
                name=t.function.name,
                description=t.function.description or "",
                parameters_json=check_schema(
                    t.function.parameters or _JSON_OBJECT,
                    param,
                    tool=True,
                ),
            )
            for t, param in zip(tools, params, strict=True)
        ]
    }
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidRequestError(
            f"Invalid value for 'tools': duplicate function names {', '.join(duplicates)}",
            param="tools",
        )
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in names:
            raise InvalidRequestError(
                f"Invalid value for 'tool_choice': no tool named "
                f"'{tool_choice.function.name}' in 'tools'",
                param="tool_choice",
            )
        fields.update(tool_choice=common_pb2.TOOL_CHOICE_NAMED, tool_name=tool_choice.function.name)
    elif tool_choice == "required" and not tools:
        raise InvalidRequestError(
            "Invalid value for 'tool_choice': 'required' needs 'tools'", param="tool_choice"
        )
    elif tool_choice is not None:
        fields["tool_choice"] = {
            "auto": common_pb2.TOOL_CHOICE_AUTO,
            "none": common_pb2.TOOL_CHOICE_NONE,
            "required": common_pb2.TOOL_CHOICE_REQUIRED,
        }[tool_choice]
    fields["single_tool_call"] = not parallel
    if answer_schema is not None:
        fields["json_schema"] = check_schema(answer_schema, schema_param)
    return fields


def history_calls(calls: Iterable[AssistantToolCall]) -> list[common_pb2.ToolCall]:
    return [
        common_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
        for c in calls
    ]


class ToolCalls:
    """One choice's tool calls, assembled from the worker's pieces."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, deltas: Iterable[common_pb2.ToolCallDelta]) -> None:
        for d in deltas:
            call = self.calls.setdefault(
                d.index,
                {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}},
            )
            call["function"]["arguments"] += d.arguments

    def message_field(self) -> list[dict[str, Any]] | None:
        """``message.tool_calls``: None without calls, as OpenAI omits them."""
        return [self.calls[i] for i in sorted(self.calls)] or None


def chunk_deltas(deltas: Iterable[common_pb2.ToolCallDelta]) -> list[dict[str, Any]]:
    """A stream chunk's ``delta.tool_calls``: id, type and name with a call's first piece."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        entry: dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments}}
        if d.id:
            entry.update(id=d.id, type="function")
            entry["function"]["name"] = d.name
        out.append(entry)
    return out
