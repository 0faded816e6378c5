"""The engine core: one thread that owns the scheduler and the model runner.

Each iteration is one scheduling step and one batched forward pass over every running sequence
(scheduler.py, model_runner.py), then sampling, detokenization and stop checks for the sequences
that got a token. It knows nothing of the request's wire form or of asyncio beyond each request's
thread-safe `emit`; the async front (engine.py's `Engine`) admits, checks and tokenizes requests
and hands them over as `RequestState`s. Request lifecycle: waiting -> running -> finished, or
aborted when the consumer goes away (its blocks are freed at the next step).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import llguidance
import torch

from infermesh.text.tokenizer import Tokenizer
from worker_svc.decoding.completion_decoder import CompletionDecoder, TokenEnd
from worker_svc.decoding.grammar import apply_masks
from worker_svc.engine.api import (
    EngineClosedError,
    EngineLoad,
    GenerationChunk,
    SamplingParams,
    TokenLogprob,
)
from worker_svc.engine.meters import DecodeRateMeter, PrefillSpeedMeter
from worker_svc.torch_engine.model_runner import ModelRunner
from worker_svc.torch_engine.sampling import sample_batch, token_logprobs
from worker_svc.torch_engine.scheduler import Scheduler, SchedulerOutput, SequenceState

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class RequestState:
    """The engine's side of one request: how it samples and stops, and where its chunks go."""

    seq: SequenceState
    request_id: str
    params: SamplingParams
    max_len: int  # prompt + completion limit
    stop_token_ids: frozenset[int]
    decoder: CompletionDecoder  # its tokens as text, tool calls and finish reason
    generator: torch.Generator
    # thread-safe: hands an item to the consumer
    emit: Callable[[GenerationChunk | BaseException], None]
    matcher: llguidance.LLMatcher | None = None  # the grammar its tokens must follow
    # puts the prompt's KV blocks a peer sent into the prefix cache, before the request joins
    adopt_peer_kv: Callable[[], None] | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.seq.token_ids[self.seq.num_prompt_tokens :]


