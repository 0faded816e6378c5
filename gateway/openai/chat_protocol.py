"""OpenAI chat completions on the wire: request models and response builders.

``OpenAIGeneration`` holds the fields chat and legacy completions share, and how
they become the router's ``SamplingParams`` and ``BatchingHints``. Responses are
plain dicts in exactly the shape the OpenAI API returns.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.accounts.usage import TokenUsage
from gateway.api.tools import (
    AssistantToolCall,
    FunctionTool,
    ResponseFormat,
    ToolChoice,
    history_calls,
    structure,
)
from gateway.api.wire import (
    GPU_HEADER,
    PRECISION_HEADER,
    Name,
    TextPart,
    UInt32,
    joined_text,
    sampling_params,
)
from gateway.http.errors import InvalidRequestError
from gateway.http.validation import STRICT, parse_body, refuse_fields
from infermesh.names import PRECISIONS, FinishReason, Precision
from infermesh.pb import common_pb2

Penalty = Annotated[float, Field(ge=-2, le=2)]
_GPU_KIND = r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,63}$"  # "A100", "NVIDIA A100-SXM4-80GB"
GpuKind = Annotated[str, Field(pattern=_GPU_KIND)]


def router_role(role: str) -> str:
    """The role the worker renders: OpenAI's ``developer`` turns are system instructions, and
    DeepSeek's chat templates know only ``system`` (they would drop a ``developer`` turn)."""
    return "system" if role == "developer" else role


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None  # null: tool calls only
    name: Annotated[str, Field(max_length=256)] | None = None
    # assistant turns
    tool_calls: Annotated[list[AssistantToolCall], Field(min_length=1)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1)] | None = None  # tool turns: the call answered
    # an earlier turn's thinking (DeepSeek's API): dropped, as DeepSeek's templates drop it
    reasoning_content: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _calls_need_no_content(cls, data: Any) -> Any:
        """An assistant turn of tool calls may leave content out; every other turn must send it."""
        if isinstance(data, dict) and data.get("tool_calls") and "content" not in data:
            return {**data, "content": None}
        return data

    @model_validator(mode="after")
    def _shape_of_role(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                "content is required (only an assistant turn with tool_calls may omit it)"
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool messages, and only they, need a tool_call_id")
        return self

    def router_message(self) -> common_pb2.ChatMessage:
        return common_pb2.ChatMessage(
            role=router_role(self.role),
            content=joined_text(self.content or ""),
            tool_calls=history_calls(self.tool_calls or ()),
            tool_call_id=self.tool_call_id or "",
        )


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class BatchingFields(BaseModel):
    """Per-request batching hints and queue priority (integers, else 400), top level or in
    ``extra_body``."""

    model_config = STRICT
    max_parallel: UInt32 | None = None
    dynamic_batch_timeout_ms: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    # infermesh: when the fleet is full, higher first among the same key's waiting requests
    priority: Annotated[int, Field(ge=-10, le=10)] | None = None


class MeshRequest(BatchingFields):
    """What every OpenAI-wire request names for the mesh: the model, and where and how it may run
    (precision, GPU kind, batching hints). Subclasses say how it samples (``sampling``)."""

    model: Name
    precision: Precision | None = None
    gpu: GpuKind | None = None  # only workers of this GPU kind (a Capabilities.gpu_kind)
    extra_body: BatchingFields | None = None  # a client that sent the SDK's extra_body literally

    def sampling(self, choice: int) -> common_pb2.SamplingParams:
        raise NotImplementedError

    def batching(self) -> common_pb2.BatchingHints | None:
        hints = common_pb2.BatchingHints()
        for source in (self.extra_body, self):
            if source is None:
                continue
            if source.max_parallel is not None:
                hints.max_parallel = source.max_parallel
            if source.dynamic_batch_timeout_ms is not None:
                hints.dynamic_batch_timeout_ms = source.dynamic_batch_timeout_ms
        return hints if hints.ListFields() else None

    def generate_request(
        self,
        request_id: str,
        choice: int,
        *,
        messages: Iterable[common_pb2.ChatMessage] = (),
        prompt: str = "",
    ) -> common_pb2.GenerateRequest:
        request = common_pb2.GenerateRequest(
            request_id=request_id if choice == 0 else f"{request_id}-{choice}",
            model=self.model,
            messages=messages,
            prompt=prompt,
            sampling=self.sampling(choice),
            precision=PRECISIONS[self.precision]
            if self.precision
            else common_pb2.PRECISION_UNSPECIFIED,
            gpu=self.gpu or "",
        )
        batching = self.batching()
        if batching is not None:
            request.batching.CopyFrom(batching)
        for source in (self.extra_body, self):
            if source is not None and source.priority is not None:
                request.priority = source.priority
        return request


class OpenAIGeneration(MeshRequest):
    """The fields chat and legacy completions share."""

    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: UInt32 | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    user: Annotated[str, Field(max_length=256)] | None = None
    # names the client's session: its requests go where their prefix is cached
    # (gateway.mesh.affinity)
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def token_limit(self) -> int | None:
        return self.max_tokens

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self, choice: int) -> common_pb2.SamplingParams:
        """The router's sampling parameters for choice ``choice`` of ``n``: each choice
        gets its own seed, so n seeded choices differ yet repeat."""
        # OpenAI seeds are signed; the proto's are not
        return sampling_params(
            stop=self.stop_list(),
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.token_limit(),
            seed=None if self.seed is None else (self.seed + choice) % 2**64,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )


