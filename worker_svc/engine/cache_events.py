"""What an engine's prefix cache stores and evicts, as `infermesh.prefix_hash` hashes, for the
routers that subscribe over Worker.CacheEvents.

An engine reports from its own thread (`stored`, `removed`, `cleared`: one lock, a few dict
writes) and calls `flush` once per engine step; a flush coalesces the step's reports into one
batch (its net effect: a block stored and evicted in the same step is no event), numbers its
events, keeps it in a bounded ring of recent batches and hands it to the subscribers on the
event loop. A subscriber that is more than `backlog` events behind is dropped (it reconnects and
resyncs) rather than buffered without bound.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
import threading
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass

DEFAULT_HISTORY_EVENTS = 65536
DEFAULT_BACKLOG_EVENTS = 65536
SNAPSHOT_CHUNK = 65536  # hashes per snapshot message: 512 KiB, well under gRPC's 4 MiB


@dataclass(frozen=True)
class CacheBatch:
    """One step's net change (or a snapshot): `cleared` applies first, then removed and stored."""

    seq: int  # of the batch's last event
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    cleared: bool = False
    snapshot: bool = False

    @property
    def events(self) -> int:
        return len(self.stored) + len(self.removed) + self.cleared


class SubscriberDroppedError(Exception):
    """The subscriber fell too far behind; it must reconnect to resync."""


class _Subscriber:
    def __init__(self, last_seq: int, backlog: int) -> None:
        self.last_seq = last_seq  # batches up to it were delivered (or covered by a snapshot)
        self._backlog = backlog
        self._queued = 0
        self._batches: collections.deque[CacheBatch] = collections.deque()
        self._ready = asyncio.Event()
        self.dropped = False
        self.closed = False

    def offer(self, batch: CacheBatch) -> bool:
        """Queues `batch`; False when that puts the subscriber over its backlog (dropped)."""
        if batch.seq <= self.last_seq:  # flushed before it subscribed: in what it got already
            return True
        self.last_seq = batch.seq
        self._queued += batch.events
        if self._queued > self._backlog:
            self.dropped = True
            self._batches.clear()
        else:
            self._batches.append(batch)
        self._ready.set()
        return not self.dropped

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def next(self) -> CacheBatch | None:
        """The next batch; None once closed, what is queued left unsent (the worker stops)."""
        while not self._batches:
            if self.dropped:
                raise SubscriberDroppedError(
                    f"more than {self._backlog} cache events waited for this subscriber; "
                    "reconnect to resync"
                )
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        if self.closed:
            return None
        batch = self._batches.popleft()
        self._queued -= batch.events
        return batch


