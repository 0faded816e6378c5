"""The request front every engine (torch, vLLM, simulated) puts a request through before it runs
it: the request checks, the completion budget and the bound on live requests, each refusal worded
once, so that a caller gets the same answer, in the same words, from any worker."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

from infermesh.context_limit import ContextOverflow
from worker_svc.engine.api import (
    Constraints,
    EngineClosedError,
    EngineOverloadedError,
    GenerationRequest,
    InvalidArgumentError,
    SamplingParams,
)

_MAX_STOP_SEQUENCES = 16
_MAX_STOP_TOKEN_IDS = 64
_MAX_TOP_LOGPROBS = 20
_PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range for presence/frequency penalties


def check_sampling(p: SamplingParams, vocab_size: int) -> None:
    """Raises InvalidArgumentError for parameters no engine serves: every engine checks
    the same bounds, so a caller gets the same answer from any worker."""
    if p.temperature < 0:
        raise InvalidArgumentError(f"temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise InvalidArgumentError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise InvalidArgumentError(f"top_k must be >= 0, got {p.top_k}")
    if p.max_tokens is not None and p.max_tokens < 1:
        raise InvalidArgumentError(f"max_tokens must be >= 1, got {p.max_tokens}")
    low, high = _PENALTY_RANGE
    for name in ("presence_penalty", "frequency_penalty"):
        if not low <= getattr(p, name) <= high:
            raise InvalidArgumentError(f"{name} must be in [{low}, {high}], got {getattr(p, name)}")
    if not 0 <= p.top_logprobs <= _MAX_TOP_LOGPROBS:
        raise InvalidArgumentError(
            f"top_logprobs must be in 0..{_MAX_TOP_LOGPROBS}, got {p.top_logprobs}"
        )
    if len(p.stop) > _MAX_STOP_SEQUENCES:
        raise InvalidArgumentError(
            f"stop has {len(p.stop)} strings; at most {_MAX_STOP_SEQUENCES} are allowed"
        )
    if len(p.stop_token_ids) > _MAX_STOP_TOKEN_IDS:
        raise InvalidArgumentError(
            f"stop_token_ids has {len(p.stop_token_ids)} "
            f"ids; at most {_MAX_STOP_TOKEN_IDS} are allowed"
        )
    if any(not 0 <= t < vocab_size for t in p.stop_token_ids):
        raise InvalidArgumentError(f"stop_token_ids must be token ids in 0..{vocab_size - 1}")


def check_prompt(request: GenerationRequest) -> None:
    """Raises InvalidArgumentError unless the request has exactly one of messages (each with
    string role and content) and prompt, not empty."""
    if (request.messages is None) == (request.prompt is None):
        raise InvalidArgumentError("exactly one of messages and prompt must be given")
    if request.messages is not None:
        if not request.messages:
            raise InvalidArgumentError("messages is empty")
        for i, m in enumerate(request.messages):
            if not (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise InvalidArgumentError(f"messages[{i}] needs string 'role' and 'content'")
    elif not request.prompt:
        raise InvalidArgumentError("prompt is empty")


def completion_budget(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """How many tokens the completion may have: max_tokens, or what is left of the context.
    Raises InvalidArgumentError when the prompt, or the prompt and max_tokens, do not fit, in the
    words infermesh.context_limit reads back."""
    if prompt_tokens >= max_model_len:
        raise InvalidArgumentError(ContextOverflow(prompt_tokens, None, max_model_len).message())
    if max_tokens is None:
        return max_model_len - prompt_tokens
    if prompt_tokens + max_tokens > max_model_len:
        raise InvalidArgumentError(
            ContextOverflow(prompt_tokens, max_tokens, max_model_len).message()
        )
    return max_tokens


def check_batching_hints(request: GenerationRequest) -> None:
    if request.max_parallel is not None and request.max_parallel < 1:
        raise InvalidArgumentError(f"max_parallel must be >= 1, got {request.max_parallel}")
    timeout_ms = request.dynamic_batch_timeout_ms
    if timeout_ms is not None and timeout_ms < 0:
        raise InvalidArgumentError(f"dynamic_batch_timeout_ms must be >= 0, got {timeout_ms}")


def bounded_batching_hints(
    request: GenerationRequest, max_parallel: int, dynamic_batch_timeout_ms: int
) -> tuple[int, int]:
    """The request's (max_parallel, dynamic_batch_timeout_ms) hints bounded by the worker's."""
    timeout_ms = request.dynamic_batch_timeout_ms
    return (
        min(request.max_parallel or max_parallel, max_parallel),
        dynamic_batch_timeout_ms
        if timeout_ms is None
        else min(timeout_ms, dynamic_batch_timeout_ms),
    )


def check_request(request: GenerationRequest, vocab_size: int) -> None:
    """The checks every engine makes before it tokenizes: prompt, sampling, output constraints,
    batching hints. A caller gets the same answer, worded the same, from any worker."""
    check_prompt(request)
    check_sampling(request.sampling, vocab_size)
    check_constraints(request.constraints)
    check_batching_hints(request)


class RequestFront:
    """The front every engine (torch, vLLM, simulated) puts a request through before it runs it,
    so that a caller gets the same answer, in the same words, from any worker. In generate(), in
    this order: ``check`` (closed, then check_request), the engine reads the prompt, ``budget``
    (the completion's tokens against max_model_len), then ``admitted()`` around the run (the
    bound on live requests). Called on the event loop only."""

    def __init__(
        self, *, vocab_size: int, max_model_len: int, max_parallel: int, max_waiting: int
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._max_parallel = max_parallel
        self._max_waiting = max_waiting
        self.live = 0  # admitted and not ended: running and waiting together
        self.peak_live = 0  # the most live at once: whether callers kept within max_parallel
        self.closed = False

    def check(self, request: GenerationRequest) -> None:
        """Raises EngineClosedError once the engine is closed, else InvalidArgumentError for what
        check_request refuses."""
        if self.closed:
            raise EngineClosedError("the engine is closed")
        check_request(request, self.vocab_size)

    def budget(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """How many tokens the completion may have (completion_budget)."""
        return completion_budget(prompt_tokens, max_tokens, self.max_model_len)

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Counts the request live while the block runs; EngineOverloadedError when max_parallel
        requests run and max_waiting wait already."""
        if self.live >= self._max_parallel + self._max_waiting:
            raise EngineOverloadedError(
                f"the worker is full: {self.live} requests for {self._max_parallel} places "
                f"(max_parallel) and max_waiting {self._max_waiting}; retry later"
            )
        self.live += 1
        self.peak_live = max(self.peak_live, self.live)
        try:
            yield
        finally:
            self.live -= 1

    def close(self) -> None:
        """Requests from now on are refused with EngineClosedError."""
        self.closed = True


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_constraints(c: Constraints) -> None:
    """Raises InvalidArgumentError for tools or a schema no engine can enforce, the same on every
    worker."""
    names = [t.name for t in c.tools]
    for i, tool in enumerate(c.tools):
        if not _TOOL_NAME.fullmatch(tool.name):
            raise InvalidArgumentError(
                f"tools[{i}].name must be 1 to 64 letters, digits, '_' or '-', got {tool.name!r}"
            )
        _json_object(tool.parameters, f"tools[{i}].parameters")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidArgumentError(f"tools has duplicate names: {', '.join(duplicates)}")
    if c.tool_choice in ("required", "named") and not c.tools:
        raise InvalidArgumentError(f"tool_choice {c.tool_choice!r} needs tools")
    if c.tool_choice == "named" and c.tool_name not in names:
        raise InvalidArgumentError(
            f"tool_choice names {c.tool_name!r}, which is not one of the tools"
        )
    if c.json_schema is not None:
        _json_object(c.json_schema, "json_schema")


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidArgumentError(f"{what} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{what} must be a JSON object (a JSON schema)")
    return value
