"""The time KV cache takes between two workers: its bytes over the link between them. One
formula for the router, which weighs a pull against computing the prefix (router_svc/kv_pull.py),
and for the simulated engine, which spends that time sending its blocks (sim_engine/engine.py)."""

from __future__ import annotations

from typing import TypeVar

import numpy as np

# one link's speed, or an array of candidates' (the router's choice of a prefill worker)
Gbps = TypeVar("Gbps", float, np.ndarray)

# The peers whose links a worker reports measuring (Load.links: its most recently measured): a
# heartbeat's size, and what a router keeps per worker.
MAX_MEASURED_PEERS = 32


def kv_transfer_s(tokens: int, bytes_per_token: int, link_gbps: Gbps) -> Gbps:
    """Seconds to send ``tokens`` of KV cache of ``bytes_per_token`` over a ``link_gbps``
    (gigabits a second) link, or over each of an array of links."""
    return tokens * bytes_per_token * 8 / (link_gbps * 1e9)
