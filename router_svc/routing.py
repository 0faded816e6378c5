"""Worker choice: filter by model and precision, then rank by a policy."""
from __future__ import annotations

import itertools

import grpc

from infermesh.pb import common_pb2
from router_svc.config import Policy
from router_svc.registry import WorkerEntry


class RouteError(Exception):
    """No worker can take the request; carries the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def candidates(workers: list[WorkerEntry], model: str,
               precision: common_pb2.Precision.ValueType) -> list[WorkerEntry]:
    """The workers that serve ``model`` in ``precision`` (any when unspecified)."""
    if not workers:
        raise RouteError(grpc.StatusCode.UNAVAILABLE, "no worker is registered; retry later")
    serving = [w for w in workers if model in w.info.models]
    if not serving:
        served = sorted({m for w in workers for m in w.info.models})
        raise RouteError(grpc.StatusCode.NOT_FOUND,
                         f"model {model!r} is not served; served models: "
                         f"{', '.join(served)}")
    if precision == common_pb2.PRECISION_UNSPECIFIED:
        return serving
    matching = [w for w in serving if w.info.capabilities.precision == precision]
    if not matching:
        available = sorted({_precision_name(w.info.capabilities.precision) for w in serving})
        raise RouteError(grpc.StatusCode.FAILED_PRECONDITION,
                         f"no worker serves {model!r} in precision {_precision_name(precision)}; "
                         f"available: {', '.join(available)}")
    return matching


class Chooser:
    """Ranks candidates by the configured policy. One per router process."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._turn = itertools.count()

    def rank(self, workers: list[WorkerEntry]) -> list[WorkerEntry]:
        """Candidates best first. Round robin rotates; least_load orders by the
        fraction of the worker's parallel slots in use, rotating among ties."""
        if not workers:
            return []
        start = next(self._turn) % len(workers)
        rotated = workers[start:] + workers[:start]
        if self._policy == "round_robin":
            return rotated
        return sorted(rotated, key=_load_fraction)


def _load_fraction(worker: WorkerEntry) -> float:
    # The router's own in-flight count is fresher than the last heartbeat.
    busy = max(worker.load.running + worker.load.waiting, worker.in_flight)
    return busy / max(worker.info.capabilities.max_parallel, 1)


def _precision_name(precision: common_pb2.Precision.ValueType) -> str:
    return common_pb2.Precision.Name(precision).removeprefix("PRECISION_").lower()