# OpenAI's reasoning efforts: "none" asks a model not to reason, every other to reason (a
# DeepSeek model's thinking is on or off, however hard it is asked to think)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ChatTemplateKwargs(BaseModel):
    """vLLM's ``chat_template_kwargs``: the keys DeepSeek's templates read, ``thinking`` (V3.1,
    V3.2) and ``enable_thinking`` (vLLM's and SGLang's alias, from Qwen3's templates); any other
    key is refused by name, as a template would not read it."""

    model_config = ConfigDict(strict=True, extra="forbid")
    thinking: bool | None = None
    enable_thinking: bool | None = None

    @model_validator(mode="after")
    def _one_answer(self) -> ChatTemplateKwargs:
        if None not in (self.thinking, self.enable_thinking) and (
            self.thinking != self.enable_thinking
        ):
            raise ValueError("thinking and enable_thinking disagree")
        return self

    @property
    def think(self) -> bool | None:
        return self.thinking if self.thinking is not None else self.enable_thinking


def thinking_of(effort: ReasoningEffort | None) -> bool | None:
    """The thinking flag an OpenAI reasoning effort asks for (None: the template's default)."""
    return None if effort is None else effort != "none"


class ChatCompletionRequest(OpenAIGeneration):
    """The body of ``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: UInt32 | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: ChatTemplateKwargs | None = None
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: at most this many thinking tokens, then the model is made to close its thinking
    thinking_token_budget: Annotated[int, Field(ge=1, le=2**32 - 1)] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling(self, choice: int) -> common_pb2.SamplingParams:
        sampling = super().sampling(choice)
        sampling.logprobs = self.logprobs
        sampling.top_logprobs = self.top_logprobs or 0
        return sampling

    def router_messages(self) -> list[common_pb2.ChatMessage]:
        return [m.router_message() for m in self.messages]

    def generate_request(
        self,
        request_id: str,
        choice: int,
        *,
        messages: Iterable[common_pb2.ChatMessage] = (),
        prompt: str = "",
    ) -> common_pb2.GenerateRequest:
        request = super().generate_request(request_id, choice, messages=messages, prompt=prompt)
        request.MergeFrom(self._structure)
        if self.thinking is not None:
            request.thinking = self.thinking
        if self.thinking_token_budget is not None:
            request.thinking_budget_tokens = self.thinking_token_budget
        return request

    @property
    def thinking(self) -> bool | None:
        """Thinking as the template's kwargs set it, else as the reasoning effort asks."""
        kwargs = self.chat_template_kwargs
        if kwargs is not None and kwargs.think is not None:
            return kwargs.think
        return thinking_of(self.reasoning_effort)

    @functools.cached_property
    def _structure(self) -> common_pb2.GenerateRequest:
        """Tools, tool choice and response format: checked once for all choices."""
        return common_pb2.GenerateRequest(
            **structure(
                self.tools,
                self.tool_choice,
                self.parallel_tool_calls,
                self.response_format.answer_schema() if self.response_format else None,
            )
        )


