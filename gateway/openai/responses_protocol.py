"""OpenAI's Responses API on the wire (``POST /v1/responses``): the request model, and its
conversion to the router's ``GenerateRequest``, the one chat completions makes too (the same
sampling, tools, tool choice and structured output), from input items instead of messages.

Items become chat turns: ``message`` items their role's turn (``developer`` a system one),
``function_call`` items the calls of an assistant turn, ``function_call_output`` items tool turns;
``reasoning`` items are dropped, as DeepSeek's templates drop the reasoning of earlier turns.
Function tools grouped in a ``namespace`` tool are offered to the model under one flat name
(``namespace__name``, as Codex flattens them) and their calls answered with the name and
namespace apart again. Tools the mesh cannot offer (hosted tools it cannot run, client
tools whose calls are not function calls) are left out of the prompt and named, never silently
dropped (``gateway.openai.responses``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, field_validator

from gateway.api.tools import (
    FunctionDefinition,
    FunctionTool,
    JsonObjectFormat,
    NamedToolChoice,
    TextFormat,
    ToolChoice,
    ToolName,
    structure,
)
from gateway.api.wire import UInt32, sampling_params
from gateway.http.errors import InvalidRequestError
from gateway.http.validation import STRICT, parse_body, refuse_fields
from gateway.openai.chat_protocol import (
    MeshRequest,
    Penalty,
    ReasoningEffort,
    router_role,
    thinking_of,
    with_precision_header,
)
from infermesh.pb import common_pb2

NonEmpty = Annotated[str, Field(min_length=1)]
ResponseId = Annotated[str, Field(min_length=1, max_length=256)]

# Tools the mesh cannot offer the model: hosted tools OpenAI runs itself, and client tools whose
# calls are other items than function calls.
UnofferedToolType = Literal[
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "computer_use_preview",
    "computer",
    "image_generation",
    "mcp",
    "tool_search",
    "programmatic_tool_calling",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
]
# `include` values: encrypted reasoning and hosted tools' results, which this model never
# produces (nothing to include), and the output text's log probabilities.
Includable = Literal[
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "message.input_image.image_url",
]
LOGPROBS = "message.output_text.logprobs"
_NAMESPACE_SEPARATOR = "__"


class InputText(BaseModel):
    model_config = STRICT
    type: Literal["input_text"]
    text: str


class OutputText(BaseModel):
    model_config = STRICT
    type: Literal["output_text"]
    text: str


class Refusal(BaseModel):
    model_config = STRICT
    type: Literal["refusal"]
    refusal: str


class MediaPart(BaseModel):
    """Images, files and audio: refused, naming the part (the model reads text only)."""

    model_config = STRICT
    type: Literal["input_image", "input_file", "input_audio"]

    @field_validator("type")
    @classmethod
    def _refused(cls, kind: str) -> str:
        raise ValueError(f"this model reads text only; '{kind}' parts are not supported")


ContentPart = Annotated[InputText | OutputText | Refusal | MediaPart, Field(discriminator="type")]


def _text(content: str | list[ContentPart]) -> str:
    """The text of a message or tool output: its parts joined with newlines."""
    if isinstance(content, str):
        return content
    return "\n".join(
        p.refusal if isinstance(p, Refusal) else getattr(p, "text", "") for p in content
    )


class MessageItem(BaseModel):
    model_config = STRICT
    type: Literal["message"]
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None

    def stored(self, new_id: str) -> dict[str, Any]:
        """As ``input_items`` lists it: parts always, an assistant's as output text."""
        kind = "output_text" if self.role == "assistant" else "input_text"
        content: list[dict[str, Any]] = (
            [{"type": kind, "text": self.content}]
            if isinstance(self.content, str)
            else [p.model_dump() for p in self.content]
        )
        if self.role == "assistant":
            for part in content:
                part.setdefault("annotations", [])
        return {
            "id": self.id or new_id,
            "type": "message",
            "role": self.role,
            "status": "completed",
            "content": content,
        }


