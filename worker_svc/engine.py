"""The async engine the gRPC server calls: requests in, streamed text chunks out.

`generate()` validates a request, turns it into a scheduler `Sequence` and reads its chunks from
an asyncio queue. Model compute runs in one background thread (`_StepLoop`): each iteration is
one scheduling step and one batched forward pass over every running sequence (worker_svc.scheduler,
worker_svc.model_runner), then sampling, detokenization and stop checks for the sequences that got
a token. Request lifecycle: waiting -> running -> finished, or aborted when the consumer goes
away (its blocks are freed at the next step).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import torch

from infermesh.names import FinishReason
from worker_svc.checkpoint import load_checkpoint, read_config
from worker_svc.config import CacheSection, ParallelSection
from worker_svc.engine_api import (EngineClosedError, EngineLoad, EngineOverloadedError, GenerationChunk,
                                   GenerationRequest, InvalidRequestError, SamplingParams, TokenLogprob,
                                   Tool, check_batching_hints, check_constraints, check_sampling,
                                   drain_chunks)
from worker_svc.kv_cache import (BlockManager, bytes_per_token, cache_budget_bytes, index_bytes_per_token,
                                 latent_bytes_per_token)
from worker_svc.grammar import GrammarCompiler, apply_masks
from worker_svc.model import Transformer
from worker_svc.model_runner import ModelRunner
from worker_svc.precision import TORCH_DTYPES, DeviceCapabilities, detect_capabilities, resolve_device
from worker_svc.sampling import sample_batch, token_logprobs
from worker_svc.scheduler import Scheduler, SchedulerOutput, Sequence
from worker_svc.tokenizer import IncrementalDetokenizer, Tokenizer
from worker_svc.tool_parser import ToolCallParser

logger = logging.getLogger(__name__)

_RATE_WINDOW_S = 10.0



@dataclass
class _Stream:
    """The engine's side of one request: how it samples and stops, and where its chunks go."""

    seq: Sequence
    request_id: str
    params: SamplingParams
    max_len: int  # prompt + completion limit
    stop_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator
    emit: Callable[[GenerationChunk | BaseException], None]  # thread-safe: hands an item to the consumer
    matcher: llguidance.LLMatcher | None = None  # the grammar its tokens must follow
    tool_parser: ToolCallParser | None = None  # set when it may call tools

    @property
    def output_ids(self) -> list[int]:
        return self.seq.token_ids[self.seq.num_prompt_tokens :]

    def finish_reason(self, token: int) -> FinishReason | None:
        if token in self.stop_token_ids:
            return "tool_calls" if self.tool_parser is not None and self.tool_parser.calls else "stop"
        if len(self.seq.token_ids) >= self.max_len:
            return "length"
        return None


