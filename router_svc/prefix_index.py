"""Which worker's prefix cache holds which blocks, as the workers' cache events say
(Worker.CacheEvents, infermesh/prefix_hash.py): what the route score reads to find, for each
candidate, the longest prefix of a request's ``prefix_hashes`` it has cached.

Representation: one dict from a block's hash to the set of fleet slots holding it as a bitmask
(a Python int, bit ``slot``), each distinct mask stored once (interned: a session's blocks all
share its worker's one-bit mask, a system prompt's blocks the mask of the workers holding it),
and per slot its hashes in the order stored, for dropping a worker, replacing its snapshot and
bounding it. Measured (bench/router_decision.py ``--index-memory``, tracemalloc): 125 bytes per
block held by one worker, 73 more for each further worker holding the same block (1,000 workers
x 3,000 blocks of their own: about 375 MB). ``max_blocks`` bounds a worker, a safeguard past the
worker's own evictions: past it its oldest stored blocks are forgotten first. A prompt's oldest
blocks are its first, so what the bound forgets reads as not cached, never as more cached than
it is.

The longest cached prefix: a worker holding block i almost always holds every block before it
(the hashes chain, and engines evict a prefix's later blocks first), so for each candidate the
answer is where its blocks stop, found by bisection over the request's hashes: all candidates
holding the first block start together, each probe of the middle of a range splits them into those
holding it and those not. A lookup costs about log2(blocks) probes per distinct answer, not per
worker or per block. The deepest prefix is found exactly, the others to 1/``resolution`` of the
prompt (64: a range that narrow is not split further, and its workers count its first block):
exact for prompts under 128 blocks, for an 80k-token prompt within 78 blocks (under 2 % of its
prefill), which halves the probes of each prefix past the deepest. At most ``max_probes`` in all
(32: the three or four deepest answers of an 80k-token prompt, which are those the route score can
prefer; the shallower ones are then counted short, never long). With a hole (a middle block
evicted, later ones kept) the bisection still ends on a block held followed by one not held, but
may pass over the hole: the prediction then counts blocks past it the engine cannot reuse. The
worker recomputes the hole when it serves the request and reports it stored again, which mends
the index.

The lookup is compiled (``compiled=True``, what the router runs: router_svc/_prefix_probe.c, built
by ``make native``), the same bisection probe for probe over the same dict; the pure-Python loop
below is its reference (tests/router_svc/test_prefix_index_compiled.py: equal answers over random
event sequences). A router configured for the compiled lookup refuses to start without the module
(a ConfigError naming it), never falling back silently.

Called from the router's event loop only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from infermesh.config import ConfigError

COMPILED_MODULE = "router_svc._prefix_probe"

# fill_prefixes(holders, hashes, members, out, max_probes, resolution) -> any held
_Fill = Callable[[dict[int, int], Sequence[int], int, np.ndarray, int, int], bool]


def _compiled_fill() -> _Fill:
    """The compiled lookup; ConfigError naming its module when it does not load."""
    try:
        from router_svc import _prefix_probe
    except ImportError as error:
        raise ConfigError(
            f'[routing] index = "compiled": the compiled module {COMPILED_MODULE} did not load '
            f'({error}); build it with `make native`, or set index = "python"'
        ) from error
    return _prefix_probe.fill_prefixes


class PrefixIndex:
    """Block hash -> the fleet slots whose workers' caches hold it."""

    def __init__(
        self, max_blocks: int, max_probes: int = 32, resolution: int = 64, *, compiled: bool = False
    ) -> None:
        """``compiled``: look up with the compiled module (ConfigError when it does not load),
        else with the pure-Python reference."""
        self._fill = _compiled_fill() if compiled else None
        self.max_blocks = max_blocks  # per worker
        self.max_probes = max_probes  # per lookup
        self.resolution = resolution  # a depth is found to 1/resolution of the prompt
        self._holders: dict[int, int] = {}  # hash -> mask of slots
        self._blocks: dict[int, dict[int, None]] = {}  # slot -> its hashes, oldest first
        self._masks: dict[int, int] = {}  # each distinct mask once
        self._masks_live = 0  # distinct masks at the last pruning of _masks

    def __len__(self) -> int:
        """Distinct blocks held by any worker."""
        return len(self._holders)

    def blocks(self, slot: int) -> int:
        """How many blocks the worker at ``slot`` holds."""
        return len(self._blocks.get(slot, ()))

    def slots(self) -> list[int]:
        return list(self._blocks)

    def apply(
        self, slot: int, stored: Iterable[int], removed: Iterable[int], cleared: bool = False
    ) -> None:
        """One batch of the worker's events: everything cleared first, then the removals, then
        the blocks stored (a block evicted and stored again in one batch is held)."""
        if cleared:
            self.drop(slot)
        held = self._blocks.setdefault(slot, {})
        bit = 1 << slot
        for block in removed:
            if block in held:
                del held[block]
                self._unhold(block, bit)
        for block in stored:
            if block in held:
                del held[block]  # stored again: the newest
                held[block] = None
                continue
            held[block] = None
            self._hold(block, bit)
        while len(held) > self.max_blocks:
            oldest = next(iter(held))
            del held[oldest]
            self._unhold(oldest, bit)
        self._prune_masks()

    def replace(self, slot: int, stored: Iterable[int]) -> None:
        """A snapshot: the worker holds exactly ``stored``."""
        self.apply(slot, stored, (), cleared=True)

    def drop(self, slot: int) -> None:
        """Forgets the worker at ``slot`` (it left the fleet, or its cache was cleared)."""
        bit = 1 << slot
        for block in self._blocks.pop(slot, ()):
            self._unhold(block, bit)

    def cached_blocks(self, hashes: Sequence[int], members: int, slots: int) -> np.ndarray | None:
        """For each fleet slot (``slots`` of them) among ``members`` (a mask), how many of the
        leading blocks of ``hashes`` it holds; None when none holds the first. The deepest
        prefix is resolved first and exactly, the others to 1/``resolution`` of the prompt; once
        ``max_probes`` are spent, the workers still to be told apart count only what the probes
        showed them to hold. Every count is a lower bound, and a worker holding more than another
        counts no less."""
        if self._fill is not None:
            counts = np.zeros(slots, dtype=np.int64)
            held = self._fill(
                self._holders, hashes, members, counts, self.max_probes, self.resolution
            )
            return counts if held else None
        get = self._holders.get
        first = get(hashes[0], 0) & members if hashes else 0
        if not first:
            return None
        cached = np.zeros(slots, dtype=np.int64)
        size = (slots + 7) // 8
        probes = self.max_probes
        finest = 1  # the narrowest range split: one block for the deepest prefix
        coarse = max(len(hashes) // self.resolution, 1)  # then 1/resolution of the prompt
        # (lo, hi, mask): the workers of mask hold block lo (as far as probed) and not block hi
        # (hi == len(hashes): past the last); the deepest range is on top
        ranges = [(0, len(hashes), first)]
        while ranges:
            lo, hi, mask = ranges.pop()
            if hi - lo > finest and probes:
                probes -= 1
                mid = (lo + hi) // 2
                holding = mask & get(hashes[mid], 0)
                if mask ^ holding:
                    ranges.append((lo, mid, mask ^ holding))
                if holding:
                    ranges.append((mid, hi, holding))
                continue
            depth = lo + 1  # block lo is held (hi, when the range is one block)
            finest = coarse
            if mask & (mask - 1):  # several workers' prefixes end there
                packed = np.frombuffer(mask.to_bytes(size, "little"), np.uint8)
                cached[np.unpackbits(packed, count=slots, bitorder="little").view(bool)] = depth
            else:  # one worker's (a session's history): no need to unpack its mask
                cached[mask.bit_length() - 1] = depth
        return cached

    def _hold(self, block: int, bit: int) -> None:
        mask = self._holders.get(block, 0) | bit
        self._holders[block] = self._masks.setdefault(mask, mask)

    def _unhold(self, block: int, bit: int) -> None:
        mask = self._holders[block] & ~bit
        if mask:
            self._holders[block] = self._masks.setdefault(mask, mask)
        else:
            del self._holders[block]

    def _prune_masks(self) -> None:
        """Forgets the interned masks no block has any more, once they outnumber both twice the
        live ones and a quarter of the blocks (so a pruning's pass over the blocks is paid for
        by as many new masks as a quarter of them)."""
        if len(self._masks) > max(2 * self._masks_live, len(self._holders) // 4) + 64:
            self._masks = {mask: mask for mask in self._holders.values()}
            self._masks_live = len(self._masks)