class FunctionCallItem(BaseModel):
    """A call the model made earlier (sent back by the client, or from a stored response)."""

    model_config = STRICT
    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: str
    namespace: str | None = None
    id: str | None = None

    def stored(self, new_id: str) -> dict[str, Any]:
        item = {
            "id": self.id or new_id,
            "type": "function_call",
            "status": "completed",
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.arguments,
        }
        if self.namespace:
            item["namespace"] = self.namespace
        return item


class FunctionCallOutputItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: str | list[ContentPart]
    id: str | None = None

    def stored(self, new_id: str) -> dict[str, Any]:
        output = (
            self.output if isinstance(self.output, str) else [p.model_dump() for p in self.output]
        )
        return {
            "id": self.id or new_id,
            "type": "function_call_output",
            "status": "completed",
            "call_id": self.call_id,
            "output": output,
        }


class ReasoningItem(BaseModel):
    """Reasoning of an earlier turn: accepted and dropped (see the module docstring)."""

    model_config = STRICT
    type: Literal["reasoning"]


class FunctionToolDef(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # schemas are always enforced

    def echo(self) -> dict[str, Any]:
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict if self.strict is not None else True,
        }


class CustomToolDef(BaseModel):
    model_config = STRICT
    type: Literal["custom"]
    name: str


class NamespaceTool(BaseModel):
    """Function tools under one name (Codex's sub-agent tools, an MCP server's tools)."""

    model_config = STRICT
    type: Literal["namespace"]
    name: ToolName
    description: str = ""
    tools: Annotated[
        list[Annotated[FunctionToolDef | CustomToolDef, Field(discriminator="type")]],
        Field(min_length=1),
    ]


class UnofferedTool(BaseModel):
    model_config = STRICT
    type: UnofferedToolType


Tool = Annotated[FunctionToolDef | NamespaceTool | UnofferedTool, Field(discriminator="type")]


class AdditionalToolsItem(BaseModel):
    """Tools handed over as an input item (Codex 0.17x sends its tools so, not in ``tools``):
    offered as if in ``tools``, never a chat turn, not kept with a stored response."""

    model_config = STRICT
    type: Literal["additional_tools"]
    id: str | None = None
    role: Literal["developer", "system"] | None = None
    tools: list[Tool]


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | AdditionalToolsItem,
    Field(discriminator="type"),
]
_ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


_ITEMS = TypeAdapter(list[InputItem])


def stored_items(items: list[InputItem], new_id: Callable[[str], str]) -> list[dict[str, Any]]:
    """The items as ``input_items`` lists them, with ids (``new_id(prefix)`` where a client sent
    none); reasoning and tool items are not kept."""
    return [
        item.stored(new_id(_ITEM_PREFIXES[item.type]))
        for item in items
        if not isinstance(item, ReasoningItem | AdditionalToolsItem)
    ]


def items_of(stored: list[dict[str, Any]]) -> list[InputItem]:
    """Stored items (a previous response's input and output) read back as input items."""
    return _ITEMS.validate_python(stored)


class FunctionChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: NonEmpty


class TextFormatJsonSchema(BaseModel):
    """Responses' text.format for a JSON schema: chat's JsonSchemaFormat, flat."""

    model_config = STRICT
    type: Literal["json_schema"]
    name: ToolName
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # enforced either way

    def answer_schema(self) -> dict[str, Any]:
        return self.schema_


class TextConfig(BaseModel):
    model_config = STRICT
    format: (
        Annotated[
            TextFormat | JsonObjectFormat | TextFormatJsonSchema,
            Field(discriminator="type"),
        ]
        | None
    ) = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint this model cannot follow


class ReasoningConfig(BaseModel):
    """``effort`` turns a reasoning model's thinking on ("none": off); a model that does not
    reason ignores it, as Codex sends one with every request. ``summary``: the reasoning items
    carry the thinking as their summary too (the model writes no other)."""

    model_config = STRICT
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None
    # which turns' reasoning to keep (Codex: "all_turns"): none reaches the prompt
    context: str | None = None


