"""The async engine the gRPC server calls: requests in, streamed text chunks out.

Model compute runs in one background thread (`Scheduler`); each `generate()` call owns a
`Sequence` and reads its chunks from an asyncio queue the thread fills. The scheduler interleaves
sequences one step at a time; issue #3 replaces it with batched continuous batching.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from worker_svc.checkpoint import load_checkpoint
from worker_svc.model import KVCache, Transformer
from worker_svc.precision import TORCH_DTYPES, DeviceCapabilities, detect_capabilities, resolve_device
from worker_svc.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

_PREFILL_CHUNK_TOKENS = 256  # prompt tokens per step, so a long prompt does not stall other streams
_RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int | None = None  # None: up to the context length
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    messages: list[dict[str, str]] | None  # chat, rendered with the checkpoint's chat template
    prompt: str | None  # raw text; exactly one of messages/prompt
    sampling: SamplingParams


@dataclass
class GenerationChunk:
    text: str  # new text, whole UTF-8 characters, stop text never included
    token_ids: list[int]
    finish_reason: Literal["stop", "length"] | None  # set on the last chunk only
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    tokens_per_second: float  # recent decode rate


class InvalidRequestError(ValueError):
    """A request the engine cannot serve (prompt too long, empty, ...); raised by generate() before any chunk."""


class EngineClosedError(RuntimeError):
    """generate() on, or interrupted by, a closed engine."""


# -------------------------------------------------------------------------------------- sampling


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.size(-1):
        return logits
    kth = logits.topk(k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum - sorted_logits.softmax(-1) >= p  # the mass before this token already reaches p
    return logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits: [vocab] float32 -> one token id."""
    if params.temperature == 0:
        return int(logits.argmax())
    logits = apply_top_p(apply_top_k(logits / params.temperature, params.top_k), params.top_p)
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


# ------------------------------------------------------------------------------------- sequences


