"""Cache blocks: allocation, release, prefix caching by block hash, eviction, and the cache's
size."""

from __future__ import annotations

import torch

from infermesh.prefix_hash import chain
from worker_svc.config import MIN_CPU_CACHE_BYTES, CacheSection
from worker_svc.engine.cache_events import CacheEvents
from worker_svc.model.model import ModelArgs
from worker_svc.torch_engine.kv_cache import (
    BlockManager,
    BlockTable,
    bytes_per_token,
    cache_budget_bytes,
    page_digest,
    unabsorbed_bytes_per_token,
)


def _computed(manager: BlockManager, tokens: list[int]) -> BlockTable:
    """A table holding `tokens`, all computed (as after their prefill)."""
    table = BlockTable()
    manager.match_prefix(table, tokens)
    assert manager.allocate(table, len(tokens))
    manager.cache_full_blocks(table, tokens, len(tokens))
    return table


def test_allocate_and_free_return_usage_to_zero():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = BlockTable(), BlockTable()
    assert manager.allocate(a, 9) and len(a.blocks) == 3
    assert manager.allocate(a, 12) and len(a.blocks) == 3  # still fits
    assert manager.allocate(b, 20) and len(b.blocks) == 5
    assert manager.usage == 1.0 and set(a.blocks).isdisjoint(b.blocks)
    assert not manager.allocate(a, 13) and len(a.blocks) == 3  # nothing taken when it does not fit
    manager.free(a)
    manager.free(b)
    assert manager.usage == 0.0 and manager.num_free_blocks == 8 and a.blocks == []


def test_prefix_match_reuses_full_blocks_but_never_the_last_tokens_block():
    manager = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks
    first = _computed(manager, prompt)
    second = BlockTable()
    assert manager.match_prefix(second, [*prompt, 7, 8]) == 8
    assert second.blocks == first.blocks[:2]
    exact = BlockTable()
    # the block holding token 8 must be computed
    assert manager.match_prefix(exact, prompt[:8]) == 4
    other = BlockTable()
    # a different first token changes every hash
    assert manager.match_prefix(other, [1, *prompt[1:]]) == 0


def test_freed_blocks_stay_cached_until_needed():
    manager = BlockManager(num_blocks=4, block_size=4)
    prompt = list(range(9))
    manager.free(_computed(manager, prompt))
    assert manager.usage == 0.0
    again = BlockTable()
    assert manager.match_prefix(again, prompt) == 8
    manager.free(again)
    hog = BlockTable()
    assert manager.allocate(hog, 16)  # takes the free block, then evicts the cached ones
    manager.free(hog)
    assert manager.match_prefix(BlockTable(), prompt) == 0


def test_a_held_cached_block_is_not_evicted():
    manager = BlockManager(num_blocks=3, block_size=4)
    prompt = list(range(9))
    holder = _computed(manager, prompt)
    assert not manager.allocate(BlockTable(), 4)
    manager.free(holder)
    reader = BlockTable()
    assert manager.match_prefix(reader, prompt) == 8
    assert manager.allocate(BlockTable(), 4) and not manager.allocate(BlockTable(), 4)


def test_blocks_named_for_peers_are_found_until_evicted_and_adopted_ones_match():
    manager = BlockManager(num_blocks=4, block_size=32, events=CacheEvents())
    tokens = list(range(100))  # three whole blocks of 32: six names of 16 tokens
    names = chain(tokens)
    manager.free(_computed(manager, tokens))
    assert manager.slots_of(names) == [b * 32 + i * 16 for b in (0, 1, 2) for i in (0, 1)]
    assert manager.slots_of([names[0], 7, names[1]]) == [0]  # up to the first not held
    manager.free(_computed(manager, [1000 + t for t in range(128)]))  # evicts the prompt's first
    assert manager.slots_of(names) == []
    # a peer's blocks join the cache: a prompt matching them finds them computed
    other = BlockManager(num_blocks=4, block_size=32, events=CacheEvents())
    assert other.adopt(tokens, 1, 3) == []  # block 0 is not cached: the prefix would break
    assert [number for number, _ in other.adopt(tokens, 0, 3)] == [0, 1, 2]
    assert other.events is not None and other.events.held_prefix(names) == 6
    assert other.usage == 0.0  # cached, held by nobody
    assert other.match_prefix(BlockTable(), tokens) == 96


def test_block_hash_chains_through_the_parent():
    assert page_digest(b"", [1, 2]) != page_digest(page_digest(b"", [0]), [1, 2])
    assert page_digest(b"", [1, 2]) == page_digest(b"", [1, 2]) != page_digest(b"", [2, 1])


def test_latent_cache_bytes_per_token_against_a_per_head_cache():
    args = ModelArgs(
        n_layers=6,
        n_heads=8,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
    )
    assert bytes_per_token(args, torch.float32) == 6 * (128 + 32) * 4
    assert unabsorbed_bytes_per_token(args, torch.float32) == 6 * 8 * (64 + 32 + 64) * 4


def test_cpu_budget_is_the_configured_bytes():
    cache = CacheSection(cpu_cache_bytes=12345)
    assert cache_budget_bytes(torch.device("cpu"), cache, 10**9) == 12345


def test_unset_cpu_budget_holds_one_whole_context():
    """The default admits the checkpoint's whole context however long, and keeps a floor for short
    ones."""
    cache = CacheSection()
    assert cache_budget_bytes(torch.device("cpu"), cache, 10**9) == 10**9
    assert cache_budget_bytes(torch.device("cpu"), cache, 1000) == MIN_CPU_CACHE_BYTES