# OpenAI fields this gateway does not implement: refused rather than dropped, since the answer
# would not be what the client asked for (docs/API.md lists the fields still ignored)
UNSUPPORTED_CHAT_FIELDS = (
    "functions",
    "function_call",
    "logit_bias",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
)


G = TypeVar("G", bound=MeshRequest)


def with_precision_header(body: G, headers: Mapping[str, str]) -> G:
    """The precision and GPU kind headers apply when the body names none."""
    header = headers.get(PRECISION_HEADER)
    if body.precision is None and header is not None:
        if header not in PRECISIONS:
            raise InvalidRequestError(
                f"Invalid header {PRECISION_HEADER}: expected fp8, bf16, fp16 or fp32",
                param=PRECISION_HEADER,
            )
        body = body.model_copy(update={"precision": header})
    gpu = headers.get(GPU_HEADER)
    if body.gpu is None and gpu is not None:
        if not re.match(_GPU_KIND, gpu):
            raise InvalidRequestError(
                f"Invalid header {GPU_HEADER}: expected a GPU kind such as A100", param=GPU_HEADER
            )
        body = body.model_copy(update={"gpu": gpu})
    return body


def parse_chat_request(body: Any, headers: Mapping[str, str]) -> ChatCompletionRequest:
    request = with_precision_header(parse_body(ChatCompletionRequest, body), headers)
    refuse_fields(body, UNSUPPORTED_CHAT_FIELDS)
    return request


def completion_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def openai_usage(tokens: TokenUsage) -> dict[str, Any]:
    """OpenAI's usage object of chat and legacy completions (the prompt counts cached tokens)."""
    return {
        "prompt_tokens": tokens.prompt_tokens,
        "completion_tokens": tokens.completion_tokens,
        "total_tokens": tokens.prompt_tokens + tokens.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": tokens.cached_prompt_tokens},
        "completion_tokens_details": {"reasoning_tokens": tokens.reasoning_tokens},
    }


def token_logprobs(items: Iterable[common_pb2.TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries."""

    def entry(t: common_pb2.TokenLogprob) -> dict[str, Any]:
        return {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes or t.token.encode())}

    return [{**entry(t), "top_logprobs": [entry(a) for a in t.top]} for t in items]


def chat_choice(
    index: int,
    text: str,
    finish_reason: FinishReason,
    logprobs: list[dict[str, Any]] | None,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str = "",
) -> dict[str, Any]:
    """A choice; a reasoning model's thinking is the message's ``reasoning_content`` (DeepSeek's
    API), left out when it did not think."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text or (None if tool_calls else text),
        "refusal": None,
    }
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": index,
        "message": message,
        "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
        "finish_reason": finish_reason,
    }


def chat_completion(
    cid: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    """A whole ``chat.completion`` object."""
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
    }


def chat_chunk(
    cid: str,
    created: int,
    model: str,
    index: int,
    delta: dict[str, Any],
    finish_reason: FinishReason | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    with_usage_field: bool = False,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``usage: null`` when the stream ends with a usage chunk."""
    chunk: dict[str, Any] = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                "finish_reason": finish_reason,
            }
        ],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(
    cid: str, created: int, model: str, usage: dict[str, Any], kind: str = "chat.completion.chunk"
) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    return {
        "id": cid,
        "object": kind,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [],
        "usage": usage,
    }


def model_object(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "infermesh"}


def model_list(models: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": models}
