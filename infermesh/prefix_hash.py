"""The mesh's names for cached prompt prefixes: chained hashes of fixed blocks of token ids.

Every engine's prefix cache keys its blocks its own way (the torch engine by SHA-256 over its
block size, vLLM by its own hash over 16 tokens); the workers translate what they store and evict
into these hashes (Worker.CacheEvents), and whoever tokenizes a request computes the same for its
prompt (GenerateRequest.prefix_hashes), so that the router compares like with like. A block's
hash covers its tokens and its parent's hash: one hash names a whole prefix.

64-bit BLAKE2b: the router's index is a routing hint, so a crafted collision can only misplace a
request (the engines' own caches compare their own, cryptographic, keys).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BLOCK_TOKENS = 16  # vLLM's default block size; the torch engine's is a multiple of it

ROOT = 0  # the parent of a prompt's first block


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The name of a whole block of BLOCK_TOKENS token ids following the prefix `parent` names."""
    data = parent.to_bytes(8, "little") + array("I", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def chain(token_ids: Sequence[int], parent: int = ROOT, start: int = 0) -> list[int]:
    """The hashes of the whole blocks of `token_ids[start:]`, each chained to the one before
    (the first to `parent`); a partial last block has none."""
    data = array("I", token_ids[start:]).tobytes()  # once: slicing bytes is cheaper than lists
    step = 4 * BLOCK_TOKENS
    hashes = []
    for begin in range(0, len(data) - step + 1, step):
        digest = hashlib.blake2b(
            parent.to_bytes(8, "little") + data[begin : begin + step], digest_size=8
        )
        parent = int.from_bytes(digest.digest(), "little")
        hashes.append(parent)
    return hashes
