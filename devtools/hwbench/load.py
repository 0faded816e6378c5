"""Sending the study's requests: streamed chat completions pinned to one GPU kind, at most
``concurrency`` in flight, each timed to its first token and its end."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import openai

from gateway.api.wire import GPU_HEADER

_BYTES_PER_TOKEN = 4  # English words run ~4 bytes a token; the reported usage says how many it was
_WORD = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Sample:
    """One request's outcome."""

    gpu: str
    concurrency: int
    repeat: int  # -1: warm-up
    latency_s: float
    ttft_s: float | None  # None: no token came
    prompt_tokens: int
    output_tokens: int
    error: str  # "": it succeeded


@dataclass(frozen=True)
class Workload:
    model: str
    prompt_tokens: int
    max_tokens: int


def prompt(index: int, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens, different from the first word on for every index,
    so that no request reuses another's prefix cache."""
    rng = random.Random(index)
    words, size = [f"request {index}:"], 0
    while size < tokens * _BYTES_PER_TOKEN:
        word = "".join(rng.choice(_WORD) for _ in range(rng.randrange(2, 8)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


class LoadRunner:
    """Sends the requests of a study through one client; numbers its prompts across runs."""

    def __init__(
        self, client: openai.AsyncOpenAI, workload: Workload, on_done: Callable[[Sample], None]
    ) -> None:
        self._client = client
        self._workload = workload
        self._on_done = on_done
        self._next_prompt = 0

    async def run(
        self, gpu: str, concurrency: int, requests: int, repeat: int
    ) -> tuple[list[Sample], float]:
        """``requests`` requests with at most ``concurrency`` in flight: the samples and the
        wall time from the first sent to the last done."""
        first = self._next_prompt
        self._next_prompt += requests
        indices = iter(range(first, first + requests))
        samples: list[Sample] = []

        async def sender() -> None:
            for index in indices:
                sample = await self._one(gpu, concurrency, repeat, index)
                samples.append(sample)
                self._on_done(sample)

        started = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(min(concurrency, requests))))
        return samples, time.perf_counter() - started

    async def _one(self, gpu: str, concurrency: int, repeat: int, index: int) -> Sample:
        w = self._workload
        started = time.perf_counter()
        ttft, usage, error = None, None, ""
        try:
            stream = await self._client.chat.completions.create(
                model=w.model,
                max_tokens=w.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={GPU_HEADER: gpu},
                messages=[{"role": "user", "content": prompt(index, w.prompt_tokens)}],
            )
            async for chunk in stream:
                if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    ttft = time.perf_counter() - started
                if chunk.usage is not None:
                    usage = chunk.usage
        except openai.AuthenticationError:
            raise  # the key is wrong for every request: the study stops
        except openai.APIStatusError as e:
            error = f"{e.status_code}: {e.message}"
        except openai.APIError as e:
            error = f"{type(e).__name__}: {e}"
        return Sample(
            gpu,
            concurrency,
            repeat,
            time.perf_counter() - started,
            ttft,
            usage.prompt_tokens if usage else 0,
            usage.completion_tokens if usage else 0,
            error or ("" if usage else "the stream ended without usage"),
        )