class _StepLoop:
    """The thread that owns the scheduler and the model runner: one forward pass per iteration.

    submit()/abort()/load()/close() are called from the event loop; everything else runs on the thread.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, tokenizer: Tokenizer, max_waiting: int):
        self._scheduler, self._runner, self._tokenizer = scheduler, runner, tokenizer
        self._max_waiting = max_waiting
        self._lock = threading.Condition()
        self._incoming: list[_Stream] = []
        self._aborts: list[int] = []
        self._closed = False
        self._streams: dict[int, _Stream] = {}  # seq_id -> stream, thread only
        self._live = 0  # submitted and not ended: what the waiting bound counts
        self._load = EngineLoad(0, 0, 0.0)
        self._decode_times: deque[tuple[float, int]] = deque()  # (when, tokens sampled in that step)
        self._thread = threading.Thread(target=self._run, name="worker-step-loop", daemon=True)
        self._thread.start()

    def submit(self, stream: _Stream) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed")
            if self._live >= self._scheduler.max_parallel + self._max_waiting:
                raise EngineOverloadedError(
                    f"the worker is full: {self._live} requests for {self._scheduler.max_parallel} places "
                    f"(max_parallel) and max_waiting {self._max_waiting}; retry later"
                )
            self._live += 1
            self._incoming.append(stream)
            self._lock.notify()

    def abort(self, seq_id: int) -> None:
        """The consumer went away: the sequence is dropped, and its blocks freed, at the next step."""
        with self._lock:
            self._aborts.append(seq_id)
            self._lock.notify()

    def load(self) -> EngineLoad:
        with self._lock:
            now = time.monotonic()
            while self._decode_times and self._decode_times[0][0] < now - _RATE_WINDOW_S:
                self._decode_times.popleft()
            tokens = sum(n for _, n in self._decode_times)
            span = now - self._decode_times[0][0] if self._decode_times else 0.0
            rate = tokens / max(span, 1.0)
            return dataclasses.replace(self._load, waiting=self._load.waiting + len(self._incoming),
                                       tokens_per_second=rate)  # fmt: skip

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()

    # ------------------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while self._take_requests():
            output = self._scheduler.schedule()
            self._publish_load()  # before a chunk of this step reaches a consumer
            if output.scheduled:
                self._step(output)
                self._publish_load()
            else:
                self._idle()
        error = EngineClosedError("engine closed during generation")
        for seq_id in list(self._streams):
            self._end(seq_id, error)
        self._publish_load()

    def _take_requests(self) -> bool:
        """Hand new and aborted requests to the scheduler; False once the engine is closed."""
        with self._lock:
            incoming, aborts = self._incoming, self._aborts
            self._incoming, self._aborts = [], []
            closed = self._closed
        for stream in incoming:
            self._streams[stream.seq.seq_id] = stream
            self._scheduler.add_request(stream.seq)
        for seq_id in aborts:
            if self._forget(seq_id) is not None:
                self._scheduler.abort_request(seq_id)
        return not closed

    def _idle(self) -> None:
        """Nothing to compute: sleep until a request arrives, or a held one may be admitted."""
        with self._lock:
            if not (self._incoming or self._aborts or self._closed):
                self._lock.wait(self._scheduler.seconds_until_admission())

    def _publish_load(self) -> None:
        s = self._scheduler
        with self._lock:
            self._load = EngineLoad(len(s.running), len(s.waiting), 0.0, s.blocks.usage)

    def _step(self, output: SchedulerOutput) -> None:
        try:
            logits = self._runner.execute(output)
        except Exception as e:  # a model/runtime failure ends this step's requests, not the engine
            logger.exception("forward pass over %d sequences failed", len(output.scheduled))
            for s in output.scheduled:
                self._end(s.seq.seq_id, e)
            return
        streams = [self._streams[s.seq.seq_id] for s in output.scheduled if s.samples]
        self._scheduler.complete_step(output)
        logits = apply_masks(logits, [st.matcher for st in streams])
        tokens = sample_batch(logits, [st.params for st in streams], [st.generator for st in streams],
                              [st.output_ids if st.params.has_penalties else [] for st in streams])  # fmt: skip
        with self._lock:
            self._decode_times.append((time.monotonic(), len(tokens)))
        for stream, token, row in zip(streams, tokens, logits):
            try:
                self._append(stream, token, row)
            except Exception as e:
                logger.exception("request %s failed", stream.request_id)
                self._end(stream.seq.seq_id, e)

    def _append(self, stream: _Stream, token: int, logits: torch.Tensor) -> None:
        """Add a sampled token: stream its text, and end the sequence on a stop or at its length."""
        stream.seq.token_ids.append(token)
        if stream.matcher is not None and not stream.matcher.consume_token(token):
            raise RuntimeError(f"token {token} broke the request's grammar: {stream.matcher.get_error()}")
        finish = stream.finish_reason(token)
        detok = stream.detokenizer
        calls = stream.tool_parser.add(token) if stream.tool_parser is not None else None
        if calls is not None:  # a token of the tool calls: no text
            text = detok.flush()  # text held back for a possible stop string is text after all
            if finish == "length":
                calls += stream.tool_parser.finish()  # type: ignore[union-attr]
        elif token in stream.stop_token_ids:
            text = detok.flush()
        else:
            text = detok.add(token)
            if detok.stopped:
                finish = "stop"
            elif finish is not None:
                text += detok.flush()
        logprobs = self._logprobs(logits, token, stream.params) if stream.params.logprobs else None
        seq = stream.seq
        stream.emit(GenerationChunk(text, [token], finish, seq.num_prompt_tokens, len(seq.token_ids) -
                                    seq.num_prompt_tokens, seq.num_cached_prompt_tokens, logprobs,
                                    seq.queue_s, calls or None))  # fmt: skip
        if finish is not None:
            self._forget(seq.seq_id)
            self._scheduler.finish_request(seq)

    def _logprobs(self, logits: torch.Tensor, token: int, params: SamplingParams) -> list[TokenLogprob]:
        logprob, top = token_logprobs(logits, token, params.top_logprobs)
        decode = self._tokenizer.decode
        alternatives = tuple(TokenLogprob(decode([i]), lp) for i, lp in top)
        return [TokenLogprob(decode([token]), logprob, alternatives)]

    def _end(self, seq_id: int, error: BaseException) -> None:
        """A failed sequence leaves the batch now and frees its blocks; the error ends its stream."""
        stream = self._forget(seq_id)
        if stream is not None:
            self._scheduler.abort_request(seq_id)
            stream.emit(error)

    def _forget(self, seq_id: int) -> _Stream | None:
        stream = self._streams.pop(seq_id, None)
        if stream is not None:
            with self._lock:
                self._live -= 1
        return stream


# ----------------------------------------------------------------------------------------- engine


class Engine:
    """Entry point of the worker: load with `from_checkpoint`, then `generate()` concurrently."""

    def __init__(
        self, model: Transformer, tokenizer: Tokenizer, capabilities: DeviceCapabilities, device: torch.device,
        max_model_len: int, eos_token_ids: frozenset[int], parallel: ParallelSection, cache: CacheSection,
    ):  # fmt: skip
        self.model, self.tokenizer, self.capabilities = model, tokenizer, capabilities
        self.max_model_len = max_model_len
        self.parallel = parallel.resolved(capabilities.device, capabilities.device_name)
        self._eos_token_ids = eos_token_ids
        self._seq_ids = itertools.count()
        self.grammars = GrammarCompiler(tokenizer, model.args.vocab_size, sorted(eos_token_ids))
        blocks = _block_manager(model, device, max_model_len, cache)
        kv_cache = model.setup_cache(blocks.num_blocks, blocks.block_size)
        self.capabilities = dataclasses.replace(capabilities, kv_cache_bytes=kv_cache.nbytes)
        dtype = model.lm_head.weight.dtype
        logger.info("latent cache: %d blocks of %d tokens (%.1f MB; per token %d B latent + %d B indexer keys); "
                    "max_parallel %d, batch timeout %d ms", blocks.num_blocks, blocks.block_size,
                    kv_cache.nbytes / 2**20, latent_bytes_per_token(model.args, dtype),
                    index_bytes_per_token(model.args, dtype), self.parallel.max_parallel,
                    self.parallel.dynamic_batch_timeout_ms)  # fmt: skip
        scheduler = Scheduler(blocks, self.parallel.max_parallel, self.parallel.prefill_chunk_size)
        runner = ModelRunner(model, kv_cache, device)
        self._loop = _StepLoop(scheduler, runner, tokenizer, self.parallel.max_waiting)

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str | Path,
        *,
        dtype: str = "auto",
        use_native_fp8: bool | None = None,
        max_model_len: int | None = None,
        device: str = "auto",
        parallel: ParallelSection | None = None,
        cache: CacheSection | None = None,
    ) -> Engine:
        """Load weights and tokenizer and allocate the cache (blocking: call it before serving, or in a thread)."""
        # OpenMP keeps a pool of worker threads for each thread that ran a parallel op; with more pooled
        # threads than cores it stops spinning between ops, and each op of the step loop then waits for a
        # futex wake-up (a CPU decode step ~30% slower). Loading and allocating in a thread that ends
        # takes its pool along: the step loop's is the process's only one.
        load = functools.partial(cls._load, model_dir, dtype=dtype, use_native_fp8=use_native_fp8,
                                 max_model_len=max_model_len, device=device, parallel=parallel, cache=cache)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="worker-load") as loader:
            return loader.submit(load).result()

    @classmethod
    def _load(
        cls, model_dir: str | Path, *, dtype: str, use_native_fp8: bool | None, max_model_len: int | None,
        device: str, parallel: ParallelSection | None, cache: CacheSection | None,
    ) -> Engine:  # fmt: skip
        torch_device = resolve_device(device)
        fp8_weights = "quantization_config" in read_config(model_dir)[0]  # DeepSeek-V2 ships BF16
        caps = detect_capabilities(torch_device, dtype=dtype, use_native_fp8=use_native_fp8, fp8_weights=fp8_weights)
        model, config = load_checkpoint(model_dir, TORCH_DTYPES[caps.precision], torch_device)
        weight_bytes = sum(t.nbytes for t in model.state_dict().values())
        caps = dataclasses.replace(caps, weight_bytes=weight_bytes, model_type=config["model_type"],
                                   index_topk=model.args.index_topk)  # fmt: skip
        context = config["max_position_embeddings"]
        if max_model_len is not None and not 0 < max_model_len <= context:
            raise ValueError(f"max_model_len={max_model_len} must be in 1..{context} (max_position_embeddings)")
        tokenizer = Tokenizer(model_dir)
        eos = _eos_token_ids(Path(model_dir), config, tokenizer)
        logger.info("loaded %s: %.1f MB of weights as %s", model_dir, weight_bytes / 2**20, caps.precision)
        return cls(model, tokenizer, caps, torch_device, max_model_len or context, eos,
                   parallel or ParallelSection(), cache or CacheSection())  # fmt: skip

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the completion; the last chunk carries finish_reason. Stopping iteration aborts it.

        Raises InvalidRequestError or EngineOverloadedError before any chunk.
        """
        stream, queue = self._stream(request)
        self._loop.submit(stream)
        abort = functools.partial(self._loop.abort, stream.seq.seq_id)
        async with contextlib.aclosing(drain_chunks(queue, abort)) as chunks:
            async for chunk in chunks:
                yield chunk

    def load(self) -> EngineLoad:
        return self._loop.load()

    async def close(self) -> None:
        """Stop the step loop; streams still running end with EngineClosedError."""
        await asyncio.to_thread(self._loop.close)

    def _stream(self, request: GenerationRequest) -> tuple[_Stream, asyncio.Queue]:
        check_constraints(request.constraints)
        prompt_ids = prompt_token_ids(self.tokenizer, request)
        params = request.sampling
        check_sampling(params, self.model.args.vocab_size)
        matcher = self.grammars.matcher(request.constraints)
        markers = self.grammars.markers
        may_call = bool(request.constraints.tools) and request.constraints.tool_choice != "none"
        max_len = completion_limit(len(prompt_ids), params.max_tokens, self.max_model_len)
        max_parallel, timeout_ms = self._batching(request)
        queue: asyncio.Queue[GenerationChunk | BaseException] = asyncio.Queue()
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(next(self._seq_ids), list(prompt_ids), len(prompt_ids), max_parallel, timeout_ms / 1000)
        stream = _Stream(
            seq=seq,
            request_id=request.request_id,
            params=params,
            max_len=max_len,
            stop_token_ids=self._eos_token_ids | frozenset(params.stop_token_ids),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop),
            generator=torch.Generator().manual_seed(seed),
            emit=_emitter(asyncio.get_running_loop(), queue),
            matcher=matcher,
            tool_parser=ToolCallParser(self.tokenizer, markers) if may_call and markers is not None else None,
        )
        return stream, queue

    def _batching(self, request: GenerationRequest) -> tuple[int, int]:
        """The request's (max_parallel, dynamic_batch_timeout_ms) hints, bounded by this worker's limits."""
        limits = self.parallel
        assert limits.max_parallel is not None and limits.dynamic_batch_timeout_ms is not None, "unresolved limits"
        check_batching_hints(request)
        max_parallel = min(request.max_parallel or limits.max_parallel, limits.max_parallel)
        timeout_ms = limits.dynamic_batch_timeout_ms
        if request.dynamic_batch_timeout_ms is not None:
            timeout_ms = min(request.dynamic_batch_timeout_ms, timeout_ms)
        return max_parallel, timeout_ms


