"""Which fixed-size blocks of the latent cache each sequence holds, and prefix caching.

The cache itself (`paged_batch.KVCache`) is one tensor of token slots; this module hands out its
blocks. A full block is keyed by a hash of its tokens and of every token before it (a chain
through the parent block's hash), so a later prompt starting with the same tokens (a repeated
system prompt) reuses the computed latents. Blocks nobody holds keep their contents and hash
until they are needed again: free blocks are taken first, then the least recently freed cached
ones. SHA-256 keeps a crafted prompt from colliding with another tenant's prefix.

What the prefix cache holds is published (`CacheEvents`) in the mesh's names: each registered
block as the `prefix_hash` hashes of its block_size / BLOCK_TOKENS sub-blocks, each evicted one
as the same hashes removed. By those names a peer worker asks for cached blocks' contents
(`slots_of`), and blocks a peer sent join the prefix cache as computed ones would (`adopt`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from infermesh import prefix_hash
from worker_svc.config import CacheSection
from worker_svc.engine.cache_events import CacheEvents
from worker_svc.model.model import ModelArgs


@dataclass
class BlockTable:
    """The blocks one sequence holds, in position order, and the chain hash of its leading full
    blocks."""

    blocks: list[int] = field(default_factory=list)
    num_hashed: int = 0  # leading blocks whose hash is known (registered or found in the cache)
    last_digest: bytes = b""  # page_digest of block num_hashed - 1; b"" before the first block
    last_name: int = prefix_hash.ROOT  # the same prefix's prefix_hash name


def page_digest(parent: bytes, tokens: list[int]) -> bytes:
    """The engine's own key of a full block (SHA-256, not the mesh's `prefix_hash` names): its
    tokens and, through `parent`, all tokens before it."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    """Allocates cache blocks to sequences; used by the scheduler's thread only.

    `usage` counts blocks held by some sequence: cached blocks nobody holds are reclaimable, so
    a finished or cancelled request brings it back to 0.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        events: CacheEvents | None = None,
    ):
        assert num_blocks > 0 and block_size > 0, (
            f"num_blocks={num_blocks}, block_size={block_size}"
        )
        # published names cover whole sub-blocks of BLOCK_TOKENS (config.CacheSection checks it)
        assert events is None or block_size % prefix_hash.BLOCK_TOKENS == 0, (
            f"block_size={block_size}: not a multiple of {prefix_hash.BLOCK_TOKENS}"
        )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        # never hashed (or evicted); pop() from the end
        self._free = list(range(num_blocks - 1, -1, -1))
        # hashed, held by nobody; oldest first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._by_digest: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self.events = events  # None: publishes nothing
        # a registered block's prefix_hash names (the last one names its whole prefix), when
        # publishing
        self._names_of: dict[int, list[int]] = {}
        # each published name's first token slot, for the peers that ask for its contents
        self._slot_of_name: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.blocks_in_use / self.num_blocks

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """Blocks to add so `table` covers `num_tokens` token slots."""
        return max(0, -(-num_tokens // self.block_size) - len(table.blocks))

    def match_prefix(self, table: BlockTable, token_ids: list[int]) -> int:
        """Take the cached blocks that start `token_ids` into an empty table; returns the tokens
        they cover.

        The block holding the last token is never matched: its logits are needed, so it is computed.
        """
        assert not table.blocks, f"match_prefix on a table holding {len(table.blocks)} blocks"
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            h = page_digest(table.last_digest, token_ids[i * bs : (i + 1) * bs])
            block = self._by_digest.get(h)
            if block is None:
                break
            self._hold(block)
            table.blocks.append(block)
            table.num_hashed, table.last_digest = i + 1, h
            if self.events is not None:
                table.last_name = self._names_of[block][-1]
        return len(table.blocks) * bs

    def allocate(self, table: BlockTable, num_tokens: int) -> bool:
        """Grow `table` to cover `num_tokens` slots; False (and nothing taken) when too few blocks
        are free."""
        needed = self.blocks_needed(table, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            table.blocks.append(self._take())
        return True

    def cache_full_blocks(self, table: BlockTable, token_ids: list[int], num_computed: int) -> None:
        """Register the blocks whose `block_size` tokens are all computed, so later prompts can
        match them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(table.num_hashed, num_computed // bs):
            tokens = token_ids[i * bs : (i + 1) * bs]
            h = page_digest(table.last_digest, tokens)
            block = table.blocks[i]
            # a duplicate of a cached block stays private and is freed plainly
            cached = self._by_digest.get(h)
            if cached is None:
                self._by_digest[h], self._digest_of[block] = block, h
            if self.events is not None:
                if cached is None:
                    self._publish(block, prefix_hash.chain(tokens, table.last_name))
                table.last_name = self._names_of[block if cached is None else cached][-1]
            table.num_hashed, table.last_digest = i + 1, h

    def slots_of(self, names: list[int]) -> list[int]:
        """The first token slot of each of the BLOCK_TOKENS-token blocks ``names`` names, up to
        the first one not held."""
        slots = []
        for name in names:
            slot = self._slot_of_name.get(name)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def adopt(self, token_ids: list[int], start: int, stop: int) -> list[tuple[int, int]]:
        """Blocks ``start``..``stop - 1`` of ``token_ids``' whole blocks (a peer computed them)
        join the prefix cache, as (block number, cache block) for each one not cached already;
        the caller writes their contents before the next forward pass. Nothing when a block
        before ``start`` is not cached (the prefix would break) or prefix caching is off; no
        further than the free and reclaimable blocks reach (the prompt's own are held meanwhile,
        so that none of them is reclaimed for the next)."""
        if not self.enable_prefix_caching or self.events is None:
            return []
        bs = self.block_size
        chain = BlockTable()
        adopted: list[tuple[int, int]] = []
        for i in range(stop):
            tokens = token_ids[i * bs : (i + 1) * bs]
            h = page_digest(chain.last_digest, tokens)
            block = self._by_digest.get(h)
            if block is not None:
                self._hold(block)
            elif i < start or not self.num_free_blocks:
                break
            else:
                block = self._take()
                self._by_digest[h], self._digest_of[block] = block, h
                self._publish(block, prefix_hash.chain(tokens, chain.last_name))
                adopted.append((i, block))
            chain.blocks.append(block)
            chain.last_digest, chain.last_name = h, self._names_of[block][-1]
        self.free(chain)
        return adopted

    def _publish(self, block: int, names: list[int]) -> None:
        assert self.events is not None, "publishing without events"
        self._names_of[block] = names
        for i, name in enumerate(names):
            self._slot_of_name[name] = block * self.block_size + i * prefix_hash.BLOCK_TOKENS
        self.events.stored(names)

    def free(self, table: BlockTable) -> None:
        """Release every block of `table`; its tail blocks are the first to be reused."""
        for block in reversed(table.blocks):
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"block {block} freed twice"
            if self._refs[block] == 0:
                if block in self._digest_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        table.blocks.clear()
        table.num_hashed, table.last_digest, table.last_name = 0, b"", prefix_hash.ROOT

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._by_digest[self._digest_of.pop(block)]
            if self.events is not None:
                names = self._names_of.pop(block)
                for name in names:
                    del self._slot_of_name[name]
                self.events.removed(names)
        self._refs[block] = 1
        return block


def bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
    """Cache bytes per token: the latent and the rope'd key, and (V3.2) the indexer's key, per
    layer."""
    return latent_bytes_per_token(args, dtype) + index_bytes_per_token(args, dtype)


def latent_bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
    """The MLA part of a token's cache: the latent and the rope'd key of every layer."""
    return args.n_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * dtype.itemsize


def index_bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
    """The sparse-attention part of a token's cache: the indexer's key of every layer (0 for V3)."""
    return args.n_layers * args.index_head_dim * dtype.itemsize if args.sparse else 0


def unabsorbed_bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
    """What a per-head K/V cache (kv_b_proj not absorbed) would need per token, for comparison."""
    per_layer = args.n_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim)
    return args.n_layers * per_layer * dtype.itemsize


def cache_budget_bytes(device: torch.device, cache: CacheSection, context_bytes: int) -> int:
    """On a GPU: the share `gpu_memory_utilization` of device memory minus what is used already (the
    weights); the rest is left to activations. On a CPU: the configured byte budget, or unset, room
    for one whole context (`context_bytes`)."""
    if device.type != "cuda":
        return cache.cpu_budget_bytes(context_bytes)
    free, total = torch.cuda.mem_get_info(device)
    return int(total * cache.gpu_memory_utilization) - (total - free)
