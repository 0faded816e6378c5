"""DeepSeek's tool-call output, parsed token by token into OpenAI-shaped call pieces.

A turn's calls come after the model's text as ``<｜tool▁calls▁begin｜>``, the calls, then
``<｜tool▁calls▁end｜>``, each call in its family's syntax (infermesh.text.chat_templates):

- ``v3``: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```
  <｜tool▁call▁end｜>``
- ``v31``: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``

The markers are single special tokens, so the parser switches state on token ids and decodes only
the text between them; argument text streams as it is decoded, holding back only what may be the
closing fence. A call is announced (id and name) only once its name is complete and names a
declared tool: a name cut short by the length limit, or one the request did not declare, is never
emitted, nor are its arguments.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from infermesh.text.chat_templates import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    ToolFormat,
)
from infermesh.text.tokenizer import Tokenizer
from worker_svc.decoding.detokenizer import IncrementalDetokenizer, partial_suffix
from worker_svc.engine.api import ToolCallDelta

_ARGS_OPEN, _ARGS_CLOSE = "```json\n", "\n```"


@dataclass(frozen=True)
class ToolMarkers:
    """The ids of the tool-call marker tokens in a checkpoint's vocabulary, and the call syntax
    its chat template speaks."""

    calls_begin: int
    calls_end: int
    call_begin: int
    call_end: int
    sep: int
    format: ToolFormat

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ToolMarkers | None:
        """The markers, or None when the vocabulary lacks one or the template writes no call in
        DeepSeek's syntaxes (the model cannot call tools)."""
        vocab = tokenizer.hf.get_vocab()
        ids = [vocab.get(t) for t in (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)]
        tool_format = tokenizer.tool_format
        if tool_format is None or any(i is None for i in ids):
            return None
        calls_begin, calls_end, call_begin, call_end, sep = (int(i or 0) for i in ids)
        return cls(calls_begin, calls_end, call_begin, call_end, sep, tool_format)


class ToolCallParser:
    """One sequence's output: `add(token)` returns None for a token of the text before the calls,
    else the call pieces it completes (possibly none). `names`: the declared tools."""

    def __init__(self, tokenizer: Tokenizer, markers: ToolMarkers, names: frozenset[str]):
        self._tokenizer, self._markers, self._names = tokenizer, markers, names
        self._state = "text"  # text -> between -> [header ->] name -> args -> between ... -> done
        self._piece = IncrementalDetokenizer(tokenizer)
        self._buffer = ""  # the current name's or arguments' text so far
        self._sent = 0  # characters of the current arguments handed out
        self._skipping = False  # the current call names no declared tool: none of it is emitted
        self.calls = 0  # calls announced

    def add(self, token: int) -> list[ToolCallDelta] | None:
        m = self._markers
        if self._state == "text":
            if token != m.calls_begin:
                return None
            self._state = "between"
            return []
        if token == m.call_begin:
            deltas = self._close()
            self._enter("header" if m.format == "v3" else "name")
            return deltas
        if token == m.sep:
            if self._state == "header":  # v3: the call's type is over, its name follows
                self._enter("name")
            elif self._state == "name" and m.format == "v31":  # v31: the name is over
                name = self._buffer + self._piece.flush()
                self._enter("args")
                return self._named(name, rest="")
            return []
        if token in (m.call_end, m.calls_end):
            deltas = self._close()
            self._state = "done" if token == m.calls_end else "between"
            return deltas
        if self._state not in ("name", "args"):
            return []  # the call's type ("function") or separators between calls
        self._buffer += self._piece.add(token)
        if self._state == "args":
            return self._arguments(final=False)
        if m.format == "v3" and "\n" in self._buffer:  # v3: the name ends with its line
            name, rest = self._buffer.split("\n", 1)
            return self._named(name, rest)
        return []

    def finish(self) -> list[ToolCallDelta]:
        """At the end of generation (a length limit mid-call): the current call's arguments so
        far; a call whose name was still being written is dropped."""
        if self._state != "args":
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

    def _named(self, name: str, rest: str) -> list[ToolCallDelta]:
        """The name is complete: the call starts (when it names a declared tool), its arguments
        follow."""
        name = name.strip()
        self._state, self._buffer, self._sent = "args", rest, 0
        self._skipping = name not in self._names
        if self._skipping:
            return []
        self.calls += 1
        start = ToolCallDelta(self.calls - 1, f"call_{secrets.token_hex(12)}", name)
        return [start, *self._arguments(final=False)]

    def _arguments(self, final: bool) -> list[ToolCallDelta]:
        if self._skipping:
            return []
        body = self._buffer
        if self._markers.format == "v3":
            if body.startswith(_ARGS_OPEN):
                body = body[len(_ARGS_OPEN) :]
            elif _ARGS_OPEN.startswith(body) and not final:
                return []  # the opening fence may still come
            held_back = partial_suffix(body, _ARGS_CLOSE)  # may be the closing fence
            body = body.removesuffix(_ARGS_CLOSE) if final else body[: len(body) - held_back]
        piece = body[self._sent :]
        self._sent += len(piece)
        return [ToolCallDelta(self.calls - 1, arguments=piece)] if piece else []

    def _close(self) -> list[ToolCallDelta]:
        """The current call ends: its last argument text. A call whose name never ended (no
        arguments followed) is not a call."""
        deltas = self._arguments(final=True) if self._state == "args" else []
        self._state = "between"
        return deltas
