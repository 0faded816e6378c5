"""The router's index of workers' cached blocks: batches, snapshots, drops, the bound per worker,
and the longest cached prefix per candidate (exact without holes, a held-then-missing boundary
with them)."""

from __future__ import annotations

import random

from infermesh.prefix_hash import chain
from router_svc.prefix_index import PrefixIndex

ALL = (1 << 64) - 1  # every slot a candidate


def prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16384) for _ in range(length)]


def cached(index: PrefixIndex, hashes: list[int], members: int = ALL, slots: int = 8) -> list[int]:
    blocks = index.cached_blocks(hashes, members, slots)
    return [0] * slots if blocks is None else blocks.tolist()


def test_the_longest_cached_prefix_of_each_worker_is_exact_without_holes():
    hashes = chain(prompt(16 * 100))
    index = PrefixIndex(max_blocks=1000, max_probes=10_000)
    depths = {0: 100, 1: 37, 2: 1, 3: 0, 5: 64}
    for slot, depth in depths.items():
        index.apply(slot, hashes[:depth], ())
    assert cached(index, hashes) == [100, 37, 1, 0, 0, 64, 0, 0]
    # only the candidates count; another prompt sharing nothing is cached nowhere
    assert cached(index, hashes, members=0b100010) == [0, 37, 0, 0, 0, 64, 0, 0]
    assert index.cached_blocks(chain(prompt(160, seed=1)), ALL, 8) is None
    assert index.cached_blocks([], ALL, 8) is None
    # every depth on every worker, against a scan block by block
    rng = random.Random(2)
    for _ in range(200):
        index = PrefixIndex(max_blocks=1000, max_probes=10_000)
        truth = [rng.randrange(101) for _ in range(8)]
        for slot, depth in enumerate(truth):
            index.apply(slot, hashes[:depth], ())
        assert cached(index, hashes) == truth


def test_out_of_probes_the_deepest_prefixes_are_exact_and_the_rest_counted_short():
    hashes = chain(prompt(16 * 4096))
    depths = [4096, 3000, 2500, 1200, 700, 64, 3, 1]
    exact = PrefixIndex(max_blocks=10_000, max_probes=10_000, resolution=4096)
    for slot, depth in enumerate(depths):
        exact.apply(slot, hashes[:depth], ())
    assert cached(exact, hashes) == depths
    budget = PrefixIndex(max_blocks=10_000, max_probes=16)
    for slot, depth in enumerate(depths):
        budget.apply(slot, hashes[:depth], ())
    found = cached(budget, hashes)
    assert found[0] == 4096  # the deepest first, exactly
    assert all(1 <= f <= d for f, d in zip(found, depths, strict=True)), found
    assert found != depths  # 16 probes cannot tell eight depths of 4,096 blocks apart


def test_past_the_deepest_prefix_depths_are_found_to_a_64th_of_the_prompt():
    hashes = chain(prompt(16 * 6400))  # 100k tokens: ranges of 100 blocks are not split
    depths = [6400, 5001, 3333, 3290, 120, 0, 0, 7]
    index = PrefixIndex(max_blocks=10_000, max_probes=10_000)
    for slot, depth in enumerate(depths):
        index.apply(slot, hashes[:depth], ())
    found = cached(index, hashes)
    assert found[0] == 6400
    assert all(d - 100 < f <= d for f, d in zip(found, depths, strict=True)), found
    assert found[2] >= found[3]  # a worker holding more never counts less
    assert found != depths  # the others were not resolved to the block
    index = PrefixIndex(max_blocks=10_000, max_probes=10_000)
    for slot, depth in enumerate(depths[1:]):  # the deepest now 5,001: exact
        index.apply(slot, hashes[:depth], ())
    assert cached(index, hashes)[0] == 5001


def test_a_hole_ends_the_prefix_at_a_held_block_followed_by_a_missing_one():
    hashes = chain(prompt(16 * 64))
    index = PrefixIndex(max_blocks=1000)
    index.apply(0, hashes, ())
    index.apply(0, (), [hashes[40]])  # a middle block evicted, the later ones kept
    (depth, *_) = cached(index, hashes)
    # the bisection probes 32 (held), 48 (held), 56, 60, 62, 63 (held): it passes over the hole
    # and predicts all 64; the worker recomputes block 40 when it serves the prompt
    assert depth == 64
    index.apply(0, (), [hashes[10]])
    (depth, *_) = cached(index, hashes)
    # whatever it answers is a boundary: block depth - 1 held, block depth not (or the end)
    assert depth >= 10
    assert depth == 64 or hashes[depth] in (hashes[10], hashes[40])


def test_batches_in_order_cleared_first_then_removed_then_stored():
    hashes = chain(prompt(16 * 10))
    index = PrefixIndex(max_blocks=1000)
    index.apply(3, hashes[:6], ())
    index.apply(3, hashes[6:8], hashes[4:6])
    assert index.blocks(3) == 6
    assert cached(index, hashes)[3] == 4
    index.apply(3, hashes[4:6], hashes[4:6])  # evicted and stored again in one batch: held
    assert cached(index, hashes)[3] == 8
    index.apply(3, hashes[:2], (), cleared=True)
    assert (index.blocks(3), cached(index, hashes)[3], len(index)) == (2, 2, 2)
    index.apply(3, (), [hashes[9]])  # removing a block never stored changes nothing
    assert index.blocks(3) == 2


def test_a_snapshot_replaces_a_worker_and_a_drop_forgets_it_only():
    hashes = chain(prompt(16 * 20))
    index = PrefixIndex(max_blocks=1000)
    index.apply(1, hashes[:20], ())
    index.apply(2, hashes[:5], ())
    index.replace(1, hashes[:3])
    assert cached(index, hashes)[1:3] == [3, 5]
    assert len(index) == 5  # blocks shared by both are kept once
    index.drop(2)
    assert cached(index, hashes)[1:3] == [3, 0]
    assert (index.blocks(2), len(index), index.slots()) == (0, 3, [1])
    index.drop(1)
    assert len(index) == 0 and index.cached_blocks(hashes, ALL, 8) is None


def test_a_worker_past_its_bound_forgets_its_oldest_blocks_first():
    hashes = chain(prompt(16 * 30))
    index = PrefixIndex(max_blocks=10)
    index.apply(0, hashes[:8], ())
    index.apply(0, hashes[8:12], ())
    # blocks 0 and 1 went first: a prompt's first blocks are its oldest, so what the bound
    # forgets reads as not cached (never as more cached than it is)
    assert (index.blocks(0), cached(index, hashes)[0]) == (10, 0)
    assert cached(index, hashes[2:])[0] == 10
    index.apply(0, hashes[2:4], ())  # stored again: the newest
    index.apply(0, hashes[12:14], ())
    assert cached(index, hashes[2:4])[0] == 2
    assert index.cached_blocks(hashes[4:], ALL, 8) is None  # 4 and 5 were the oldest then


def test_slots_past_a_byte_boundary_and_many_holders():
    hashes = chain(prompt(16 * 50))
    index = PrefixIndex(max_blocks=100, max_probes=10_000)
    for slot in range(1000):
        index.apply(slot, hashes[: slot % 50], ())
    blocks = index.cached_blocks(hashes, (1 << 1000) - 1, 1003)
    assert blocks is not None
    assert blocks.tolist() == [slot % 50 for slot in range(1000)] + [0, 0, 0]
    for slot in range(1000):
        index.drop(slot)
    assert len(index) == 0
