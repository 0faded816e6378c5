"""Streaming detokenization of generated ids.

`IncrementalDetokenizer` turns generated ids into text pieces that are whole UTF-8 characters
(text ending in U+FFFD is held back until the next token completes it, with vLLM's
prefix/read offsets) and never contain a stop string (a possible partial stop string at the
end is held back until it is ruled out).
"""

from __future__ import annotations

from infermesh.text.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Per-sequence text stream: `add(token_id)` returns the newly safe text, possibly ""."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to text already in self.text
        self.read_offset = 0
        self.text = ""  # all decoded text so far
        self.emitted = 0  # chars of self.text handed out
        self.stopped = False  # a stop string was found; nothing more is emitted

    def add(self, token_id: int) -> str:
        assert not self.stopped, "add() after a stop string"
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT_CHAR):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of generation: text still held back for a partial stop string."""
        return "" if self.stopped else self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if self.stop:
            search_from = max(0, self.emitted - max(map(len, self.stop)) + 1)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                end = min(hits)
            elif not final:
                end -= self._partial_stop_len()
        piece = self.text[self.emitted : max(end, self.emitted)]
        self.emitted += len(piece)
        return piece

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of the text that is a prefix of a stop string (none is
        whole: _release found those)."""
        return max(partial_suffix(self.text, stop) for stop in self.stop)


def partial_suffix(text: str, whole: str) -> int:
    """Length of the longest suffix of `text` that is a prefix of `whole` (what may be `whole`,
    or its start cut off by the end of the text so far)."""
    for n in range(min(len(whole), len(text)), 0, -1):
        if text.endswith(whole[:n]):
            return n
    return 0
