"""A sequence's sampled tokens as the chunks' text and tool-call pieces, and the reason it ends.

Every engine feeds its tokens through one `CompletionDecoder`, so text, tool calls and finish
reasons come out the same whichever engine sampled them: the text before a turn's calls is text,
the calls are tool-call pieces (worker_svc.text.tool_parser), and a stop ends the turn as
``tool_calls`` once a call has started.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from infermesh.names import FinishReason
from infermesh.text.tokenizer import Tokenizer
from worker_svc.engine_api import Constraints, ToolCallDelta
from worker_svc.text.detokenizer import IncrementalDetokenizer
from worker_svc.text.tool_parser import ToolCallParser, ToolMarkers

# why the engine ends the sequence at this token: it is a stop token, or the last one the
# length limit allows
TokenEnd = Literal["stop_token", "length"]


@dataclass(frozen=True)
class DecodedToken:
    text: str
    tool_calls: list[ToolCallDelta] | None  # None: a token of the text before the calls
    finish: FinishReason | None


class CompletionDecoder:
    """One sequence's tokens in order: `add()` each one sampled."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: tuple[str, ...],
        constraints: Constraints,
        markers: ToolMarkers | None,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, stop)
        may_call = bool(constraints.tools) and constraints.tool_choice != "none"
        self._parser = (
            ToolCallParser(tokenizer, markers, frozenset(t.name for t in constraints.tools))
            if may_call and markers is not None
            else None
        )

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self._detokenizer.stopped

    def add(self, token: int, end: TokenEnd | None) -> DecodedToken:
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
        return DecodedToken(text, calls, finish)
