"""Fair queueing when the fleet is full: asks that find every eligible worker at
``max_parallel`` wait here, in one queue per tenant, instead of being pushed onto a worker
past its slots.

Service across tenants is start-time fair queueing (SFQ, Goyal et al. 1996) with a tag per
tenant: a tenant's next request starts at ``max(its last finish tag, the virtual time)`` and
finishes ``1 / weight`` later; the backlogged tenant with the lowest start tag goes next and
the virtual time becomes its start tag. SFQ rather than deficit round robin: every request
costs one slot, so there is no quantum to tune, a tenant that was idle comes back at the
virtual time (it banks no credit), and the order is decided per dispatch without rounds. Within
a tenant, higher ``priority`` first, then arrival order. Several models share the queue: a
tenant whose next request's workers are all full is passed over, not waited on.

Bounds: ``max_per_tenant`` waiting asks per tenant (past it: RESOURCE_EXHAUSTED, the tenant's
own backlog) and ``max_total`` overall (UNAVAILABLE, the fleet's), both with a retry-after
estimated from the recent rate at which slots freed; a wait past the ask's deadline (or
``max_wait_s``) ends as UNAVAILABLE with one too. Called from the router's event loop only.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import grpc

from infermesh.pb import common_pb2
from router_svc.config import FairQueueSection
from telemetry import metrics

_RATE_WINDOW_S = 10.0  # placements counted for the service rate
_RETRY_AFTER_MIN_MS = 100
_RETRY_AFTER_MAX_MS = 60_000

Request = common_pb2.GenerateRequest
T = TypeVar("T")
RouteKey = tuple[str, int, str]  # (model, precision, gpu): asks that wait on the same workers


class QueueRefusedError(Exception):
    """The ask cannot wait (a bound is reached) or waited too long: the status to answer, and
    when to try again."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_ms = retry_after_ms


@dataclasses.dataclass(eq=False)
class _Waiting(Generic[T]):
    request: Request
    tenant: _Tenant[T]
    decided: asyncio.Future[T]
    context: contextvars.Context  # the ask's own (its trace span): placement runs in it
    enqueued_at: float
    expiry: asyncio.TimerHandle | None = None

    @property
    def key(self) -> RouteKey:
        return (self.request.model, self.request.precision, self.request.gpu)


@dataclasses.dataclass(eq=False)
class _Tenant(Generic[T]):
    name: str
    weight: float
    tier: str
    heap: list[tuple[int, int, _Waiting[T]]] = dataclasses.field(default_factory=list)
    size: int = 0  # waiting asks (the heap also holds cancelled ones until they surface)
    finish: float = 0.0  # SFQ finish tag of its last placed request

    def head(self) -> _Waiting[T] | None:
        while self.heap and self.heap[0][2].decided.done():
            heapq.heappop(self.heap)  # left the queue (cancelled, expired) while waiting
        return self.heap[0][2] if self.heap else None


