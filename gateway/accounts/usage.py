"""Token counts of one request: what the wire formats report and the rate limiter settles."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TokenUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0  # the reasoning tokens among them: billed as completion tokens
    cached_prompt_tokens: int = 0  # the prompt tokens found in the prefix cache
    reasoning_tokens: int = 0
