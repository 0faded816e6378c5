"""What an autoscaler scales worker pools on, per model and pool, read from this router's fleet
view and fair queue at scrape time (Prometheus), so that the autoscaler computes nothing itself.

A pool is the workers of one ``[worker] role``: ``prefill`` (they compute prompts' KV blocks for
decode workers), ``decode`` or ``both`` (a request's worker). Series, labelled ``model`` and
``pool``:

- ``infermesh_router_pool_workers``: live workers (not ejected);
- ``infermesh_router_pool_queue_depth``: requests waiting in the fair queue for a free slot of
  the pool (the request pools only: a prefill worker is never a request's worker);
- ``infermesh_router_pool_predicted_ttft_seconds``: the time to first token a new request would
  meet before its own prefill: its wait in the fair queue (the queue ahead of it at the recent
  rate slots free) and the prefill queued on the least backlogged worker;
- ``infermesh_router_pool_decode_utilisation``: busy slots over slots (``max_parallel``);
- ``infermesh_router_pool_prefill_utilisation``: the share of the pool's workers prefilling now
  (prefill this router sent them, by its estimate, is not done);
- ``infermesh_router_pool_prefill_backlog_seconds``: the prefill seconds queued on the pool;
- ``infermesh_router_batch_backlog`` (``model`` only): requests waiting to be batched, once the
  batch builder reports them (``report_batch_backlog``); absent before.

A model with no live worker in a pool has no series for that pool: absent, not zero (an
autoscaler reading zero would scale to zero what it cannot see).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router_svc.fleet import Fleet, WorkerEntry

_PREFILL_ROLE = "prefill"
_BOTH_ROLE = "both"


def pool_of(entry: WorkerEntry) -> str:
    """The worker's pool: its role ("prefill", "decode" or "both"; unset: "both")."""
    return entry.info.capabilities.role or _BOTH_ROLE


@dataclasses.dataclass
class _Pool:
    workers: int = 0
    slots: float = 0.0
    busy: float = 0.0
    prefilling: int = 0
    backlog_s: float = 0.0
    least_backlog_s: float = float("inf")

    def add(self, busy: float, slots: float, backlog_s: float) -> None:
        self.workers += 1
        self.slots += slots
        self.busy += busy
        self.prefilling += backlog_s > 0
        self.backlog_s += backlog_s
        self.least_backlog_s = min(self.least_backlog_s, backlog_s)


class ScalingSignals(Collector):
    """The series above for ``fleet``; ``queued()`` gives the fair queue's waiting requests per
    model, ``queue_wait_s(ahead)`` the wait of a request with ``ahead`` requests before it (both
    zero without fair queueing)."""

    def __init__(
        self,
        fleet: Fleet,
        queued: Callable[[], Mapping[str, int]],
        queue_wait_s: Callable[[int], float],
    ) -> None:
        self._fleet = fleet
        self._queued = queued
        self._queue_wait_s = queue_wait_s
        self._batch_backlog: dict[str, int] = {}

    def report_batch_backlog(self, model: str, requests: int) -> None:
        """The batch builder's hook: ``requests`` of ``model`` wait to be batched now."""
        if requests < 0:
            raise ValueError(f"requests: must be >= 0, got {requests}")
        self._batch_backlog[model] = requests

    def pools(self) -> dict[tuple[str, str], _Pool]:
        """(model, pool) -> its figures now, for every pool with a live worker."""
        fleet = self._fleet
        now = fleet.clock()
        pools: dict[tuple[str, str], _Pool] = {}
        for entry in fleet.entries():
            if fleet.ejected(entry):
                continue
            slot = entry.slot
            backlog_s = max(float(fleet.prefill_until[slot]) - now, 0.0)
            for model in entry.info.models:
                pool = pools.setdefault((model, pool_of(entry)), _Pool())
                pool.add(float(fleet.busy_now[slot]), float(fleet.capacity[slot]), backlog_s)
        return pools

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ["model", "pool"]
        families = {
            name: GaugeMetricFamily(f"infermesh_router_pool_{name}", text, labels=labels)
            for name, text in _FAMILIES.items()
        }
        queued = self._queued()
        for (model, name), pool in sorted(self.pools().items()):
            waiting = 0 if name == _PREFILL_ROLE else queued.get(model, 0)
            wait_s = self._queue_wait_s(waiting) if waiting else 0.0
            values = {
                "workers": pool.workers,
                "queue_depth": waiting,
                "predicted_ttft_seconds": wait_s + pool.least_backlog_s,
                "decode_utilisation": pool.busy / pool.slots if pool.slots else 0.0,
                "prefill_utilisation": pool.prefilling / pool.workers,
                "prefill_backlog_seconds": pool.backlog_s,
            }
            for key, value in values.items():
                families[key].add_metric([model, name], value)
        yield from families.values()
        backlog = GaugeMetricFamily(
            "infermesh_router_batch_backlog",
            "Requests waiting to be batched, by model, as the batch builder reports them",
            labels=["model"],
        )
        for model, requests in sorted(self._batch_backlog.items()):
            backlog.add_metric([model], requests)
        yield backlog


_FAMILIES = {
    "workers": "Live workers (not ejected) of the pool, by model and pool (role)",
    "queue_depth": "Requests waiting in the router's fair queue for a slot of the pool",
    "predicted_ttft_seconds": (
        "Seconds a new request would wait before its own prefill: its fair-queue wait at the "
        "recent rate slots free, plus the prefill queued on the pool's least backlogged worker"
    ),
    "decode_utilisation": "Busy slots over slots (max_parallel) of the pool's workers",
    "prefill_utilisation": "Share of the pool's workers with prefill queued or running now",
    "prefill_backlog_seconds": "Seconds of prefill queued on the pool's workers, summed",
}

# The series' names, as an autoscaler's queries name them (deploy/k8s/optional/).
SERIES = (
    *(f"infermesh_router_pool_{name}" for name in _FAMILIES),
    "infermesh_router_batch_backlog",
)
