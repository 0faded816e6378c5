"""A reasoning model's output, split while it streams into its thinking and its answer.

DeepSeek's reasoning models think between ``<think>`` and ``</think>`` before they answer
(infermesh.text.chat_templates' reasoning formats). Their chat templates open the thinking in
the generation prompt, so the output starts inside it; the parser hands out the text before the
closing tag as reasoning, the text after it as the answer, and neither tag. One parser per format:

- ``deepseek_r1``: R1 always thinks (a leading ``<think>`` the model writes itself is dropped,
  as R1 did before its template opened the thinking);
- ``deepseek_v3``: V3.1 and V3.2 think when the request's thinking flag is set; else the template
  closed the thinking already and the output is all answer.

The parser reads the whole decoded text so far, so a tag cut across tokens (a detokenizer that
writes ``</thi`` then ``nk>``) still parses: a suffix that may begin the closing tag is held back
until the next text rules it in or out. A tokenizer whose tags are special tokens decodes them to
nothing: the decoder then closes the thinking on the tag's token id (`close_at`).
"""

from __future__ import annotations

from dataclasses import dataclass

from infermesh.text.chat_templates import THINK, THINK_END, ReasoningFormat
from infermesh.text.tokenizer import Tokenizer
from worker_svc.decoding.detokenizer import partial_suffix
from worker_svc.engine.api import GenerationRequest


class ReasoningParser:
    """One sequence's text: `feed()` the text decoded so far after each token."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking  # the output is still inside the thinking
        self._reasoning_from = 0  # where the reasoning starts (past an opening tag)
        self._answer_from = 0  # where the answer starts (past the closing tag)
        self._close_at: int | None = None if thinking else 0  # where the closing tag starts
        self._sent = 0  # characters of the text handed out (or skipped as tags)

    def close_at(self, offset: int) -> None:
        """The thinking closed at `offset` of the text by a tag that decodes to no text."""
        if self.thinking:
            self.thinking = False
            self._close_at = self._answer_from = offset

    def feed(self, text: str, released: int, final: bool = False) -> tuple[str, str]:
        """The new (reasoning, answer) text. `text`: all the output decoded so far; `released`:
        how much of it may be handed out (the rest is held back, e.g. for a stop string);
        `final`: the output ends here, a partial tag is text after all."""
        if self.thinking:
            self._find_tags(text)
        if self._close_at is None:  # thinking: all but what may still become a tag
            if final:
                safe = len(text)
            elif self._may_open(text):
                safe = 0
            else:
                safe = len(text) - partial_suffix(text, THINK_END)
            end = max(min(released, safe), self._sent)
            reasoning = text[max(self._sent, self._reasoning_from) : end]
            self._sent = end
            return reasoning, ""
        end = max(min(self._close_at, released), self._sent)
        reasoning = text[max(self._sent, self._reasoning_from) : end]
        self._sent = end
        if released <= self._close_at:
            return reasoning, ""
        start = max(self._sent, self._answer_from)
        answer = text[start:released] if released > start else ""
        self._sent = max(start, released)
        return reasoning, answer

    def _may_open(self, text: str) -> bool:
        """Nothing handed out yet, and the text may still become an opening tag."""
        return self._sent == 0 and self._reasoning_from == 0 and THINK.startswith(text.lstrip())

    def _find_tags(self, text: str) -> None:
        if self._sent == 0 and self._reasoning_from == 0:
            head = text.lstrip()
            if head.startswith(THINK):  # the model opened the thinking itself
                self._reasoning_from = len(text) - len(head) + len(THINK)
        # what was handed out held no tag, nor the start of one: look only past it (each token
        # feeds the whole text; searching from its start again would be quadratic)
        close = text.find(THINK_END, max(self._reasoning_from, self._sent))
        if close >= 0:
            self.thinking = False
            self._close_at, self._answer_from = close, close + len(THINK_END)


@dataclass(frozen=True)
class Thinking:
    """A reasoning model's turn: how its thinking is parsed and bounded."""

    parser: ReasoningParser
    end_token_ids: tuple[int, ...]  # the closing tag's tokens, forced when the budget is spent
    budget: int | None = None  # reasoning tokens before the engine closes the thinking


def thinking_of(
    tokenizer: Tokenizer, reasoning_format: ReasoningFormat, request: GenerationRequest
) -> Thinking | None:
    """How `request`'s output thinks on a model of `reasoning_format`; None where it does not (a
    model that does not reason, or raw text, which no chat template opened a thinking for)."""
    if not reasoning_format or request.messages is None:
        return None
    if reasoning_format == "deepseek_r1":  # R1 always thinks
        parser = ReasoningParser(thinking=True)
    else:
        parser = ReasoningParser(thinking=bool(request.thinking))
    return Thinking(
        parser, tuple(tokenizer.encode_rendered(THINK_END)), request.thinking_budget_tokens
    )
