"""The shared worker registry in Redis: workers registered with their capabilities, kept
alive by heartbeats, gone when their key's TTL runs out.

Every router of a mesh reads and writes the same keys, so they share one view:

- ``{<key_prefix>}worker:<id>``: a hash {info, load (serialized protos), registered_at,
  owner}, with a TTL of ``[registry] ttl_s`` that each heartbeat renews. ``owner`` is the
  certificate identity that registered the id: while the hash lives, only that identity may
  register or heartbeat it (checked in Redis, so every router of the mesh enforces it);
- ``{<key_prefix>}workers``: the set of ids, pruned of those whose key expired
  (``[redis] key_prefix``, by default ``infermesh:router:``).

The prefix is a hash tag: in a Redis Cluster the whole registry (a few hundred small
hashes at most) lives in one slot, so registering stays one transaction.

Routing decisions never read Redis: each router copies the registry into its local
:class:`~router_svc.fleet.Fleet` every ``refresh_s`` (one script, one round trip) and applies
the Register/Heartbeat calls it handles itself at once. When Redis cannot be reached the
registry says so (:class:`RegistryUnavailableError`), the router answers UNAVAILABLE, and the
refresh loop keeps trying until Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from infermesh.kv_link import MAX_MEASURED_PEERS
from infermesh.pb import common_pb2
from infermesh.redis_client import REDIS_ERRORS, parse_redis_url, redis_client
from router_svc.config import RedisSection, RegistrySection
from router_svc.fleet import Fleet

logger = logging.getLogger(__name__)
T = TypeVar("T")
_UNREACHABLE: tuple[type[Exception], ...] = (*REDIS_ERRORS, OSError)

# Writes a worker's hash unless another identity owns it: {1, registered_at}, else {0, the
# owner}. KEYS: the worker's hash, the index; ARGV: info, load, owner, now, TTL in ms, id.
_REGISTER_LUA = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= ARGV[3] then return {0, owner} end
redis.call('HSET', KEYS[1], 'info', ARGV[1], 'load', ARGV[2], 'owner', ARGV[3])
redis.call('HSETNX', KEYS[1], 'registered_at', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('SADD', KEYS[2], ARGV[6])
return {1, redis.call('HGET', KEYS[1], 'registered_at')}
"""

# Renews a worker's hash only while it exists (0: unknown, it must register) and only for its
# owner (-1: another identity's): a heartbeat never resurrects an expired worker nor reports
# another's load. It also lists the worker in the index again, so a worker that heartbeats is
# always listed, whatever removed it from the index. A leaving worker's (ARGV[5] = 1) hash and
# listing are deleted instead (0: it is no longer known).
_HEARTBEAT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= ARGV[4] then return -1 end
if ARGV[5] == '1' then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[3])
  return 0
