"""This router's local view of the live workers: what every routing decision reads.

The shared registry lives in Redis (registry.py); each router copies it here every
``[registry] refresh_s`` and applies its own Register/Heartbeat calls at once, so a decision
never waits on Redis. The figures a decision scores (load, KV use, in-flight streams, speed,
ejection) are kept in numpy arrays indexed by a slot per worker, so that scoring a thousand
workers is a handful of vector operations. Called from the router's event loop only.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from infermesh.pb import common_pb2

logger = logging.getLogger(__name__)

_INITIAL_SLOTS = 64
# Prefill speed assumed for a worker that reports none, when no candidate reports one either
_UNKNOWN_PREFILL_TOKENS_PER_S = 10_000.0


class FleetWatcher(Protocol):
    """Told when a worker joins the fleet (or re-registers at another address) and leaves it."""

    def joined(self, entry: WorkerEntry) -> None: ...

    def left(self, entry: WorkerEntry) -> None: ...


@dataclasses.dataclass(frozen=True)
class Group:
    """The workers that can serve one (model, precision), with the figures of theirs that
    change only with the membership, gathered once for vectorized scoring."""

    slots: np.ndarray  # into the Fleet's arrays
    inverse_capacity: np.ndarray  # 1 / max_parallel
    capacity_share: np.ndarray  # max_parallel / the group's total
    slowness: np.ndarray  # 1 - decode speed / the fastest's (all 0 when none is known)
    salt: np.ndarray  # rendezvous hashing identities
    # seconds a prompt token's prefill takes (1 / prefill tokens/s; unknown: the slowest known)
    prefill_s_per_token: np.ndarray
    # (i mod n) x 1e-9 for i < 2n: ramp[n - k: 2n - k] rotates tie-breaks by k
    ramp: np.ndarray
    # its workers' model always thinks (reasoning format "deepseek_r1"): every request's output
    # may be long, thinking asked for or not
    always_thinks: bool = False

    @classmethod
    def of(cls, fleet: Fleet, slots: np.ndarray) -> Group:
        capacity = fleet.capacity[slots]
        speed = fleet.speed[slots]
        fastest = speed.max(initial=0.0)
        prefill = fleet.prefill_speed[slots]
        slowest = prefill[prefill > 0].min(initial=_UNKNOWN_PREFILL_TOKENS_PER_S)
        return cls(
            slots=slots,
            inverse_capacity=1 / capacity,
            capacity_share=capacity / max(capacity.sum(), 1),
            slowness=1 - speed / fastest if fastest > 0 else np.zeros(len(slots)),
            salt=fleet.salt[slots],
            prefill_s_per_token=1 / np.where(prefill > 0, prefill, slowest),
            ramp=np.arange(2 * len(slots)) % max(len(slots), 1) * 1e-9,
            always_thinks=bool(len(slots)) and bool(fleet.always_thinks[slots].all()),
        )

    def __len__(self) -> int:
        return len(self.slots)

    @functools.cached_property
    def members(self) -> int:
        """The slots as a mask (bit slot), as the prefix index keeps its holders: computed once
        a request with prefix hashes needs it (a group of free workers only may never)."""
        return sum(1 << int(slot) for slot in self.slots)


@dataclasses.dataclass(eq=False)
class WorkerEntry:
    info: common_pb2.WorkerInfo
    slot: int  # index into the Fleet's arrays
    salt: int  # the worker's 64-bit identity for rendezvous hashing (stable across routers)
    load: common_pb2.Load
    registered_at: float  # unix seconds
    expires_at: float  # monotonic seconds: the registry drops it then without a heartbeat
    updated_at: float  # monotonic seconds of the last change this router saw

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


class Fleet:
    """Live workers by id, with their numbers in slot-indexed arrays."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: dict[str, WorkerEntry] = {}
        self._by_slot: list[WorkerEntry | None] = []
        self._free: list[int] = []
        # (model, precision, gpu, prefill) -> its workers
        self._groups: dict[tuple[str, int, str, bool], Group] = {}
        self.ejected_until_max = 0.0  # the latest ejection's end: none are ejected after it
        self.busy = np.zeros(0)  # running + waiting, as last reported
        self.kv_usage = np.zeros(0)
        self.capacity = np.ones(0)  # max_parallel
        self.speed = np.zeros(0)  # decode tokens/s the worker estimates (0: unknown)
        self.prefill_speed = np.zeros(0)  # prefill tokens/s the worker estimates (0: unknown)
        # its model always thinks (Capabilities.reasoning_format "deepseek_r1")
        self.always_thinks = np.zeros(0, dtype=bool)
        # what KV blocks it exchanges with peers (router_svc/kv_pull.py): its precision, its
        # bytes per token (0: none) and its zone, an index into ``zones``
        self.precision = np.zeros(0, dtype=np.int64)
        self.kv_bytes = np.zeros(0, dtype=np.int64)
        self.zone_of = np.zeros(0, dtype=np.intp)
        self.zones: list[str] = [""]  # every zone a worker named, in order of first sight
        # how it serves a request's phases (router_svc/phases.py): the prompt tokens it prefills
        # a step beside decoding streams (0: a whole prompt in one step), and whether it may
        # prefill for another worker while idle (role "both")
        self.prefill_chunk = np.zeros(0, dtype=np.int64)
        self.lends_prefill = np.zeros(0, dtype=bool)
        self.salt = np.zeros(0, dtype=np.uint64)
        # Requests this router routed to the worker (the first choice of each decision) whose
        # end it has not heard of yet: the gateways' route streams report each one's end, its
        # internal callers' mesh calls theirs. Exact between load reports.
        self.in_flight = np.zeros(0)
        # in_flight when the worker's last load report came: what of its load the report owes
        # to this router's own count
        self.known_at_report = np.zeros(0)
        # The worker's busy slots as this router knows them now: its report less what this
        # router counts itself (others' load), plus in_flight.
        self.busy_now = np.zeros(0)
        # Monotonic seconds when the prefills this router sent the worker end, as the route
        # score estimates them (each one's uncached tokens at the worker's prefill speed, one
        # after another from when it was routed): the queue wait a new request's prefill adds to.
        self.prefill_until = np.zeros(0)
        self.failures = np.zeros(0)  # consecutive failed calls
        self.ejected_until = np.zeros(0)  # monotonic seconds
        # slot -> {peer worker id: Gb/s}: the links from its peers as the worker last reported
        # measuring them (Load.links); gone with the worker
        self._measured_links: dict[int, dict[str, float]] = {}
        self.watchers: list[FleetWatcher] = []
        self._grow(_INITIAL_SLOTS)

    @property
    def slot_count(self) -> int:
        """The length of the slot-indexed arrays (free slots included)."""
        return len(self._by_slot)

    # ------------------------------------------------------------------ membership

    def upsert(
        self,
        info: common_pb2.WorkerInfo,
        load: common_pb2.Load,
        registered_at: float,
        expires_in_s: float,
    ) -> WorkerEntry:
        """Adds or refreshes a worker; a changed WorkerInfo (a re-registration) replaces the old."""
        now = self.clock()
        entry = self._entries.get(info.worker_id)
        if entry is not None and entry.info != info:
            if entry.info.address != info.address:
                logger.warning(
                    "worker %s re-registered from %s (was %s)",
                    info.worker_id,
                    info.address,
                    entry.info.address,
                )
            moved = entry.info.address != info.address
            entry.info = info
            self._groups.clear()
            self._set_static(entry)
            if moved:
                for watcher in self.watchers:
                    watcher.joined(entry)
        elif entry is None:
            entry = self._add(info, registered_at, now)
        entry.expires_at = now + expires_in_s
        entry.updated_at = now
        self.set_load(entry, load)
        return entry

    def set_load(self, entry: WorkerEntry, load: common_pb2.Load) -> None:
        if load != entry.load:  # a new report: it counts what was routed before it
            self.known_at_report[entry.slot] = self.in_flight[entry.slot]
        entry.load = load
        if load.links:
            self._measured_links[entry.slot] = {link.worker_id: link.gbps for link in load.links}
        else:
            self._measured_links.pop(entry.slot, None)
        self.busy[entry.slot] = load.running + load.waiting
        self.kv_usage[entry.slot] = load.kv_cache_usage
        self._update_busy_now(entry.slot)

    def heartbeat(self, worker_id: str, load: common_pb2.Load, expires_in_s: float) -> None:
        """A heartbeat this router handled: new load, TTL renewed (unknown ids are ignored)."""
        entry = self._entries.get(worker_id)
        if entry is not None:
            entry.updated_at = self.clock()
            entry.expires_at = entry.updated_at + expires_in_s
            self.set_load(entry, load)

    def remove(self, worker_id: str) -> None:
        entry = self._entries.pop(worker_id, None)
        if entry is None:
            return
        self._by_slot[entry.slot] = None
        self._measured_links.pop(entry.slot, None)
        self._free.append(entry.slot)
        self._groups.clear()
        for watcher in self.watchers:
            watcher.left(entry)

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self._entries.get(worker_id)

    def entries(self) -> list[WorkerEntry]:
        return list(self._entries.values())

    def age_s(self, entry: WorkerEntry) -> float:
        """Seconds since the worker's last heartbeat, as far as this router knows."""
        return max(0.0, self.ttl_s - (entry.expires_at - self.clock()))

    def entry_at(self, slot: int) -> WorkerEntry:
        entry = self._by_slot[slot]
        assert entry is not None, f"slot {slot} is free"
        return entry

    def group(
        self, model: str, precision: common_pb2.Precision, gpu: str = "", *, prefill: bool = False
    ) -> Group:
        """The workers serving ``model`` in ``precision`` (UNSPECIFIED: any) on GPU kind ``gpu``
        ("": any) that decode (role "decode" or "both"), or with ``prefill`` those of role
        "prefill"; cached until the membership changes."""
        key = (model, precision, gpu, prefill)
        group = self._groups.get(key)
        if group is None:
            slots = np.array(
                [
                    e.slot
                    for e in self._entries.values()
                    if model in e.info.models
                    and precision
                    in (common_pb2.PRECISION_UNSPECIFIED, e.info.capabilities.precision)
                    and gpu in ("", e.info.capabilities.gpu_kind)
                    and (e.info.capabilities.role == "prefill") == prefill
                ],
                dtype=np.intp,
            )
            group = self._groups[key] = Group.of(self, slots)
        return group

    # ------------------------------------------------------------------ links

    def link_gbps(self, sources: np.ndarray, to: int, configured: np.ndarray) -> np.ndarray:
        """The Gb/s of the links from the workers at slots ``sources`` to the one at slot ``to``:
        as ``to`` measured its pulls from each (Load.links), else ``configured`` (each pair's
        [routing] link)."""
        measured = self._measured_links.get(to)
        if not measured:
            return configured
        ids = (self.entry_at(int(slot)).worker_id for slot in sources)
        found = np.array([measured.get(worker_id, 0.0) for worker_id in ids])
        gbps: np.ndarray = np.where(found > 0, found, configured)
        return gbps

    def measured_links(self) -> list[tuple[str, str, float]]:
        """Every measured link between two live workers: (from, to, Gb/s)."""
        return [
            (source, self.entry_at(slot).worker_id, gbps)
            for slot, links in self._measured_links.items()
            for source, gbps in links.items()
            if source in self._entries
        ]

    # ------------------------------------------------------------------ outcomes of calls

    def started(self, entry: WorkerEntry) -> None:
        """A request routed to the worker, counted until ``ended``."""
        if self._by_slot[entry.slot] is entry:
            self.in_flight[entry.slot] += 1
            self._update_busy_now(entry.slot)

    def ended(self, entry: WorkerEntry) -> None:
        """A request routed to the worker ended, or its caller did not send it (never below
        zero)."""
        # the slot may have gone to another worker since
        if self._by_slot[entry.slot] is entry and self.in_flight[entry.slot] > 0:
            self.in_flight[entry.slot] -= 1
            self._update_busy_now(entry.slot)

    def queued_prefill(self, entry: WorkerEntry, seconds: float) -> None:
        """A request routed to the worker adds ``seconds`` of prefill to its queue."""
        if self._by_slot[entry.slot] is entry and seconds > 0:
            start = max(self.prefill_until[entry.slot], self.clock())
            self.prefill_until[entry.slot] = start + seconds

    def full(self, group: Group) -> np.ndarray:
        """Per worker of ``group``: True when every one of its slots is busy."""
        full: np.ndarray = self.busy_now[group.slots] >= self.capacity[group.slots]
        return full

    def succeeded(self, entry: WorkerEntry) -> None:
        if self._by_slot[entry.slot] is entry:
            self.failures[entry.slot] = 0

    def ejected(self, entry: WorkerEntry) -> bool:
        """Whether the worker gets no traffic now, after failed calls in a row."""
        return bool(self.ejected_until[entry.slot] > self.clock())

    def failed(self, entry: WorkerEntry, failures_to_eject: int, cooldown_s: float) -> bool:
        """Counts a failed call; True when it ejects the worker for ``cooldown_s``."""
        if self._by_slot[entry.slot] is not entry:
            return False
        self.failures[entry.slot] += 1
        if self.failures[entry.slot] < failures_to_eject:
            return False
        self.failures[entry.slot] = 0
        self.ejected_until[entry.slot] = self.clock() + cooldown_s
        self.ejected_until_max = max(self.ejected_until_max, self.ejected_until[entry.slot])
        logger.warning(
            "worker %s ejected for %.1f s after %d failed calls in a row",
            entry.worker_id,
            cooldown_s,
            failures_to_eject,
        )
        return True

    # ------------------------------------------------------------------ slots

    def _add(self, info: common_pb2.WorkerInfo, registered_at: float, now: float) -> WorkerEntry:
        if not self._free:
            self._grow(len(self._by_slot) * 2)
        slot = self._free.pop()
        salt = int.from_bytes(
            hashlib.blake2b(info.worker_id.encode(), digest_size=8).digest(), "little"
        )
        entry = WorkerEntry(
            info=info,
            slot=slot,
            salt=salt,
            load=common_pb2.Load(),
            registered_at=registered_at,
            expires_at=now,
            updated_at=now,
        )
        self._entries[info.worker_id] = entry
        self._by_slot[slot] = entry
        for array in (
            self.in_flight,
            self.known_at_report,
            self.failures,
            self.ejected_until,
            self.busy,
            self.busy_now,
            self.prefill_until,
        ):
            array[slot] = 0
        self._set_static(entry)
        self._groups.clear()
        logger.info(
            "worker %s at %s serving %s (%s, index_topk %d; %s %s, %s)",
            info.worker_id,
            info.address,
            ", ".join(info.models),
            info.capabilities.model_type or "model_type unknown",
            info.capabilities.index_topk,
            info.capabilities.device,
            info.capabilities.device_name,
            common_pb2.Precision.Name(info.capabilities.precision),
        )
        for watcher in self.watchers:
            watcher.joined(entry)
        return entry

    def _set_static(self, entry: WorkerEntry) -> None:
        caps = entry.info.capabilities
        self.capacity[entry.slot] = max(caps.max_parallel, 1)
        self.speed[entry.slot] = caps.decode_tokens_per_second
        self.prefill_speed[entry.slot] = caps.prefill_tokens_per_second
        self.always_thinks[entry.slot] = caps.reasoning_format == "deepseek_r1"
        self.precision[entry.slot] = caps.precision
        self.kv_bytes[entry.slot] = caps.kv_transfer_bytes_per_token
        if caps.zone not in self.zones:
            self.zones.append(caps.zone)
        self.zone_of[entry.slot] = self.zones.index(caps.zone)
        self.prefill_chunk[entry.slot] = caps.prefill_chunk_tokens
        self.lends_prefill[entry.slot] = caps.role in ("", "both")
        self.salt[entry.slot] = entry.salt

    def _update_busy_now(self, slot: int) -> None:
        others = max(self.busy[slot] - self.known_at_report[slot], 0)
        self.busy_now[slot] = others + self.in_flight[slot]

    def _grow(self, size: int) -> None:
        old = len(self._by_slot)
        for name in (
            "busy",
            "kv_usage",
            "capacity",
            "speed",
            "prefill_speed",
            "always_thinks",
            "precision",
            "kv_bytes",
            "zone_of",
            "prefill_chunk",
            "lends_prefill",
            "salt",
            "in_flight",
            "known_at_report",
            "busy_now",
            "prefill_until",
            "failures",
            "ejected_until",
        ):
            array = getattr(self, name)
            grown = np.zeros(size, dtype=array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        self._by_slot.extend([None] * (size - old))
        self._free.extend(reversed(range(old, size)))
