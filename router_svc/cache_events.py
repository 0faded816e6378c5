"""The router's subscriptions to its workers' cache events (Worker.CacheEvents), applied to its
prefix index: one stream per worker in the fleet, from when it joins until it leaves.

A stream starts with a snapshot (in chunks: the first marked ``snapshot``, the rest with its seq)
unless the worker still has the events after the router's last
(epoch, seq); then it sends events as they happen. A batch whose first event is not the one after
the last applied (a lost batch), or of a new epoch without a snapshot, means the index may be
wrong for that worker: the router asks again from nothing (epoch 0), and the snapshot replaces
what it held. A stream that fails is opened again after a backoff, from the last batch applied.
A router that restarts has no index: its first stream to each worker starts from a snapshot.

A stream from each worker rather than Redis: events come at the engines' rate (every block of
every prefill, each evicted block), only routers read them, and each router already holds a
mutually authenticated channel to every worker. Point to point, they cost no central store a
write per block and a fan-out to every router, and there is nothing to lose when Redis fails
over: the worker is the one source of what it holds, and its snapshot rebuilds a router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from infermesh.channels import WorkerChannels
from infermesh.pb import worker_pb2
from infermesh.tasks import cancel_and_wait
from router_svc.fleet import WorkerEntry
from router_svc.prefix_index import PrefixIndex
from telemetry import metrics

logger = logging.getLogger(__name__)

_BACKOFF_S = (0.25, 5.0)  # the first retry's delay, doubling up to the second


class _Resync(Exception):
    """The worker's events cannot be applied to what the index holds: start from a snapshot."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def events_in(batch: worker_pb2.CacheEventBatch) -> int:
    """How many seqs a batch spans: one per block stored or removed, one for a clear."""
    return len(batch.stored) + len(batch.removed) + batch.cleared


class CacheEventSubscriptions:
    """Follows the fleet (a FleetWatcher): a task per worker streaming its cache events into
    ``index`` over ``channels``."""

    def __init__(self, index: PrefixIndex, channels: WorkerChannels) -> None:
        self._index = index
        self._channels = channels
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def joined(self, entry: WorkerEntry) -> None:
        old = self._tasks.pop(entry.worker_id, None)
        if old is not None:  # re-registered at another address: the old stream's worker is gone
            old.cancel()
            self._index.drop(entry.slot)
        self._tasks[entry.worker_id] = asyncio.get_running_loop().create_task(
            self._follow(entry), name=f"cache events of {entry.worker_id}"
        )

    def left(self, entry: WorkerEntry) -> None:
        task = self._tasks.pop(entry.worker_id, None)
        if task is not None:
            task.cancel()
        self._index.drop(entry.slot)
        metrics.INDEX_SIZE.set(len(self._index))

    async def close(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            await cancel_and_wait(task)

    async def _follow(self, entry: WorkerEntry) -> None:
        """Streams the worker's events until cancelled (it left), resubscribing after failures."""
        try:
            await self._stream(entry)
        finally:
            for gauge in (metrics.INDEX_BLOCKS, metrics.CACHE_EVENTS_CONNECTED):
                with contextlib.suppress(KeyError):  # never set: it left before its first batch
                    gauge.remove(entry.worker_id)

    async def _stream(self, entry: WorkerEntry) -> None:
        worker = entry.worker_id
        epoch = seq = 0
        delay = _BACKOFF_S[0]
        reason = "start"  # why a snapshot asked for with epoch 0 replaces the worker's blocks
        while True:
            stub = self._channels.stub(entry.info.address)
            call = stub.CacheEvents(worker_pb2.CacheEventsRequest(epoch=epoch, after_seq=seq))
            in_snapshot = False  # the last batch was a snapshot's chunk: more may follow
            try:
                async for batch in call:
                    metrics.CACHE_EVENTS_CONNECTED.labels(worker).set(1)
                    started = time.perf_counter()
                    if batch.snapshot:
                        self._index.replace(entry.slot, batch.stored)
                        if epoch:  # the worker did not resume from our (epoch, seq)
                            reason = "epoch" if batch.epoch != epoch else "stale"
                        metrics.CACHE_RESYNCS.labels(worker, reason).inc()
                        in_snapshot = True
                    elif in_snapshot and batch.epoch == epoch and batch.seq == seq:
                        self._index.apply(entry.slot, batch.stored, ())  # the snapshot goes on
                    elif batch.epoch != epoch:
                        raise _Resync("epoch")
                    elif batch.seq - events_in(batch) != seq:
                        raise _Resync("gap")
                    else:
                        self._index.apply(entry.slot, batch.stored, batch.removed, batch.cleared)
                        in_snapshot = False
                    epoch, seq = batch.epoch, batch.seq
                    delay = _BACKOFF_S[0]
                    metrics.CACHE_EVENTS.labels(worker).inc(events_in(batch))
                    metrics.INDEX_BLOCKS.labels(worker).set(self._index.blocks(entry.slot))
                    metrics.INDEX_SIZE.set(len(self._index))
                    metrics.CACHE_BATCH_APPLY.observe(time.perf_counter() - started)
            except _Resync as e:
                logger.warning(
                    "cache events of worker %s: %s after seq %d of epoch %d; resubscribing "
                    "from a snapshot",
                    worker,
                    e.reason,
                    seq,
                    epoch,
                )
                metrics.CACHE_EVENTS_CONNECTED.labels(worker).set(0)
                epoch = seq = 0
                reason = e.reason
                continue
            except grpc.aio.AioRpcError as e:
                logger.info(
                    "cache events of worker %s: %s (%s); again in %.2f s",
                    worker,
                    e.code().name,
                    e.details(),
                    delay,
                )
            finally:
                call.cancel()
            metrics.CACHE_EVENTS_CONNECTED.labels(worker).set(0)
            await asyncio.sleep(delay)
            delay = min(2 * delay, _BACKOFF_S[1])