end
redis.call('HSET', KEYS[1], 'load', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
return 1
"""

# The registry's snapshot: for each listed worker whose hash lives, its id, info, load,
# registered_at and TTL in ms (flat); the ids whose hash expired are unlisted in the same
# script. Read and prune in two round trips would race a registration landing between them
# and unlist a live worker. A hash with a TTL holds its fields: one MULTI writes them and the
# TTL. KEYS[1]: the index; ARGV[1]: the prefix of the workers' keys,
# which share the index's hash tag (one slot in a cluster).
_SNAPSHOT_LUA = """
local live = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = ARGV[1] .. id
  local ttl = redis.call('PTTL', key)
  if ttl < 0 then
    redis.call('SREM', KEYS[1], id)
  else
    local fields = redis.call('HMGET', key, 'info', 'load', 'registered_at')
    table.insert(live, id)
    table.insert(live, fields[1])
    table.insert(live, fields[2])
    table.insert(live, fields[3])
    table.insert(live, ttl)
  end
end
return live
"""


class RegistrationError(ValueError):
    """A registration or heartbeat the registry refuses (the caller's fault)."""


class WorkerOwnedError(Exception):
    """The worker id belongs to another certificate identity while its entry lives."""

    def __init__(self, worker_id: str, owner: str) -> None:
        super().__init__(f"worker {worker_id} is registered by {owner or 'no mesh identity'}")


class RegistryUnavailableError(RuntimeError):
    """Redis, where the registry lives, cannot be reached now."""


def check_registration(info: common_pb2.WorkerInfo, load: common_pb2.Load) -> None:
    """Raises RegistrationError for a WorkerInfo or Load the router cannot use."""
    if not info.worker_id:
        raise RegistrationError("worker_id is empty")
    if not info.address or ":" not in info.address:
        raise RegistrationError(f"address {info.address!r} is not host:port")
    if not info.models:
        raise RegistrationError("a worker must serve at least one model")
    caps = info.capabilities
    for name in ("decode_tokens_per_second", "prefill_tokens_per_second"):
        value = getattr(caps, name)
        if not math.isfinite(value) or value < 0:
            raise RegistrationError(
                f"capabilities.{name} = {value} is not a finite non-negative number"
            )
    check_load(load)


def check_load(load: common_pb2.Load) -> None:
    for name in ("kv_cache_usage", "tokens_per_second"):
        value = getattr(load, name)
        if not math.isfinite(value) or value < 0:
            raise RegistrationError(f"load.{name} = {value} is not a finite non-negative number")
    if load.kv_cache_usage > 1:
        raise RegistrationError(f"load.kv_cache_usage = {load.kv_cache_usage} is above 1")
    if len(load.links) > MAX_MEASURED_PEERS:
        raise RegistrationError(
            f"load.links: {len(load.links)} peers, more than the {MAX_MEASURED_PEERS} a worker "
            "keeps"
        )
    for link in load.links:
        if not link.worker_id or not math.isfinite(link.gbps) or link.gbps <= 0:
            raise RegistrationError(
                f"load.links: {link.worker_id!r} at {link.gbps} Gb/s is not a peer's id with a "
                "finite positive rate"
            )


class Registry:
    """The Redis registry and this router's local copy of it (``fleet``)."""

    def __init__(self, redis_config: RedisSection, config: RegistrySection, fleet: Fleet) -> None:
        # No client-side retries: a failed call is reported now, the refresh loop retries.
        self._redis = redis_client(
            redis_config.url, timeout_s=redis_config.timeout_s, retries=False
        )
        self._register = self._redis.register_script(_REGISTER_LUA)
        self._heartbeat = self._redis.register_script(_HEARTBEAT_LUA)
        self._snapshot = self._redis.register_script(_SNAPSHOT_LUA)
        self._where = parse_redis_url(redis_config.url).where()
        tag = f"{{{redis_config.key_prefix}}}"
        self._worker_key = f"{tag}worker:"
        self._index_key = f"{tag}workers"
        self._ttl_ms = config.ttl_ms
        self._ttl_s = config.ttl_s
        self._refresh_s = config.refresh_s
        self.fleet = fleet
        self._failure: str | None = "the worker registry has not been read from Redis yet"
        self._info_bytes: dict[str, bytes] = {}  # as last read, to parse only what changed

    @property
    def available(self) -> bool:
        return self._failure is None

    def check_available(self) -> None:
        """Raises RegistryUnavailableError while the last Redis call failed."""
        if self._failure is not None:
            raise RegistryUnavailableError(self._failure)

    async def register(
        self, info: common_pb2.WorkerInfo, load: common_pb2.Load, owner: str = ""
    ) -> None:
        """Registers (or updates) the worker for the certificate identity ``owner`` ("" without
        TLS); WorkerOwnedError when another identity holds the id."""
        check_registration(info, load)
        written, value = await self._call(
            self._register(
                keys=[self._worker_key + info.worker_id, self._index_key],
                args=[
                    info.SerializeToString(),
                    load.SerializeToString(),
                    owner,
                    repr(time.time()),
                    self._ttl_ms,
                    info.worker_id,
                ],
            )
        )
        if not written:
            raise WorkerOwnedError(info.worker_id, _text(value))
        self.fleet.upsert(info, load, float(value), self._ttl_s)

    async def heartbeat(
        self, worker_id: str, load: common_pb2.Load, owner: str = "", leaving: bool = False
    ) -> bool:
        """Refreshes a worker for its owner; False when it is unknown and must register again,
        WorkerOwnedError when another identity registered it. A ``leaving`` worker is dropped
        from the registry at once (False): every router's next refresh drops it too."""
        check_load(load)
        known = await self._call(
            self._heartbeat(
                keys=[self._worker_key + worker_id, self._index_key],
                args=[load.SerializeToString(), self._ttl_ms, worker_id, owner, int(leaving)],
            )
        )
        if leaving and known != -1:
            logger.info("worker %s left the fleet", worker_id)
        if known == -1:
            raise WorkerOwnedError(worker_id, "another identity")
        if known:
            self.fleet.heartbeat(worker_id, load, self._ttl_s)
        else:
            self.fleet.remove(worker_id)
        return bool(known)

    async def refresh(self) -> None:
        """Copies the registry from Redis into the fleet (one round trip); drops the workers
        whose key expired."""
        taken_at = self.fleet.clock()
        flat = await self._call(self._snapshot(keys=[self._index_key], args=[self._worker_key]))
        live = sorted(zip(flat[::5], flat[1::5], flat[2::5], flat[3::5], flat[4::5], strict=True))
        listed = set()
        for raw_id, info, load, registered_at, ttl_ms in live:
            worker_id = _text(raw_id)
            listed.add(worker_id)
            entry = self.fleet.get(worker_id)
            if entry is not None and entry.updated_at > taken_at:
                continue  # this router changed it while the snapshot was read
            self._apply(worker_id, info, load, float(registered_at), ttl_ms / 1000)
        for entry in self.fleet.entries():
            if entry.worker_id not in listed and entry.updated_at <= taken_at:
                logger.warning(
                    "worker %s gone: it left, or sent no heartbeat within the TTL", entry.worker_id
                )
                self.fleet.remove(entry.worker_id)
                self._info_bytes.pop(entry.worker_id, None)

    async def run(self) -> AsyncIterator[bool]:
        """Refreshes the local view every refresh_s, yielding after each try whether Redis
        answered. Survives Redis outages; ends only when cancelled."""
        while True:
            # _call logged it, noted the failure
            with contextlib.suppress(RegistryUnavailableError):
                await self.refresh()
            yield self.available
            await asyncio.sleep(self._refresh_s)

    async def close(self) -> None:
        await self._redis.aclose()

    def _apply(
        self,
        worker_id: str,
        info_bytes: bytes,
        load_bytes: bytes,
        registered_at: float,
        expires_in_s: float,
    ) -> None:
        entry = self.fleet.get(worker_id)
        if entry is not None and self._info_bytes.get(worker_id) == info_bytes:
            info = entry.info
        else:
            info = common_pb2.WorkerInfo.FromString(info_bytes)
            self._info_bytes[worker_id] = info_bytes
        self.fleet.upsert(info, common_pb2.Load.FromString(load_bytes), registered_at, expires_in_s)

    async def _call(self, awaitable: Awaitable[T]) -> T:
        """Awaits a Redis call, turning a failure into RegistryUnavailableError and noting
        when Redis is back."""
        try:
            result = await awaitable
        except _UNREACHABLE as e:
            message = (
                f"the worker registry (Redis at {self._where}) is unreachable: {type(e).__name__}"
            )
            if self._failure is None:
                logger.error("%s; answering UNAVAILABLE until it is back", message)
            self._failure = message
            raise RegistryUnavailableError(message) from None
        if self._failure is not None:
            logger.info("worker registry (Redis at %s) reachable", self._where)
            self._failure = None
        return result


def _text(value: bytes | str) -> str:
    """A Redis reply as text (a client may or may not decode replies)."""
    return value.decode() if isinstance(value, bytes) else value
