"""A sequence's sampled tokens as the chunks' text, reasoning and tool-call pieces, and the reason
it ends.

Every engine feeds its tokens through one `CompletionDecoder`, so text, reasoning, tool calls and
finish reasons come out the same whichever engine sampled them: a reasoning model's thinking is
reasoning text (worker_svc.decoding.reasoning_parser), the text before a turn's calls is text, the
calls are tool-call pieces (worker_svc.decoding.tool_parser), and a stop ends the turn as
``tool_calls`` once a call has started. The thinking comes first: the tool parser, and the
request's grammar, see only the tokens after it. A thinking budget is kept by `forced_token`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from infermesh.names import FinishReason
from infermesh.text.tokenizer import Tokenizer
from worker_svc.decoding.detokenizer import IncrementalDetokenizer
from worker_svc.decoding.reasoning_parser import Thinking
from worker_svc.decoding.tool_parser import ToolCallParser, ToolMarkers
from worker_svc.engine.api import Constraints, ToolCallDelta

# why the engine ends the sequence at this token: it is a stop token, or the last one the
# length limit allows
TokenEnd = Literal["stop_token", "length"]


@dataclass(frozen=True)
class DecodedToken:
    text: str
    tool_calls: list[ToolCallDelta] | None  # None: a token of the text before the calls
    finish: FinishReason | None
    reasoning_text: str = ""


class CompletionDecoder:
    """One sequence's tokens in order: `add()` each one sampled."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: tuple[str, ...],
        constraints: Constraints,
        markers: ToolMarkers | None,
        thinking: Thinking | None = None,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, stop)
        may_call = bool(constraints.tools) and constraints.tool_choice != "none"
        self._parser = (
            ToolCallParser(tokenizer, markers, frozenset(t.name for t in constraints.tools))
            if may_call and markers is not None
            else None
        )
        self._thinking = thinking
        self.reasoning_tokens = 0  # tokens sampled inside the thinking, the closing one included

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self._detokenizer.stopped

    @property
    def thinking(self) -> bool:
        """The output is still inside the thinking: no grammar applies yet."""
        return self._thinking is not None and self._thinking.parser.thinking

    def forced_token(self) -> int | None:
        """The token the engine must sample next: the closing tag's, once the thinking budget is
        spent (as vLLM's and SGLang's thinking budgets force it); else None."""
        t = self._thinking
        if t is None or t.budget is None or not t.parser.thinking:
            return None
        spent = self.reasoning_tokens - t.budget
        return t.end_token_ids[spent] if 0 <= spent < len(t.end_token_ids) else None

    def add(self, token: int, end: TokenEnd | None) -> DecodedToken:
        if self.thinking:
            return self._add_thinking(token, end)
        detok, parser = self._detokenizer, self._parser
        finish: FinishReason | None = None
        if end == "stop_token":
            finish = "tool_calls" if parser is not None and parser.calls else "stop"
        elif end == "length":
            finish = "length"
        calls = parser.add(token) if parser is not None else None
        if calls is not None:  # a token of the tool calls: no text
            assert parser is not None
            text = detok.flush()  # text held back for a possible stop string is text after all
            if finish == "length":
                calls += parser.finish()
        elif end == "stop_token":
            text = detok.flush()
        else:
            text = detok.add(token)
            if detok.stopped:
                finish = "stop"
            elif finish is not None:
                text += detok.flush()
        if self._thinking is not None:  # after the thinking: never what the closing tag held back
            text = self._thinking.parser.feed(detok.text, detok.emitted)[1]
        return DecodedToken(text, calls, finish)

    def _add_thinking(self, token: int, end: TokenEnd | None) -> DecodedToken:
        """A token of the thinking, or the one that closes it (its text past the tag is the
        answer's); stop strings apply to the thinking as to the answer."""
        assert self._thinking is not None
        detok, reasoning = self._detokenizer, self._thinking.parser
        self.reasoning_tokens += 1
        finish: FinishReason | None = None
        if end == "stop_token":
            finish = "stop"
        else:
            detok.add(token)
            if detok.stopped:
                finish = "stop"
            elif end == "length":
                finish = "length"
        if finish is not None:
            detok.flush()
        thought, text = reasoning.feed(detok.text, detok.emitted, final=finish is not None)
        if reasoning.thinking and self._thinking.end_token_ids == (token,):
            # a closing tag that decodes to no text (a special token)
            reasoning.close_at(len(detok.text))
            more_thought, text = reasoning.feed(detok.text, detok.emitted)
            thought += more_thought
        return DecodedToken(text, None, finish, reasoning_text=thought)
