"""The simulated engine's tokenization, shared so that a gateway or a bench can compute the very
token ids (and `prefix_hash.chain` hashes) a simulated worker counts and caches.

A simulated worker has no tokenizer: its prompt is rendered as plain text, and each group of 4
UTF-8 bytes of that text is one token (about what English runs), its id the group read as a
little-endian unsigned integer, a partial last group padded with zero bytes.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

BYTES_PER_TOKEN = 4


def prompt_text(messages: Sequence[Mapping[str, Any]] | None, prompt: str | None) -> str:
    """The prompt as the simulated engine reads it: chat turns as `<|role|>content` lines, or the
    raw prompt (exactly one of the two is given)."""
    if messages is not None:
        return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
    if prompt is None:
        raise ValueError("a prompt needs messages or prompt text")
    return prompt


def sim_token_ids(text: str) -> list[int]:
    """The text's simulated token ids: each 4-byte group of its UTF-8 bytes, little-endian."""
    data = text.encode()
    data += bytes(-len(data) % BYTES_PER_TOKEN)
    ids = array("I")
    assert ids.itemsize == BYTES_PER_TOKEN, f"array 'I' holds {ids.itemsize} bytes here"
    ids.frombytes(data)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()