class FairQueue(Generic[T]):
    """Asks waiting for a free slot. ``place(request)`` routes a request to a worker with a
    free slot (counting it) and returns the decision, or None when every eligible worker is
    full; it raises what a decision may (RouteError, RegistryUnavailableError)."""

    def __init__(
        self,
        config: FairQueueSection,
        place: Callable[[Request], T | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._place = place
        self._clock = clock
        self._tenants: dict[str, _Tenant[T]] = {}
        self._size = 0
        self._virtual_time = 0.0
        self._seq = itertools.count()
        self._placed_at: collections.deque[float] = collections.deque()

    def __len__(self) -> int:
        return self._size

    def waiting(self, tenant: str) -> int:
        found = self._tenants.get(tenant)
        return found.size if found is not None else 0

    def waiting_by_model(self) -> collections.Counter[str]:
        """The asks waiting now, by model (read at a metrics scrape: one pass over the queue)."""
        return collections.Counter(
            item.request.model
            for tenant in self._tenants.values()
            for _, _, item in tenant.heap
            if not item.decided.done()
        )

    def submit(self, request: Request, tier: str, wait_s: float) -> asyncio.Future[T]:
        """The request's decision: at once when nothing waits and a worker has a free slot,
        else once its turn comes; fails with QueueRefusedError (bounds, deadline) or what
        ``place`` raises. Cancelling the future takes the ask out of the queue."""
        loop = asyncio.get_running_loop()
        decided: asyncio.Future[T] = loop.create_future()
        tier = tier or "default"
        if not self._size:  # nobody is ahead: the common case, no queue at all
            try:
                placed = self._place(request)
            except Exception as e:
                decided.set_exception(e)
                return decided
            if placed is not None:
                self._count_placement()
                decided.set_result(placed)
                return decided
        tenant = self._tenant(request, tier)
        try:
            self._check_bounds(tenant)
        except QueueRefusedError as e:
            decided.set_exception(e)
            return decided
        item = _Waiting(request, tenant, decided, contextvars.copy_context(), self._clock())
        heapq.heappush(tenant.heap, (-request.priority, next(self._seq), item))
        tenant.size += 1
        self._size += 1
        metrics.ROUTER_QUEUE_DEPTH.labels(tier).inc()
        wait_s = min(wait_s, self._config.max_wait_s) if wait_s > 0 else self._config.max_wait_s
        item.expiry = loop.call_later(wait_s, self._expire, item)
        decided.add_done_callback(lambda _: self._left(item))
        self.dispatch()
        return decided

    def dispatch(self) -> None:
        """Places waiting asks, in fair order, while their workers have free slots: call it
        whenever a slot may have freed."""
        full: set[RouteKey] = set()
        while self._size:
            item = self._next(full)
            if item is None:
                return
            try:
                placed = item.context.run(self._place, item.request)
            except Exception as e:
                item.decided.set_exception(e)
                continue
            if placed is None:
                full.add(item.key)
                continue
            self._advance(item.tenant)
            self._count_placement()
            metrics.ROUTER_QUEUE_WAIT.labels(item.tenant.tier).observe(
                self._clock() - item.enqueued_at
            )
            item.decided.set_result(placed)

    def _next(self, full: set[RouteKey]) -> _Waiting[T] | None:
        """The head of the backlogged tenant with the lowest start tag whose workers are not
        known to be full."""
        best: _Waiting[T] | None = None
        best_start = 0.0
        idle = []
        for tenant in self._tenants.values():
            head = tenant.head()
            if head is None and tenant.finish <= self._virtual_time:
                idle.append(tenant.name)  # it would restart at the virtual time anyway
            if head is None or head.key in full:
                continue
            start = max(tenant.finish, self._virtual_time)
            if best is None or start < best_start:
                best, best_start = head, start
        for name in idle:
            del self._tenants[name]
        return best

    def _advance(self, tenant: _Tenant[T]) -> None:
        start = max(tenant.finish, self._virtual_time)
        self._virtual_time = start
        tenant.finish = start + 1 / tenant.weight

    def _tenant(self, request: Request, tier: str) -> _Tenant[T]:
        weight = float(request.weight or self._config.tier_weights.get(tier, 1))
        tenant = self._tenants.get(request.tenant)
        if tenant is None:
            tenant = self._tenants[request.tenant] = _Tenant(request.tenant, weight, tier)
        tenant.weight, tenant.tier = weight, tier  # the key's latest (an operator may change it)
        return tenant

    def _check_bounds(self, tenant: _Tenant[T]) -> None:
        if tenant.size >= self._config.max_per_tenant:
            self._refuse(
                tenant,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "tenant_full",
                f"{tenant.size} requests of this tenant already wait for a free worker "
                f"(at most {self._config.max_per_tenant}); retry later",
                tenant.size / self._share(tenant),
            )
        if self._size >= self._config.max_total:
            self._refuse(
                tenant,
                grpc.StatusCode.UNAVAILABLE,
                "fleet_full",
                f"every worker is busy and {self._size} requests wait (at most "
                f"{self._config.max_total}); retry later",
                self._size,
            )

    def _share(self, tenant: _Tenant[T]) -> float:
        """The tenant's share of the service while backlogged: its weight over all of theirs."""
        backlogged = sum(t.weight for t in self._tenants.values() if t.size) or tenant.weight
        return tenant.weight / max(backlogged, tenant.weight)

    def _refuse(
        self, tenant: _Tenant[T], code: grpc.StatusCode, reason: str, message: str, ahead: float
    ) -> None:
        metrics.ROUTER_QUEUE_REJECTED.labels(tenant.tier, reason).inc()
        raise QueueRefusedError(code, message, self.retry_after_ms(ahead))

    def retry_after_ms(self, ahead: float) -> int:
        """When ``ahead`` placements will have happened at the recent service rate."""
        now = self._clock()
        while self._placed_at and self._placed_at[0] < now - _RATE_WINDOW_S:
            self._placed_at.popleft()
        if len(self._placed_at) < 2:
            return self._config.default_retry_after_ms
        rate = len(self._placed_at) / max(now - self._placed_at[0], 1e-3)
        estimate = round(1000 * (ahead + 1) / rate)
        return min(max(estimate, _RETRY_AFTER_MIN_MS), _RETRY_AFTER_MAX_MS)

    def _count_placement(self) -> None:
        self._placed_at.append(self._clock())

    def _expire(self, item: _Waiting[T]) -> None:
        if item.decided.done():
            return
        metrics.ROUTER_QUEUE_REJECTED.labels(item.tenant.tier, "timeout").inc()
        waited = self._clock() - item.enqueued_at
        item.decided.set_exception(
            QueueRefusedError(
                grpc.StatusCode.UNAVAILABLE,
                f"every worker stayed busy for the {waited:.1f} s the request could wait; "
                "retry later",
                self.retry_after_ms(self._size),
            )
        )

    def _left(self, item: _Waiting[T]) -> None:
        """The ask's decision is done (placed, failed, expired or cancelled): out of the count."""
        if item.expiry is not None:
            item.expiry.cancel()
        tenant = item.tenant
        tenant.size -= 1
        self._size -= 1
        metrics.ROUTER_QUEUE_DEPTH.labels(tenant.tier).dec()
