"""A request that does not fit its model's context: how a worker says so, and how a caller reads
the numbers back to answer in its own API's words.

The worker's words are Anthropic's, which clients act on (Claude Code lowers ``max_tokens`` to what
the second message leaves and retries; it compacts its history on the first); the gateway answers
OpenAI's clients in OpenAI's (``context_length_exceeded``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

_PROMPT = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")
_WITH_MAX_TOKENS = re.compile(
    r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)"
)


class ContextOverflow(NamedTuple):
    prompt_tokens: int
    max_tokens: int | None  # None: the prompt alone does not fit
    context_tokens: int  # the model's context: the prompt and the completion together

    def message(self) -> str:
        if self.max_tokens is None:
            # at least one generated token must fit after the prompt
            most = self.context_tokens - 1
            return f"prompt is too long: {self.prompt_tokens} tokens > {most} maximum"
        return (
            f"input length and `max_tokens` exceed context limit: {self.prompt_tokens} + "
            f"{self.max_tokens} > {self.context_tokens}, decrease input length or `max_tokens` "
            "and try again"
        )


def parse_overflow(details: str) -> ContextOverflow | None:
    """The overflow a worker's error message states, or None when it states none."""
    if match := _PROMPT.search(details):
        return ContextOverflow(int(match[1]), None, int(match[2]) + 1)
    if match := _WITH_MAX_TOKENS.search(details):
        return ContextOverflow(int(match[1]), int(match[2]), int(match[3]))
    return None