def prompt_token_ids(tokenizer: Tokenizer, request: GenerationRequest) -> list[int]:
    """The request's prompt as token ids: chat messages rendered with the checkpoint's template, or raw
    text; every engine serving a checkpoint takes these, so counts and prefix hashes agree across them."""
    if (request.messages is None) == (request.prompt is None):
        raise InvalidRequestError("exactly one of messages and prompt must be given")
    if request.messages is not None:
        if not request.messages:
            raise InvalidRequestError("messages is empty")
        for i, m in enumerate(request.messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise InvalidRequestError(f"messages[{i}] needs string 'role' and 'content'")
        tools = request.constraints.tools
        if tools and not tokenizer.renders_tools:
            raise InvalidRequestError("tools: this model's chat template cannot render tool definitions")
        return tokenizer.encode_chat([_template_message(m) for m in request.messages],
                                     [_tool_definition(t) for t in tools])
    if not request.prompt:
        raise InvalidRequestError("prompt is empty")
    return tokenizer.encode(request.prompt)


def completion_limit(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """Where the sequence stops with `length`: max_tokens past the prompt, or the context."""
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {prompt_len} tokens; max_model_len is {max_model_len} (the prompt and at "
            "least one generated token must fit)"
        )
    if max_tokens is None:
        return max_model_len
    if prompt_len + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context "
            f"length {max_model_len}"
        )
    return prompt_len + max_tokens


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as HF chat templates take it: an assistant turn of only tool calls has no content."""
    if message.get("tool_calls") and not message["content"]:
        return {**message, "content": None}
    return message


def _tool_definition(tool: Tool) -> dict[str, Any]:
    """A tool as HF chat templates take it (OpenAI's shape)."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": json.loads(tool.parameters)}}


def _block_manager(model: Transformer, device: torch.device, max_model_len: int, cache: CacheSection) -> BlockManager:
    """As many blocks as the memory budget holds; at least one whole context, so any request can finish."""
    per_block = bytes_per_token(model.args, model.lm_head.weight.dtype) * cache.block_size
    budget = cache_budget_bytes(device, cache.gpu_memory_utilization, cache.cpu_cache_bytes)
    num_blocks = budget // per_block
    needed = -(-max_model_len // cache.block_size)
    if num_blocks < needed:
        knob = "gpu_memory_utilization" if device.type == "cuda" else "cpu_cache_bytes"
        raise ValueError(
            f"[cache] {knob}: the latent cache would hold {max(num_blocks, 0) * cache.block_size} tokens, fewer "
            f"than one context of max_model_len={max_model_len} ({needed * per_block} bytes); raise {knob} or "
            "lower [attention] max_model_len"
        )
    return BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)


def _emitter(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue
) -> Callable[[GenerationChunk | BaseException], None]:
    def emit(item: GenerationChunk | BaseException) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is gone; its abort follows
            pass

    return emit


def _eos_token_ids(model_dir: Path, config: dict, tokenizer: Tokenizer) -> frozenset[int]:
    """eos ids from generation_config.json (int or list), else config.json, else the tokenizer."""
    eos = config.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    if eos is None:
        eos = tokenizer.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else eos or [])
