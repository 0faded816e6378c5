"""The engine's public surface as the gRPC server sees it, without torch.

Every engine speaks it: the DeepSeek-V3 `Engine` (torch_engine/, torch), `VllmEngine`
(vllm_engine/) and the simulated `SimEngine` (sim_engine/, no model), each putting its requests
through one `RequestFront` (request_front.py) and reporting its speed with meters.py's meters.
Keeping these types here lets a simulated worker start without importing torch, so one machine
can host dozens of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from infermesh.names import FinishReason, Precision
from infermesh.text.chat_templates import ReasoningFormat
from infermesh.text.text_files import TextFiles
from worker_svc.engine.cache_events import CacheEvents

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
    # bytes per token of the KV blocks it sends and takes from peers (KVBlockPeer); 0: none
    kv_transfer_bytes_per_token: int = 0
    # prompt tokens it prefills in one step beside decoding sequences; 0: a whole prompt at once
    prefill_chunk_tokens: int = 0


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
    # the prompt's KV blocks a peer computed (Worker.KVBlocks), for an engine that takes them
    peer_prefix: PeerPrefix | None = None


@dataclass(frozen=True)
class RawTensor:
    """A tensor as it travels between workers: C-order bytes of ``shape`` in ``dtype`` (a torch
    dtype's name)."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PeerBlock:
    """The KV cache of one block of infermesh.prefix_hash.BLOCK_TOKENS tokens, named by its
    chained hash: the engine's cache tensors for its tokens."""

    prefix_hash: int
    tensors: tuple[RawTensor, ...]


@dataclass(frozen=True)
class PeerPrefix:
    """KV blocks of a prompt from a peer: its BLOCK_TOKENS-token blocks from number ``first`` on,
    in order. The engine checks each against its own names for the prompt, and its shapes and
    dtypes against its cache; past the first that does not match it computes the prompt."""

    first: int
    blocks: tuple[PeerBlock, ...]


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


@runtime_checkable
class KVBlockPeer(Protocol):
    """An engine whose prefix cache sends its blocks to peers and takes theirs (the torch and the
    simulated engines): its GenerationRequest.peer_prefix is inserted into its prefix cache before
    the prompt is prefilled."""

    def blocks_to_pull(self, prefix_hashes: Sequence[int]) -> range:
        """Which of a prompt's leading blocks ``prefix_hashes`` (held by a peer) to take from
        it: those past what this engine's cache holds, in whole blocks of its own."""
        ...

    async def export_blocks(self, prefix_hashes: Sequence[int]) -> list[PeerBlock]:
        """The cached blocks ``prefix_hashes`` names, in order, up to the first not held."""
        ...


@runtime_checkable
class MortalEngine(Protocol):
    """An engine that can die on its own while the worker runs (vLLM, whose engine core is a
    child process): the worker then leaves the fleet and exits, for its supervisor to restart."""

    async def died(self) -> str:
        """Returns once the engine can serve no more, with the reason; never while it can."""
        ...


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
