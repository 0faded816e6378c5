"""Whether a request's worker pulls a cached prefix of its prompt from the peer holding it
(``Route.pull``, served by the peer's ``Worker.KVBlocks``) instead of computing it.

One rule (``plan_pull``), applied once the worker is chosen: the candidate whose cache holds the
longest prefix of the prompt, as the router's prefix index says (the holder), is another worker,
holds more of the prompt than the chosen one, and has no free slot (at its max_parallel: the
request would wait there); then the tokens it holds beyond the chosen worker's are pulled when
sending their KV cache over the link is estimated to take less time than computing them::

    1 / holder's decode_tokens_per_second
        + tokens * kv_transfer_bytes_per_token * 8 / (link_gbps * 1e9)
    <  tokens * prefill_s_per_token

(the link between the two workers' zones: ``[routing] link_gbps`` within one, ``zone_link_gbps``
across two, or, once the chosen worker has measured its pulls from the holder, that measured rate:
``Fleet.link_gbps``, from the heartbeats' ``Load.links``; the holder copies the blocks out between
two of its steps, so the pull first waits for one, a decode step of one of its sequences; the
right-hand side uses the chosen worker's prefill speed, measured or estimated: a short prefix is
computed sooner than a busy holder gets to it). The pull's deadline is that right-hand side: past
it, computing would have been done. Both workers must send and take KV blocks
(``Capabilities.kv_transfer_bytes_per_token``), of one size per token and in one precision. No link
(``link_gbps = 0``, the default, or two zones ``zone_link_gbps`` does not list): no pull.

Prefill on P, decode on D is a pull too (``KVPull.compute``: the holder computes the blocks
first); whether a request's phases are split, and on which P, is router_svc/phases.py's rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from infermesh.kv_link import kv_transfer_s
from infermesh.pb import common_pb2
from infermesh.prefix_hash import BLOCK_TOKENS
from router_svc.fleet import Fleet, Group, WorkerEntry

# A P/D pull's deadline is twice the estimate (P's queue and prefill, then the transfer), at
# least this: an estimate is rough, and a guess (10,000 tokens/s) on a worker whose prefill speed
# is not known yet; a dead P fails at once whatever the deadline, only a stuck one waits it out.
PREFILL_MIN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class PullPlan:
    """The chosen worker takes the prompt's leading ``prefix_hashes`` from ``holder``."""

    holder: WorkerEntry
    # the request's own (a protobuf repeated field), not copied: a copy of an 80k-token
    # prompt's 5,000 hashes costs more than the rest of the decision
    prefix_hashes: Sequence[int]
    timeout_s: float
    # the holder computes the blocks first (prefill on P, decode on D: router_svc/phases.py), its
    # prefill estimated to take ``prefill_s``
    compute: bool = False
    prefill_s: float = 0.0

    def proto(self) -> common_pb2.KVPull:
        return common_pb2.KVPull(
            worker_id=self.holder.worker_id,
            address=self.holder.info.address,
            prefix_hashes=self.prefix_hashes,
            timeout_ms=max(1, round(self.timeout_s * 1000)),
            compute=self.compute,
        )


class Attempts(list[WorkerEntry]):
    """A decision's workers to try, best first, and what the first is to pull (None: nothing)."""

    pull: PullPlan | None = None


class ZoneLinks:
    """The links' Gb/s between every two zones a fleet's workers named (``Fleet.zones``), from
    ``[routing]`` (RoutingSection.link_between): a matrix, rebuilt only when a zone appears, so
    that a decision reads a candidate's link by index."""

    def __init__(self, link_between: Callable[[str, str], float]) -> None:
        self._between = link_between
        self._zones: list[str] = []
        self._gbps = np.zeros((0, 0))

    def of(self, fleet: Fleet) -> np.ndarray:
        """[zone, zone] -> Gb/s (0: no link), indexed as ``fleet.zone_of``."""
        zones = fleet.zones
        if self._zones != zones:
            self._gbps = np.array([[self._between(a, b) for b in zones] for a in zones])
            self._zones = list(zones)
        return self._gbps


def plan_pull(
    links: np.ndarray,
    fleet: Fleet,
    group: Group,
    busy: np.ndarray,
    cached_tokens: np.ndarray,
    chosen: int,
    prefix_hashes: Sequence[int],
) -> PullPlan | None:
    """The pull for the worker at index ``chosen`` of ``group`` (``busy``: each candidate's
    streams; ``cached_tokens``: the prompt's tokens in each one's cache), or None (the module's
    rule); ``links``: ZoneLinks.of(fleet)."""
    holder = int(cached_tokens.argmax())
    tokens = int(cached_tokens[holder] - cached_tokens[chosen])
    if holder == chosen or tokens <= 0:
        return None
    if busy[holder] * group.inverse_capacity[holder] < 1:
        return None  # a holder with a free slot: the cost chose against it, no need to pull
    theirs, mine = group.slots[holder], group.slots[chosen]
    configured = links[fleet.zone_of[mine], fleet.zone_of[theirs]]
    bytes_per_token = int(fleet.kv_bytes[mine])
    if configured <= 0 or not exchange_blocks(fleet, mine, np.array([theirs]))[0]:
        return None
    link_gbps = float(fleet.link_gbps(np.array([theirs]), mine, np.array([configured]))[0])
    decode_speed = float(fleet.speed[group.slots[holder]])
    step_s = 1 / decode_speed if decode_speed > 0 else 0.0
    transfer_s = step_s + kv_transfer_s(tokens, bytes_per_token, link_gbps)
    compute_s = tokens * float(group.prefill_s_per_token[chosen])
    if transfer_s >= compute_s:
        return None
    blocks = int(cached_tokens[holder]) // BLOCK_TOKENS
    return PullPlan(fleet.entry_at(theirs), prefix_hashes[:blocks], compute_s)


def exchange_blocks(fleet: Fleet, mine: int, theirs: np.ndarray) -> np.ndarray:
    """Whether the worker at slot ``mine`` and each at ``theirs`` can send each other KV blocks:
    both can, of one size per token, in one precision."""
    size = fleet.kv_bytes[mine]
    both: np.ndarray = (
        (size > 0)
        & (fleet.kv_bytes[theirs] == size)
        & (fleet.precision[theirs] == fleet.precision[mine])
    )
    return both
