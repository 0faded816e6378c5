"""The engine's public surface as the gRPC server sees it, without torch.

Every engine speaks it: the DeepSeek-V3 `Engine` (torch_engine/, torch), `VllmEngine`
(vllm_engine/) and the simulated `SimEngine` (sim_engine/, no model), each putting its requests
through one `RequestFront`. Keeping these types here lets a simulated worker start without
importing torch, so one machine can host dozens of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from infermesh.context_limit import ContextOverflow
from infermesh.names import FinishReason, Precision
from infermesh.text.chat_templates import ReasoningFormat
from infermesh.text.text_files import TextFiles
from worker_svc.cache_events import CacheEvents

DeviceKind = Literal["cuda", "rocm", "cpu"]


@dataclass(frozen=True)
class DeviceCapabilities:
    """What the worker runs on and with, as reported to the router."""

    device: DeviceKind
    device_name: str
    compute_capability: str  # "9.0"; "" on CPU
    precision: Precision  # what actually runs
    memory_total_bytes: int
    weight_bytes: int
    # The engine's own estimate for one sequence (0: unknown); the router's hardware fitness.
    decode_tokens_per_second: float = 0.0
    prefill_tokens_per_second: float = 0.0
    gpu_count: int = 1  # memory_total_bytes is theirs together
    kv_cache_bytes: int = 0  # the KV cache's memory when full
    # The served architecture (config.json model_type) and V3.2's sparse attention width (0: dense).
    model_type: str = ""
    index_topk: int = 0
    reasoning_format: ReasoningFormat = ""  # how the served model reasons ("": it does not)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int | None = None  # None: up to the context length
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per earlier occurrence of a generated token
    logprobs: bool = False  # report each sampled token's logprob
    top_logprobs: int = 0  # and this many alternatives

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


ToolChoice = Literal["auto", "none", "required", "named"]


@dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str
    parameters: str  # JSON schema of its arguments, as JSON text


@dataclass(frozen=True)
class Constraints:
    """What the output must look like: tool calls and/or JSON, enforced by a grammar while
    decoding."""

    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    tool_name: str = ""  # with tool_choice "named"
    parallel_tool_calls: bool = True
    json_schema: str | None = None  # the answer is JSON matching this schema (JSON text)

    @property
    def active(self) -> bool:
        return bool(self.tools) or self.json_schema is not None


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    # chat, rendered with the checkpoint's chat template: OpenAI-shaped dicts (role, content; an
    # assistant turn's tool_calls, a tool turn's tool_call_id)
    messages: list[dict[str, Any]] | None
    prompt: str | None  # raw text; exactly one of messages/prompt
    sampling: SamplingParams
    # batching hints, bounded by the worker's limits: run in a batch of at most max_parallel
    # sequences; wait at most dynamic_batch_timeout_ms for others to form a larger batch
    max_parallel: int | None = None
    dynamic_batch_timeout_ms: int | None = None
    constraints: Constraints = Constraints()
    # the prompt as the caller rendered it with the tokenizer the digest `tokenizer` names
    # (infermesh.text.text_files): served when it is the engine's own, else rendered again
    prompt_token_ids: tuple[int, ...] = ()
    tokenizer: str = ""
    # reasoning models: the chat template's thinking flag (None: its default), and at most this
    # many reasoning tokens before the engine makes the model close its thinking (None: no bound)
    thinking: bool | None = None
    thinking_budget_tokens: int | None = None


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of tool call `index`: its first piece carries id and name, later ones argument
    text."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    token: str  # the token's text on its own
    logprob: float
    top: tuple[TokenLogprob, ...] = ()  # the most likely alternatives, best first (one level)


@dataclass
class GenerationChunk:
    text: str  # new text, whole UTF-8 characters, stop text never included
    token_ids: list[int]
    finish_reason: FinishReason | None  # set on the last chunk only
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # prompt tokens whose cache came from the prefix cache
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    queue_s: float = 0.0  # how long the request waited before joining the batch
    tool_calls: list[ToolCallDelta] | None = None  # tool-call pieces decoded with these tokens
    reasoning_text: str = ""  # new thinking (a reasoning model's), apart from the answer's text
    reasoning_tokens: int = 0  # of completion_tokens, those spent thinking (closing tag included)


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    tokens_per_second: float  # recent decode rate
    kv_cache_usage: float = 0.0  # 0..1 of the KV cache in use
    # prompt tokens a second over the recent steps that prefilled (PrefillSpeedMeter); 0: the
    # engine does not measure it, or has not prefilled yet
    prefill_tokens_per_second: float = 0.0


class InvalidArgumentError(ValueError):
    """A request the engine cannot serve (prompt too long, empty, ...); raised by generate() before
    any chunk. The worker answers it with INVALID_ARGUMENT (the gateway's 400)."""


class EngineClosedError(RuntimeError):
    """generate() on, or interrupted by, a closed engine."""


class EngineOverloadedError(RuntimeError):
    """The engine's waiting queue is full; raised by generate() before any chunk
    (RESOURCE_EXHAUSTED)."""


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


class DecodeRateMeter:
    """Tokens decoded per second over the last ``window_s``: what EngineLoad reports.
    Not thread-safe: an engine with a step thread calls it under its lock."""

    def __init__(self, window_s: float = 10.0) -> None:
        self._window_s = window_s
        self._steps: deque[tuple[float, int]] = deque()  # (when, tokens decoded in that step)
        self._tokens = 0  # the sum of _steps' counts

    def add(self, tokens: int) -> None:
        self._steps.append((time.monotonic(), tokens))
        self._tokens += tokens

    def rate(self) -> float:
        """The window's tokens over the time since its first step (at least one second, so a
        single step does not read as a burst)."""
        now = time.monotonic()
        while self._steps and self._steps[0][0] < now - self._window_s:
            self._tokens -= self._steps.popleft()[1]
        span = now - self._steps[0][0] if self._steps else 0.0
        return self._tokens / max(span, 1.0)


class PrefillSpeedMeter:
    """Prompt tokens a second over the last ``steps`` steps that prefilled at least
    ``min_tokens`` (a step of a few prompt tokens is its fixed cost, not a prefill's speed), the
    decodes batched with them included: the speed a prompt is prefilled at on this worker as it
    runs, which the router weighs a cache's saving by. Not thread-safe, as DecodeRateMeter."""

    def __init__(self, steps: int = 32, min_tokens: int = 64) -> None:
        self._min_tokens = min_tokens
        self._steps: deque[tuple[int, float]] = deque(maxlen=steps)  # (prompt tokens, seconds)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens >= self._min_tokens and seconds > 0:
            self._steps.append((tokens, seconds))

    def speed(self) -> float:
        seconds = sum(s for _, s in self._steps)
        return sum(t for t, _ in self._steps) / seconds if seconds else 0.0


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


def merge_chunks(chunks: list[GenerationChunk]) -> GenerationChunk:
    """One chunk for several consecutive ones of a stream: their text and tokens in order,
    the counts and finish reason of the last, the queue wait of the first."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    logprobs = [lp for c in chunks for lp in c.logprobs or ()]
    tool_calls = [d for c in chunks for d in c.tool_calls or ()]
    return GenerationChunk(
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_prompt_tokens=last.cached_prompt_tokens,
        logprobs=logprobs if any(c.logprobs is not None for c in chunks) else None,
        queue_s=chunks[0].queue_s,
        tool_calls=_merged_deltas(tool_calls) or None,
        reasoning_text="".join(c.reasoning_text for c in chunks),
        reasoning_tokens=last.reasoning_tokens,
    )


def _merged_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call as one piece: the first's id and name, the arguments
    joined."""
    merged: list[ToolCallDelta] = []
    for d in deltas:
        if merged and merged[-1].index == d.index and not d.id:
            last = merged[-1]
            merged[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + d.arguments)
        else:
            merged.append(d)
    return merged


async def drain_chunks(
    chunks: asyncio.Queue[GenerationChunk | BaseException], abort: Callable[[], None]
) -> AsyncGenerator[GenerationChunk, None]:
    """Yields what an engine puts on ``chunks`` up to the last chunk (finish_reason set),
    raising an exception put there; calls ``abort()`` if the consumer stops before the end.
    Chunks that queued up while the consumer was busy come out merged into one: a slow
    reader gets fewer, larger messages instead of falling further behind."""
    finished = False
    try:
        while not finished:
            ready = [await chunks.get()]
            while (
                not isinstance(ready[-1], BaseException)
                and ready[-1].finish_reason is None
                and not chunks.empty()
            ):
                ready.append(chunks.get_nowait())
            last = ready[-1]
            error = last if isinstance(last, BaseException) else None
            if error is not None:
                ready.pop()
            if ready:
                merged = merge_chunks(ready)  # type: ignore[arg-type]  # exceptions popped above
                finished = merged.finish_reason is not None
                yield merged
            if error is not None:
                finished = True
                raise error
    finally:
        if not finished:
            abort()


class InferenceEngine(Protocol):
    """What the worker's gRPC server calls; one engine per worker process."""

    capabilities: DeviceCapabilities
    max_model_len: int
    # what it renders prompts with (Capabilities.tokenizer, Worker.TextFiles)
    text_files: TextFiles
    cache_events: CacheEvents  # what its prefix cache stores and evicts

    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Streams the completion; the last chunk carries finish_reason. Closing the iterator aborts
        it."""
        ...

    def prompt_tokens(self, request: GenerationRequest) -> int:
        """The prompt tokens ``generate(request)`` would count, without generating; raises
        InvalidArgumentError as generate() would for the prompt and tools."""
        ...

    def load(self) -> EngineLoad:
        """Running and waiting sequences now; called for every heartbeat."""
        ...

    async def close(self) -> None:
        """Stops the engine; streams still running end with EngineClosedError."""
        ...