def flat_name(namespace: str | None, name: str) -> str:
    """The one name a namespaced function is offered to the model under."""
    if not namespace:
        return name
    return f"{namespace.rstrip('_')}{_NAMESPACE_SEPARATOR}{name.lstrip('_')}"


@dataclasses.dataclass(frozen=True)
class ToolSet:
    """A request's tools as the model is offered them."""

    functions: list[FunctionTool]  # flat names
    params: list[str]  # where the request holds each one's parameters schema
    names: dict[str, tuple[str | None, str]]  # flat name -> (namespace, name)
    unoffered: list[str]  # the types left out, sorted
    echo: list[dict[str, Any]]  # the offered tools, as the response lists them

    def call_name(self, flat: str) -> tuple[str | None, str]:
        """(namespace, name) of a call the model made under ``flat``."""
        return self.names.get(flat, (None, flat))


def tool_set(tools: list[tuple[Tool, str]]) -> ToolSet:
    """The tools (each with where the request holds it, e.g. ``tools.0``) as offered."""
    functions: list[FunctionTool] = []
    params: list[str] = []
    names: dict[str, tuple[str | None, str]] = {}
    unoffered: set[str] = set()
    echo: list[dict[str, Any]] = []

    def offer(tool: FunctionToolDef, namespace: str | None, param: str) -> None:
        flat = flat_name(namespace, tool.name)
        # already validated: a flat name may be longer than a function name may be
        definition = FunctionDefinition.model_construct(
            name=flat, description=tool.description, parameters=tool.parameters, strict=tool.strict
        )
        functions.append(FunctionTool.model_construct(type="function", function=definition))
        params.append(param)
        names[flat] = (namespace, tool.name)

    for tool, where in tools:
        if isinstance(tool, FunctionToolDef):
            offer(tool, None, f"{where}.parameters")
            echo.append(tool.echo())
        elif isinstance(tool, NamespaceTool):
            inner = [t for t in tool.tools if isinstance(t, FunctionToolDef)]
            for j, member in enumerate(tool.tools):
                if isinstance(member, FunctionToolDef):
                    offer(member, tool.name, f"{where}.tools.{j}.parameters")
                else:
                    unoffered.add(member.type)
            if inner:
                echo.append(
                    {
                        "type": "namespace",
                        "name": tool.name,
                        "description": tool.description,
                        "tools": [t.echo() for t in inner],
                    }
                )
        else:
            unoffered.add(tool.type)
    return ToolSet(functions, params, names, sorted(unoffered), echo)


