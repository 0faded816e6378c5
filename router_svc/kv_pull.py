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

(``[routing] link_gbps``; the holder copies the blocks out between two of its steps, so the pull
first waits for one, a decode step of one of its sequences; the right-hand side uses the chosen
worker's prefill speed, measured or estimated: a short prefix is computed sooner than a busy
holder gets to it). The pull's deadline is that right-hand side: past it, computing would have
been done. Both workers must send and take KV blocks
(``Capabilities.kv_transfer_bytes_per_token``), of one size per token and in one precision.
``link_gbps = 0`` (the default) never pulls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from infermesh.pb import common_pb2
from infermesh.prefix_hash import BLOCK_TOKENS
from router_svc.fleet import Fleet, Group, WorkerEntry


@dataclass(frozen=True)
class PullPlan:
    """The chosen worker takes the prompt's leading ``prefix_hashes`` from ``holder``."""

    holder: WorkerEntry
    prefix_hashes: list[int]
    timeout_s: float

    def proto(self) -> common_pb2.KVPull:
        return common_pb2.KVPull(
            worker_id=self.holder.worker_id,
            address=self.holder.info.address,
            prefix_hashes=self.prefix_hashes,
            timeout_ms=max(1, round(self.timeout_s * 1000)),
        )


class Attempts(list[WorkerEntry]):
    """A decision's workers to try, best first, and what the first is to pull (None: nothing)."""

    pull: PullPlan | None = None


def plan_pull(
    link_gbps: float,
    fleet: Fleet,
    group: Group,
    busy: np.ndarray,
    cached_tokens: np.ndarray,
    chosen: int,
    prefix_hashes: Sequence[int],
) -> PullPlan | None:
    """The pull for the worker at index ``chosen`` of ``group`` (``busy``: each candidate's
    streams; ``cached_tokens``: the prompt's tokens in each one's cache), or None (the module's
    rule)."""
    holder = int(cached_tokens.argmax())
    tokens = int(cached_tokens[holder] - cached_tokens[chosen])
    if link_gbps <= 0 or holder == chosen or tokens <= 0:
        return None
    if busy[holder] * group.inverse_capacity[holder] < 1:
        return None  # a holder with a free slot: the cost chose against it, no need to pull
    holder_entry = fleet.entry_at(group.slots[holder])
    mine = fleet.entry_at(group.slots[chosen]).info.capabilities
    theirs = holder_entry.info.capabilities
    bytes_per_token = theirs.kv_transfer_bytes_per_token
    if (
        not bytes_per_token
        or bytes_per_token != mine.kv_transfer_bytes_per_token
        or theirs.precision != mine.precision
    ):
        return None
    decode_speed = float(fleet.speed[group.slots[holder]])
    step_s = 1 / decode_speed if decode_speed > 0 else 0.0
    transfer_s = step_s + tokens * bytes_per_token * 8 / (link_gbps * 1e9)
    compute_s = tokens * float(group.prefill_s_per_token[chosen])
    if transfer_s >= compute_s:
        return None
    blocks = int(cached_tokens[holder]) // BLOCK_TOKENS
    return PullPlan(holder_entry, list(prefix_hashes[:blocks]), compute_s)
