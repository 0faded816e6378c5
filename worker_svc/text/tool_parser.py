"""DeepSeek-V3's tool-call output, parsed token by token into OpenAI-shaped call pieces.

A turn's calls come after the model's text as
``<｜tool▁calls▁begin｜>`` then per call
``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n``` <｜tool▁call▁end｜>``, then
``<｜tool▁calls▁end｜>``. The markers are single special tokens, so the parser switches state on
token ids and decodes only the text between them; argument text streams as it is decoded, holding
back only what may be the closing fence.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from worker_svc.engine_api import ToolCallDelta
from worker_svc.text.tokenizer import IncrementalDetokenizer, Tokenizer

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_ARGS_OPEN, _ARGS_CLOSE = "```json\n", "\n```"


@dataclass(frozen=True)
class ToolMarkers:
    """The ids of the tool-call marker tokens in a checkpoint's vocabulary."""

    calls_begin: int
    calls_end: int
    call_begin: int
    call_end: int
    sep: int

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ToolMarkers | None:
        """The markers, or None when the vocabulary lacks one (the model cannot call tools)."""
        vocab = tokenizer.hf.get_vocab()
        ids = [vocab.get(t) for t in (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)]
        return None if None in ids else cls(*ids)  # type: ignore[arg-type]


class ToolCallParser:
    """One sequence's output: `add(token)` returns None for a token of the text before the calls,
    else the call pieces it completes (possibly none)."""

    def __init__(self, tokenizer: Tokenizer, markers: ToolMarkers):
        self._tokenizer, self._markers = tokenizer, markers
        self._state = "text"  # text -> between -> header -> name -> args -> between ... -> done
        self._piece = IncrementalDetokenizer(tokenizer)
        self._buffer = ""  # the current name's or arguments' text so far
        self._sent = 0  # characters of the current arguments handed out
        self.calls = 0  # calls started

    def add(self, token: int) -> list[ToolCallDelta] | None:
        m = self._markers
        if self._state == "text":
            if token != m.calls_begin:
                return None
            self._state = "between"
            return []
        if token == m.call_begin:
            deltas = self._close()
            self._enter("header")
            return deltas
        if token == m.sep and self._state == "header":
            self._enter("name")
            return []
        if token in (m.call_end, m.calls_end):
            deltas = self._close()
            self._state = "done" if token == m.calls_end else "between"
            return deltas
        if self._state not in ("name", "args"):
            return []  # the call's type ("function") or separators between calls
        self._buffer += self._piece.add(token)
        return self._name() if self._state == "name" else self._arguments(final=False)

    def finish(self) -> list[ToolCallDelta]:
        """At the end of generation (a length limit mid-call): what the current call still holds."""
        if self._state not in ("name", "args"):
            return []
        self._buffer += self._piece.flush()
        return self._close()

    def _enter(self, state: str) -> None:
        self._state, self._piece, self._buffer, self._sent = (
            state,
            IncrementalDetokenizer(self._tokenizer),
            "",
            0,
        )

    def _name(self) -> list[ToolCallDelta]:
        if "\n" not in self._buffer:
            return []
        name, rest = self._buffer.split("\n", 1)
        start = self._start(name)
        self._state, self._buffer = "args", rest
        return [start, *self._arguments(final=False)]

    def _start(self, name: str) -> ToolCallDelta:
        self.calls += 1
        return ToolCallDelta(self.calls - 1, f"call_{secrets.token_hex(12)}", name.strip())

    def _arguments(self, final: bool) -> list[ToolCallDelta]:
        body = self._buffer
        if body.startswith(_ARGS_OPEN):
            body = body[len(_ARGS_OPEN) :]
        elif _ARGS_OPEN.startswith(body) and not final:
            return []  # the opening fence may still come
        body = body.removesuffix(_ARGS_CLOSE) if final else body[: len(body) - _held_back(body)]
        piece = body[self._sent :]
        self._sent += len(piece)
        return [ToolCallDelta(self.calls - 1, arguments=piece)] if piece else []

    def _close(self) -> list[ToolCallDelta]:
        """The current call ends: a name still waiting for its newline starts it with empty
        arguments."""
        if self._state == "name":
            deltas = [self._start(self._buffer)]
        elif self._state == "args":
            deltas = self._arguments(final=True)
        else:
            return []
        self._state = "between"
        return deltas


def _held_back(body: str) -> int:
    """Length of the suffix of `body` that may be the start of the closing fence."""
    for n in range(min(len(_ARGS_CLOSE), len(body)), 0, -1):
        if body.endswith(_ARGS_CLOSE[:n]):
            return n
    return 0
