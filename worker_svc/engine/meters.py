"""The engines' meters of their own speed, reported in EngineLoad: tokens decoded a second, and
prompt tokens prefilled a second."""

from __future__ import annotations

import time
from collections import deque


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