class ResponsesRequest(MeshRequest):
    """The body of ``POST /v1/responses``."""

    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: ResponseId | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: UInt32 | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    include: list[Includable] | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] = (
        Field(default_factory=dict)
    )
    user: Annotated[str, Field(max_length=256)] | None = None
    safety_identifier: Annotated[str, Field(max_length=256)] | None = None
    # names the client's session: its requests go where their prefix is cached
    # (gateway.mesh.affinity)
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    reasoning: ReasoningConfig | None = None
    # "auto" is served as "disabled": the gateway cannot count tokens, so it drops no items, and
    # an input past the model's context is a 400 either way
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _messages_may_omit_type(cls, value: Any) -> Any:
        """``{"role": ..., "content": ...}`` is a message item (OpenAI's easy input message)."""
        if not isinstance(value, list):
            return value
        return [
            {**v, "type": "message"}
            if isinstance(v, dict) and "type" not in v and "role" in v
            else v
            for v in value
        ]

    @field_validator("background")
    @classmethod
    def _no_background(cls, background: bool | None) -> bool | None:
        if background:
            raise ValueError("background mode is not supported by this server")
        return background

    @field_validator("metadata")
    @classmethod
    def _short_keys(cls, metadata: dict[str, str]) -> dict[str, str]:
        if any(len(k) > 64 for k in metadata):
            raise ValueError("metadata keys are at most 64 characters")
        return metadata

    def items(self) -> list[InputItem]:
        """This request's input items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(type="message", role="user", content=self.input)]
        return list(self.input or ())

    @property
    def logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())

    def sampling(self, choice: int) -> common_pb2.SamplingParams:
        sampling = sampling_params(
            stop=[],
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_output_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )
        if self.logprobs:
            sampling.logprobs = True
            sampling.top_logprobs = self.top_logprobs or 0
        return sampling

    @functools.cached_property
    def tool_set(self) -> ToolSet:
        """``tools``, then the tools of ``additional_tools`` input items, in order."""
        tools = [(tool, f"tools.{i}") for i, tool in enumerate(self.tools or ())]
        if isinstance(self.input, list):
            for k, item in enumerate(self.input):
                if isinstance(item, AdditionalToolsItem):
                    tools += [(tool, f"input.{k}.tools.{i}") for i, tool in enumerate(item.tools)]
        return tool_set(tools)

    def generate_request(
        self,
        request_id: str,
        choice: int = 0,
        *,
        messages: Iterable[common_pb2.ChatMessage] = (),
        prompt: str = "",
    ) -> common_pb2.GenerateRequest:
        request = super().generate_request(request_id, choice, messages=messages, prompt=prompt)
        request.MergeFrom(common_pb2.GenerateRequest(**self._structure()))
        thinking = thinking_of(self.reasoning.effort if self.reasoning else None)
        if thinking is not None:
            request.thinking = thinking
        return request

    def _structure(self) -> dict[str, Any]:
        """Tools, tool choice and text format as chat completions hands them to the worker."""
        tools = self.tool_set
        choice: ToolChoice | None = (
            NamedToolChoice.model_validate(
                {"type": "function", "function": {"name": self.tool_choice.name}}
            )
            if isinstance(self.tool_choice, FunctionChoice)
            else self.tool_choice
        )
        text_format = self.text.format if self.text else None
        return structure(
            tools.functions,
            choice,
            self.parallel_tool_calls,
            text_format.answer_schema() if text_format else None,
            tool_params=tools.params,
            schema_param="text.format.schema",
        )


# Responses fields this gateway does not implement: refused rather than dropped, since the answer
# would not be what the client asked for (docs/API.md lists those accepted and ignored)
UNSUPPORTED_RESPONSES_FIELDS = (
    "conversation",
    "prompt",
    "context_management",
    "max_tool_calls",
    "background_options",
    "moderation",
    "access_programs",
)


def parse_responses_request(body: Any, headers: Mapping[str, str]) -> ResponsesRequest:
    request = with_precision_header(parse_body(ResponsesRequest, body), headers)
    refuse_fields(body, UNSUPPORTED_RESPONSES_FIELDS)
    return request


def router_messages(
    instructions: str | None, items: list[InputItem]
) -> list[common_pb2.ChatMessage]:
    """The chat turns of ``items`` (after the instructions, a system turn); a 400 for a
    function_call_output whose call is not among the items before it."""
    messages = [common_pb2.ChatMessage(role="system", content=instructions)] if instructions else []
    calls: set[str] = set()
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(
                common_pb2.ChatMessage(role=router_role(item.role), content=_text(item.content))
            )
        elif isinstance(item, FunctionCallItem):
            call = common_pb2.ToolCall(
                id=item.call_id, name=flat_name(item.namespace, item.name), arguments=item.arguments
            )
            calls.add(item.call_id)
            if not (messages and messages[-1].role == "assistant"):
                messages.append(common_pb2.ChatMessage(role="assistant"))
            messages[-1].tool_calls.append(call)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise InvalidRequestError(
                    f"No tool call found for function call output with call_id {item.call_id}.",
                    param="input",
                )
            messages.append(
                common_pb2.ChatMessage(
                    role="tool", tool_call_id=item.call_id, content=_text(item.output)
                )
            )
    if not messages:
        raise InvalidRequestError("Missing required parameter 'input'", param="input")
    return messages
