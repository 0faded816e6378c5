"""The live workers: registered, kept alive by heartbeats, dropped after a TTL."""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

from infermesh.pb import common_pb2

logger = logging.getLogger(__name__)


class RegistrationError(ValueError):
    """A registration or heartbeat the registry refuses (the caller's fault)."""


@dataclasses.dataclass
class WorkerEntry:
    info: common_pb2.WorkerInfo
    load: common_pb2.Load
    registered_at: float  # unix seconds
    last_seen: float      # monotonic seconds
    in_flight: int = 0    # streams this router is relaying to the worker now

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


class Registry:
    """In-memory view of the fleet. Called from the router's event loop only."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._workers: dict[str, WorkerEntry] = {}

    def register(self, info: common_pb2.WorkerInfo, load: common_pb2.Load) -> None:
        if not info.worker_id:
            raise RegistrationError("worker_id is empty")
        if not info.address or ":" not in info.address:
            raise RegistrationError(f"address {info.address!r} is not host:port")
        if not info.models:
            raise RegistrationError("a worker must serve at least one model")
        _check_load(load)
        previous = self._workers.get(info.worker_id)
        if previous is not None and previous.info.address != info.address:
            logger.warning("worker %s re-registered from %s (was %s)",
                           info.worker_id, info.address, previous.info.address)
        elif previous is None:
            logger.info("worker %s registered at %s serving %s (%s, %s)", info.worker_id,
                        info.address, ", ".join(info.models), info.capabilities.device,
                        common_pb2.Precision.Name(info.capabilities.precision))
        self._workers[info.worker_id] = WorkerEntry(
            info=info, load=load, last_seen=self._clock(),
            registered_at=previous.registered_at if previous else time.time(),
            in_flight=previous.in_flight if previous else 0)

    def heartbeat(self, worker_id: str, load: common_pb2.Load) -> bool:
        """Refreshes a worker; False when it is unknown and must register again."""
        _check_load(load)
        entry = self.live().get(worker_id)
        if entry is None:
            return False
        entry.load = load
        entry.last_seen = self._clock()
        return True

    def remove(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def live(self) -> dict[str, WorkerEntry]:
        """The workers heard from within the TTL; expired ones are dropped here."""
        now = self._clock()
        for worker_id in [w for w, e in self._workers.items() if now - e.last_seen > self._ttl_s]:
            logger.warning("worker %s expired: no heartbeat for %.1f s", worker_id, self._ttl_s)
            del self._workers[worker_id]
        return self._workers

    def age_s(self, entry: WorkerEntry) -> float:
        return self._clock() - entry.last_seen


def _check_load(load: common_pb2.Load) -> None:
    for name in ("kv_cache_usage", "tokens_per_second"):
        value = getattr(load, name)
        if not math.isfinite(value) or value < 0:
            raise RegistrationError(f"load.{name} = {value} is not a finite non-negative number")
    if load.kv_cache_usage > 1:
        raise RegistrationError(f"load.kv_cache_usage = {load.kv_cache_usage} is above 1")
