"""The worker's side of the wire: a GenerateRequest as the engine takes it, a chunk as the
caller reads it, and the failure a request ends with as a gRPC status. Both the unary calls
(server.py) and the Serve stream (serve_server.py) speak through it."""

from __future__ import annotations

import grpc

from infermesh.names import FINISH_REASONS
from infermesh.pb import common_pb2
from infermesh.text.prompt import chat_message
from worker_svc.engine.api import (
    Constraints,
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
    TokenLogprob,
    Tool,
    ToolChoice,
)

_TOOL_CHOICES: dict[int, ToolChoice] = {
    common_pb2.TOOL_CHOICE_AUTO: "auto",
    common_pb2.TOOL_CHOICE_NONE: "none",
    common_pb2.TOOL_CHOICE_REQUIRED: "required",
    common_pb2.TOOL_CHOICE_NAMED: "named",
}


class RequestFailedError(Exception):
    """A request the worker does not serve, with the gRPC status it ends with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def to_engine(request: common_pb2.GenerateRequest) -> GenerationRequest:
    s = request.sampling
    sampling = SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
    )
    hints = request.batching
    return GenerationRequest(
        request_id=request.request_id,
        messages=[chat_message(m) for m in request.messages] or None,
        prompt=request.prompt or None,
        sampling=sampling,
        max_parallel=hints.max_parallel if hints.HasField("max_parallel") else None,
        dynamic_batch_timeout_ms=(
            hints.dynamic_batch_timeout_ms if hints.HasField("dynamic_batch_timeout_ms") else None
        ),
        constraints=_constraints(request),
        prompt_token_ids=tuple(request.prompt_token_ids),
        tokenizer=request.tokenizer,
        thinking=request.thinking if request.HasField("thinking") else None,
        thinking_budget_tokens=(
            request.thinking_budget_tokens if request.HasField("thinking_budget_tokens") else None
        ),
    )


def _constraints(request: common_pb2.GenerateRequest) -> Constraints:
    return Constraints(
        tools=tuple(Tool(t.name, t.description, t.parameters_json) for t in request.tools),
        tool_choice=_TOOL_CHOICES.get(request.tool_choice, "auto"),
        tool_name=request.tool_name,
        parallel_tool_calls=not request.single_tool_call,
        json_schema=request.json_schema or None,
    )


def to_proto(chunk: GenerationChunk) -> common_pb2.GenerateResponse:
    response = common_pb2.GenerateResponse(
        text=chunk.text,
        reasoning_text=chunk.reasoning_text,
        token_ids=chunk.token_ids,
        finish_reason=common_pb2.FINISH_REASON_UNSPECIFIED
        if chunk.finish_reason is None
        else FINISH_REASONS[chunk.finish_reason],
    )
    # the last chunk's usage, and the first's: its prompt count is known before any other
    if chunk.finish_reason is not None or chunk.completion_tokens == len(chunk.token_ids):
        response.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=chunk.prompt_tokens,
                completion_tokens=chunk.completion_tokens,
                cached_prompt_tokens=chunk.cached_prompt_tokens,
                reasoning_tokens=chunk.reasoning_tokens,
            )
        )
    if chunk.logprobs is not None:
        response.logprobs.extend(_logprob_to_proto(lp) for lp in chunk.logprobs)
    for d in chunk.tool_calls or ():
        response.tool_calls.add(index=d.index, id=d.id, name=d.name, arguments=d.arguments)
    return response


def _logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token=lp.token,
        logprob=lp.logprob,
        bytes=lp.token.encode(),
        top=[_logprob_to_proto(alt) for alt in lp.top],
    )