class StepLoop:
    """The thread that owns the scheduler and the model runner: one forward pass per iteration.

    submit()/abort()/load()/close() are called from the event loop; everything else runs on the
    thread.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, tokenizer: Tokenizer):
        self._scheduler, self._runner, self._tokenizer = scheduler, runner, tokenizer
        self._lock = threading.Condition()
        self._incoming: list[RequestState] = []
        self._aborts: list[int] = []
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._closed = False
        self._requests: dict[int, RequestState] = {}  # seq_id -> its state, thread only
        self._load = EngineLoad(0, 0, 0.0)
        self._decode_rate = DecodeRateMeter()
        self._prefill_speed = PrefillSpeedMeter()
        self._thread = threading.Thread(target=self._run, name="worker-step-loop", daemon=True)
        self._thread.start()

    def submit(self, request: RequestState) -> None:
        """Hands a request over (the engine's RequestFront admitted it); it joins at the next
        step."""
        with self._lock:
            assert not self._closed, "submit after close: the engine's front refuses requests"
            self._incoming.append(request)
            self._lock.notify()

    def call(self, function: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Runs ``function`` on the thread between two steps (it may read and change the cache
        and its blocks); its result or exception in the future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                future.set_exception(EngineClosedError("engine closed"))
                return future
            self._calls.append((function, future))
            self._lock.notify()
        return future

    def abort(self, seq_id: int) -> None:
        """The consumer went away: the sequence is dropped, and its blocks freed, at the next
        step."""
        with self._lock:
            self._aborts.append(seq_id)
            self._lock.notify()

    def load(self) -> EngineLoad:
        with self._lock:
            return dataclasses.replace(
                self._load,
                waiting=self._load.waiting + len(self._incoming),
                tokens_per_second=self._decode_rate.rate(),
                prefill_tokens_per_second=self._prefill_speed.speed(),
            )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()

    # ------------------------------------------------------------------------------ the thread

    def _run(self) -> None:
        # what this thread's ops actually run on (the thread policy's count, or torch's default)
        logger.info("step loop computes on %d torch threads", torch.get_num_threads())
        while self._take_requests():
            output = self._scheduler.schedule()
            self._publish_load()  # before a chunk of this step reaches a consumer
            if output.scheduled:
                self._step(output)
                self._publish_load()
            else:
                self._idle()
            if (events := self._scheduler.blocks.events) is not None:
                events.flush()  # the step's cache events as one batch
        error = EngineClosedError("engine closed during generation")
        for seq_id in list(self._requests):
            self._end(seq_id, error)
        self._publish_load()

    def _take_requests(self) -> bool:
        """Hand new and aborted requests to the scheduler; False once the engine is closed."""
        with self._lock:
            incoming, aborts, calls = self._incoming, self._aborts, self._calls
            self._incoming, self._aborts, self._calls = [], [], []
            closed = self._closed
        for function, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function())
                except Exception as e:
                    future.set_exception(e)
        for request in incoming:
            self._requests[request.seq.seq_id] = request
            if request.adopt_peer_kv is not None:
                try:
                    request.adopt_peer_kv()
                except Exception:  # the prompt is computed instead
                    logger.exception("taking a peer's KV blocks for %s failed", request.request_id)
            self._scheduler.add_request(request.seq)
        for seq_id in aborts:
            if self._forget(seq_id) is not None:
                self._scheduler.abort_request(seq_id)
        return not closed

    def _idle(self) -> None:
        """Nothing to compute: sleep until a request arrives, or a held one may be admitted."""
        with self._lock:
            if not (self._incoming or self._aborts or self._calls or self._closed):
                self._lock.wait(self._scheduler.seconds_until_admission())

    def _publish_load(self) -> None:
        s = self._scheduler
        with self._lock:
            self._load = EngineLoad(len(s.running), len(s.waiting), 0.0, s.blocks.usage)

    def _step(self, output: SchedulerOutput) -> None:
        started = time.perf_counter()
        try:
            logits = self._runner.execute(output)
        except Exception as e:  # a model/runtime failure ends this step's requests, not the engine
            logger.exception("forward pass over %d sequences failed", len(output.scheduled))
            for s in output.scheduled:
                self._end(s.seq.seq_id, e)
            return
        requests = [self._requests[s.seq.seq_id] for s in output.scheduled if s.samples]
        self._scheduler.complete_step(output)
        # a reasoning model's grammar applies to its answer, after the thinking
        logits = apply_masks(logits, [None if r.decoder.thinking else r.matcher for r in requests])
        sampled = sample_batch(
            logits,
            [r.params for r in requests],
            [r.generator for r in requests],
            [r.output_ids if r.params.has_penalties else [] for r in requests],
        )
        # a spent thinking budget: the closing tag is the token sampled
        forced = [r.decoder.forced_token() for r in requests]
        tokens = [t if f is None else f for t, f in zip(sampled, forced, strict=True)]
        prompt_tokens = sum(s.num_tokens for s in output.scheduled if s.num_tokens > 1)
        with self._lock:  # the sampled tokens are on the host: the step's compute is done
            self._decode_rate.add(len(tokens))
            self._prefill_speed.add(prompt_tokens, time.perf_counter() - started)
        for request, token, row in zip(requests, tokens, logits, strict=True):
            try:
                self._append(request, token, row)
            except Exception as e:
                logger.exception("request %s failed", request.request_id)
                self._end(request.seq.seq_id, e)

    def _append(self, request: RequestState, token: int, logits: torch.Tensor) -> None:
        """Add a sampled token: stream its text, and end the sequence on a stop or at its length."""
        request.seq.token_ids.append(token)
        in_answer = not request.decoder.thinking
        if request.matcher is not None and in_answer and not request.matcher.consume_token(token):
            raise RuntimeError(
                f"token {token} broke the request's grammar: {request.matcher.get_error()}"
            )
        end: TokenEnd | None = None
        if token in request.stop_token_ids:
            end = "stop_token"
        elif len(request.seq.token_ids) >= request.max_len:
            end = "length"
        decoded = request.decoder.add(token, end)
        finish = decoded.finish
        logprobs = (
            self._logprobs(logits, token, request.params) if request.params.logprobs else None
        )
        seq = request.seq
        chunk = GenerationChunk(
            decoded.text,
            [token],
            finish,
            seq.num_prompt_tokens,
            len(seq.token_ids) - seq.num_prompt_tokens,
            seq.num_cached_prompt_tokens,
            logprobs,
            seq.queue_s,
            decoded.tool_calls or None,
            decoded.reasoning_text,
            request.decoder.reasoning_tokens,
        )
        if finish is not None:
            self._forget(seq.seq_id)
            self._scheduler.finish_request(seq)
            self._publish_load()  # a consumer holding its last chunk finds its slot free
        request.emit(chunk)

    def _logprobs(
        self, logits: torch.Tensor, token: int, params: SamplingParams
    ) -> list[TokenLogprob]:
        logprob, top = token_logprobs(logits, token, params.top_logprobs)
        decode = self._tokenizer.decode
        alternatives = tuple(TokenLogprob(decode([i]), lp) for i, lp in top)
        return [TokenLogprob(decode([token]), logprob, alternatives)]

    def _end(self, seq_id: int, error: BaseException) -> None:
        """A failed sequence leaves the batch now and frees its blocks; the error ends its
        stream."""
        request = self._forget(seq_id)
        if request is not None:
            self._scheduler.abort_request(seq_id)
            self._publish_load()
            request.emit(error)

    def _forget(self, seq_id: int) -> RequestState | None:
        return self._requests.pop(seq_id, None)


def emitter(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[GenerationChunk | BaseException]
) -> Callable[[GenerationChunk | BaseException], None]:
    def emit(item: GenerationChunk | BaseException) -> None:
        # RuntimeError: the consumer's event loop is gone; its abort follows
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(queue.put_nowait, item)

    return emit