@dataclass
class Sequence:
    """One request inside the scheduler. Touched by the scheduler thread only, except `aborted`."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int  # prompt + completion limit
    stop_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator
    emit: Callable[[GenerationChunk | BaseException], None]  # thread-safe: hands an item to the consumer
    cache: KVCache | None = None
    num_computed: int = 0  # tokens whose latents are in the cache
    output_ids: list[int] = field(default_factory=list)
    next_logits: torch.Tensor | None = None
    aborted: bool = False

    def chunk(self, text: str, ids: list[int], finish: Literal["stop", "length"] | None) -> GenerationChunk:
        return GenerationChunk(text, ids, finish, len(self.prompt_ids), len(self.output_ids))


class Scheduler:
    """Owns the model and the step loop thread; each step advances every running sequence once.

    add_request()/abort_request() are called from the event loop; step() runs on the thread:
    a prefill chunk for a sequence still reading its prompt, else one sampled token.
    """

    def __init__(self, model: Transformer, device: torch.device):
        self.model, self.device = model, device
        self._lock = threading.Condition()
        self._incoming: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._closed = False
        self._decode_times: deque[float] = deque()
        self._thread = threading.Thread(target=self._loop, name="worker-step-loop", daemon=True)
        self._thread.start()

    def add_request(self, seq: Sequence) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed")
            self._incoming.append(seq)
            self._lock.notify()

    def abort_request(self, seq: Sequence) -> None:
        """The consumer went away: the sequence is dropped, and its cache freed, at the next step."""
        seq.aborted = True
        with self._lock:
            self._lock.notify()

    def load(self) -> EngineLoad:
        with self._lock:
            running, waiting = len(self._running), len(self._incoming)
            now = time.monotonic()
            while self._decode_times and self._decode_times[0] < now - _RATE_WINDOW_S:
                self._decode_times.popleft()
            n = len(self._decode_times)
            span = now - self._decode_times[0] if n else 0.0
        return EngineLoad(running, waiting, n / max(span, 1.0) if n else 0.0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._closed or self._incoming or self._running):
                    self._lock.wait()
                if self._closed:
                    pending = [*self._incoming, *self._running]
                    self._incoming.clear()
                    self._running.clear()
                    break
                self._running.extend(self._incoming)
                self._incoming.clear()
            self.step()
        for seq in pending:
            seq.cache = None
            seq.emit(EngineClosedError("engine closed during generation"))

    def step(self) -> None:
        for seq in list(self._running):
            finished = seq.aborted
            if not finished:
                try:
                    finished = self._advance(seq)
                except Exception as e:  # a model/runtime failure ends this request, not the engine
                    logger.exception("request %s failed", seq.request_id)
                    seq.emit(e)
                    finished = True
            if finished:
                seq.cache = None
                with self._lock:
                    self._running.remove(seq)

    def _advance(self, seq: Sequence) -> bool:
        """One step of one sequence; True when it finished."""
        if seq.cache is None:
            seq.cache = self.model.setup_cache(1, seq.max_len)
        if seq.num_computed < len(seq.prompt_ids):
            chunk = seq.prompt_ids[seq.num_computed : seq.num_computed + _PREFILL_CHUNK_TOKENS]
            seq.next_logits = self._forward(chunk, seq)
            return False
        token = sample(seq.next_logits, seq.params, seq.generator)
        seq.output_ids.append(token)
        with self._lock:
            self._decode_times.append(time.monotonic())
        finish = self._finish_reason(seq, token)
        if token in seq.stop_token_ids:
            text = seq.detokenizer.flush()
        else:
            text = seq.detokenizer.add(token)
            if seq.detokenizer.stopped:
                finish = "stop"
            elif finish is not None:
                text += seq.detokenizer.flush()
        seq.emit(seq.chunk(text, [token], finish))
        if finish is None:
            seq.next_logits = self._forward([token], seq)
        return finish is not None

    @staticmethod
    def _finish_reason(seq: Sequence, token: int) -> Literal["stop", "length"] | None:
        if token in seq.stop_token_ids:
            return "stop"
        if len(seq.prompt_ids) + len(seq.output_ids) >= seq.max_len:
            return "length"
        return None

    def _forward(self, ids: list[int], seq: Sequence) -> torch.Tensor:
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        logits = self.model(tokens, seq.num_computed, seq.cache)[0]  # [vocab]
        seq.num_computed += len(ids)
        return logits.cpu()


# ----------------------------------------------------------------------------------------- engine


class Engine:
    """Entry point of the worker: load with `from_checkpoint`, then `generate()` concurrently."""

    def __init__(
        self, model: Transformer, tokenizer: Tokenizer, capabilities: DeviceCapabilities, device: torch.device,
        max_model_len: int, eos_token_ids: frozenset[int],
    ):  # fmt: skip
        self.model, self.tokenizer, self.capabilities = model, tokenizer, capabilities
        self.max_model_len = max_model_len
        self._eos_token_ids = eos_token_ids
        self._scheduler = Scheduler(model, device)

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str | Path,
        *,
        dtype: str = "auto",
        use_native_fp8: bool | None = None,
        max_model_len: int | None = None,
        device: str = "auto",
    ) -> Engine:
        """Load weights and tokenizer (blocking: call it before serving, or in a thread)."""
        torch_device = resolve_device(device)
        caps = detect_capabilities(torch_device, dtype=dtype, use_native_fp8=use_native_fp8)
        model, config = load_checkpoint(model_dir, TORCH_DTYPES[caps.precision], torch_device)
        weight_bytes = sum(t.nbytes for t in model.state_dict().values())
        caps = dataclasses.replace(caps, weight_bytes=weight_bytes)
        context = config["max_position_embeddings"]
        if max_model_len is not None and not 0 < max_model_len <= context:
            raise ValueError(f"max_model_len={max_model_len} must be in 1..{context} (max_position_embeddings)")
        tokenizer = Tokenizer(model_dir)
        eos = _eos_token_ids(Path(model_dir), config, tokenizer)
        logger.info("loaded %s: %.1f MB of weights as %s", model_dir, weight_bytes / 2**20, caps.precision)
        return cls(model, tokenizer, caps, torch_device, max_model_len or context, eos)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the completion; the last chunk carries finish_reason. Stopping iteration aborts it."""
        prompt_ids = self._prompt_ids(request)
        params = request.sampling
        _check_sampling(params)
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} (the prompt and at "
                "least one generated token must fit)"
            )
        max_len = self.max_model_len
        if params.max_tokens is not None:
            if len(prompt_ids) + params.max_tokens > self.max_model_len:
                raise InvalidRequestError(
                    f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                    f"length {self.max_model_len}"
                )
            max_len = len(prompt_ids) + params.max_tokens
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerationChunk | BaseException] = asyncio.Queue()
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(
            request_id=request.request_id,
            prompt_ids=prompt_ids,
            params=params,
            max_len=max_len,
            stop_token_ids=self._eos_token_ids | frozenset(params.stop_token_ids),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop),
            generator=torch.Generator().manual_seed(seed),
            emit=_emitter(loop, queue),
        )
        self._scheduler.add_request(seq)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if not finished:
                self._scheduler.abort_request(seq)

    def load(self) -> EngineLoad:
        return self._scheduler.load()

    async def close(self) -> None:
        """Stop the step loop; streams still running end with EngineClosedError."""
        await asyncio.to_thread(self._scheduler.close)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if (request.messages is None) == (request.prompt is None):
            raise InvalidRequestError("exactly one of messages and prompt must be given")
        if request.messages is not None:
            if not request.messages:
                raise InvalidRequestError("messages is empty")
            for i, m in enumerate(request.messages):
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise InvalidRequestError(f"messages[{i}] needs string 'role' and 'content'")
            return self.tokenizer.encode_chat(request.messages)
        if not request.prompt:
            raise InvalidRequestError("prompt is empty")
        return self.tokenizer.encode(request.prompt)


def _emitter(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue
) -> Callable[[GenerationChunk | BaseException], None]:
    def emit(item: GenerationChunk | BaseException) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is gone; its abort follows
            pass

    return emit


def _check_sampling(p: SamplingParams) -> None:
    if p.temperature < 0:
        raise InvalidRequestError(f"temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise InvalidRequestError(f"top_k must be >= 0, got {p.top_k}")
    if p.max_tokens is not None and p.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be >= 1, got {p.max_tokens}")


def _eos_token_ids(model_dir: Path, config: dict, tokenizer: Tokenizer) -> frozenset[int]:
    """eos ids from generation_config.json (int or list), else config.json, else the tokenizer."""
    eos = config.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    if eos is None:
        eos = tokenizer.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else eos or [])