class CacheEvents:
    """One engine's cache events: an epoch per engine start, a seq per event, what is held now."""

    def __init__(
        self,
        history_events: int = DEFAULT_HISTORY_EVENTS,
        backlog_events: int = DEFAULT_BACKLOG_EVENTS,
    ) -> None:
        self.epoch = secrets.randbits(64) or 1  # 0 means "none seen" to a subscriber
        self._history_events, self._backlog_events = history_events, backlog_events
        self._lock = threading.Lock()
        self._held: set[int] = set()
        # this step's reports: each hash touched, and whether it was held when the step began
        self._held_before: dict[int, bool] = {}
        self._cleared = False
        self._seq = 0
        self._ring: collections.deque[CacheBatch] = collections.deque()
        self._ring_events = 0
        self._ring_base = 0  # the seq just before the ring's oldest batch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscribers: set[_Subscriber] = set()

    @property
    def seq(self) -> int:
        return self._seq

    def held(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._held)

    def held_prefix(self, hashes: Iterable[int]) -> int:
        """How many of the leading ``hashes`` are held."""
        count = 0
        with self._lock:
            for h in hashes:
                if h not in self._held:
                    break
                count += 1
        return count

    # ------------------------------------------------------------------ engine side (any thread)

    def stored(self, hashes: Iterable[int]) -> None:
        with self._lock:
            for h in hashes:
                if h not in self._held:
                    self._held_before.setdefault(h, False)
                    self._held.add(h)

    def removed(self, hashes: Iterable[int]) -> None:
        with self._lock:
            for h in hashes:
                if h in self._held:
                    self._held_before.setdefault(h, True)
                    self._held.discard(h)

    def cleared(self) -> None:
        """Everything was evicted (a reset of the engine's cache)."""
        with self._lock:
            self._held.clear()
            self._held_before.clear()
            self._cleared = True

    def flush(self) -> None:
        """Ends the step: its net change becomes one batch (none when nothing changed)."""
        with self._lock:
            if not self._held_before and not self._cleared:
                return
            stored: tuple[int, ...]
            removed: tuple[int, ...] = ()
            if self._cleared:
                stored = tuple(self._held)
            else:
                changed = [
                    (h, was) for h, was in self._held_before.items() if was != (h in self._held)
                ]
                stored = tuple(h for h, was in changed if not was)
                removed = tuple(h for h, was in changed if was)
            cleared, self._cleared = self._cleared, False
            self._held_before.clear()
            events = len(stored) + len(removed) + cleared
            if not events:
                return
            self._seq += events
            batch = CacheBatch(self._seq, stored, removed, cleared)
            self._remember(batch)
            # a subscriber that comes later finds the batch in the ring or its snapshot
            loop = self._loop if self._subscribers else None
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is left to tell
                loop.call_soon_threadsafe(self._deliver, batch)

    def _remember(self, batch: CacheBatch) -> None:
        self._ring.append(batch)
        self._ring_events += batch.events
        while self._ring_events > self._history_events:
            oldest = self._ring.popleft()
            self._ring_events -= oldest.events
            self._ring_base = oldest.seq

    # ------------------------------------------------------------------ subscriber side (loop)

    def _deliver(self, batch: CacheBatch) -> None:
        for subscriber in list(self._subscribers):
            if not subscriber.offer(batch):
                self._subscribers.discard(subscriber)

    def end_subscriptions(self) -> None:
        """Ends every subscriber's stream: a server stopping ends them itself, so that grpc never
        aborts them as still running (the subscribers resync from whoever serves next)."""
        for subscriber in self._subscribers:
            subscriber.close()

    def _catch_up(self, epoch: int, after_seq: int) -> list[CacheBatch] | None:
        """The ring's batches after `after_seq`, or None when they are not all there."""
        if epoch != self.epoch or not self._ring_base <= after_seq <= self._seq:
            return None
        if after_seq == self._ring_base:
            return list(self._ring)
        for i, batch in enumerate(self._ring):
            if batch.seq == after_seq:
                return list(self._ring)[i + 1 :]
        return None  # not a batch's end: a seq this worker never sent

    async def subscribe(
        self, epoch: int = 0, after_seq: int = 0
    ) -> AsyncGenerator[CacheBatch, None]:
        """A snapshot (in chunks: the first marked `snapshot`) unless the ring still holds every
        event after (epoch, after_seq), then the batches as they are flushed. Raises
        SubscriberDroppedError when the subscriber falls more than the backlog behind."""
        self._loop = asyncio.get_running_loop()
        with self._lock:
            missed = self._catch_up(epoch, after_seq)
            held = list(self._held) if missed is None else []
            seq = self._seq
            subscriber = _Subscriber(seq, self._backlog_events)
            self._subscribers.add(subscriber)
        try:
            if missed is None:
                for start in range(0, max(len(held), 1), SNAPSHOT_CHUNK):
                    yield CacheBatch(
                        seq, tuple(held[start : start + SNAPSHOT_CHUNK]), snapshot=start == 0
                    )
            else:
                for batch in missed:
                    yield batch
            while (delivered := await subscriber.next()) is not None:
                yield delivered
        finally:
            self._subscribers.discard(subscriber)
