"""The shared registry on a real Redis: two routers' registries see one fleet."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from devtools.redis_server import RedisServer
from infermesh.pb import common_pb2
from infermesh.redis_client import redis_client
from router_svc.config import RedisSection, RegistrySection
from router_svc.fleet import Fleet
from router_svc.registry import (
    RegistrationError,
    Registry,
    RegistryUnavailableError,
    WorkerOwnedError,
)
from tests.helpers.fleet import info


def registry(url: str, ttl_s: float = 3.0) -> Registry:
    return Registry(
        RedisSection(url=url, timeout_s=0.3),
        RegistrySection(heartbeat_interval_s=0.1, ttl_s=ttl_s, refresh_s=0.05),
        Fleet(ttl_s=ttl_s),
    )


def ids(r: Registry) -> list[str]:
    return sorted(e.worker_id for e in r.fleet.entries())


async def test_two_routers_share_registrations_and_heartbeats(redis_server):
    a, b = registry(redis_server.url), registry(redis_server.url)
    try:
        await a.register(info("w1"), common_pb2.Load())
        assert ids(a) == ["w1"] and ids(b) == []  # b has not refreshed yet
        await b.refresh()
        assert ids(b) == ["w1"]
        assert await b.heartbeat("w1", common_pb2.Load(running=3, kv_cache_usage=0.5))
        await a.refresh()
        entry = a.fleet.get("w1")
        assert entry.load.running == 3 and a.fleet.busy[entry.slot] == 3
        assert a.fleet.kv_usage[entry.slot] == 0.5
    finally:
        await a.close()
        await b.close()


async def test_worker_is_gone_soon_after_its_heartbeats_stop(redis_server):
    a, b = registry(redis_server.url, ttl_s=0.4), registry(redis_server.url, ttl_s=0.4)
    try:
        await a.register(info("w1"), common_pb2.Load())
        await a.register(info("w2"), common_pb2.Load())
        # w1 keeps heartbeating through router b, w2 falls silent until b sees it gone
        deadline = time.monotonic() + 5
        while True:
            await asyncio.sleep(0.1)  # the heartbeat cadence, well inside the 400 ms life
            assert await b.heartbeat("w1", common_pb2.Load())
            await b.refresh()
            if ids(b) == ["w1"]:
                break
            assert time.monotonic() < deadline, ids(b)
        await a.refresh()
        await b.refresh()
        assert ids(a) == ids(b) == ["w1"]
        assert not await a.heartbeat("w2", common_pb2.Load()), (
            "an expired worker must register again"
        )
    finally:
        await a.close()
        await b.close()


async def test_a_leaving_worker_is_dropped_at_once_by_every_router(redis_server):
    a, b = registry(redis_server.url), registry(redis_server.url)  # a TTL of 3 s
    try:
        await a.register(info("w1"), common_pb2.Load(), owner="spiffe://infermesh/worker/w1")
        await a.register(info("w2"), common_pb2.Load())
        await b.refresh()
        with pytest.raises(WorkerOwnedError):  # only its owner may take it out
            await b.heartbeat(
                "w1", common_pb2.Load(), owner="spiffe://infermesh/worker/x", leaving=True
            )
        assert ids(a) == ids(b) == ["w1", "w2"]
        assert not await b.heartbeat(
            "w1", common_pb2.Load(), owner="spiffe://infermesh/worker/w1", leaving=True
        )
        assert ids(b) == ["w2"]  # the router it told: at once
        await a.refresh()
        assert ids(a) == ["w2"]  # every other: at its next refresh, long before the TTL
        assert not await a.heartbeat("w1", common_pb2.Load(), owner="spiffe://infermesh/worker/w1")
    finally:
        await a.close()
        await b.close()


async def test_registering_twice_keeps_one_entry_and_the_first_time(redis_server):
    a = registry(redis_server.url)
    try:
        await a.register(info("w1"), common_pb2.Load())
        first = a.fleet.get("w1").registered_at
        moved = info("w1")
        moved.address = "127.0.0.1:9"
        await a.register(moved, common_pb2.Load(running=2))
        await a.refresh()
        assert ids(a) == ["w1"]
        entry = a.fleet.get("w1")
        assert entry.info.address == "127.0.0.1:9" and entry.load.running == 2
        assert entry.registered_at == first
    finally:
        await a.close()


def _links(*links: tuple[str, float]) -> common_pb2.Load:
    return common_pb2.Load(links=[common_pb2.PeerLink(worker_id=p, gbps=g) for p, g in links])


@pytest.mark.parametrize(
    "worker, load, message",
    [
        (
            common_pb2.WorkerInfo(address="h:1", models=["m"]),
            common_pb2.Load(),
            "worker_id is empty",
        ),
        (
            common_pb2.WorkerInfo(worker_id="w", address="nohost", models=["m"]),
            common_pb2.Load(),
            "is not host:port",
        ),
        (
            common_pb2.WorkerInfo(worker_id="w", address="h:1"),
            common_pb2.Load(),
            "at least one model",
        ),
        (info("w"), common_pb2.Load(kv_cache_usage=math.nan), "kv_cache_usage"),
        (info("w"), common_pb2.Load(kv_cache_usage=3), "above 1"),
        (info("w"), common_pb2.Load(tokens_per_second=-1), "tokens_per_second"),
        (info("w", speed=math.inf), common_pb2.Load(), "decode_tokens_per_second"),
        (info("w"), _links(("p", math.inf)), "not a peer's id with a finite positive rate"),
        (info("w"), _links(("", 1.0)), "not a peer's id"),
        (info("w"), _links(*[(f"p{i}", 1.0) for i in range(33)]), "33 peers, more than the 32"),
    ],
)
async def test_nonsense_registration_is_refused(redis_server, worker, load, message):
    a = registry(redis_server.url)
    try:
        with pytest.raises(RegistrationError, match=message):
            await a.register(worker, load)
        await a.register(info("ok"), common_pb2.Load())
        with pytest.raises(RegistrationError, match="kv_cache_usage"):
            await a.heartbeat("ok", common_pb2.Load(kv_cache_usage=-0.5))
        assert ids(a) == ["ok"] and a.fleet.get("ok").load == common_pb2.Load()
    finally:
        await a.close()


async def test_redis_outage_is_reported_and_recovered_from(tmp_path):
    server = RedisServer(workdir=tmp_path).start()
    a = registry(server.url)
    try:
        await a.register(info("w1"), common_pb2.Load())
        server.stop()
        with pytest.raises(RegistryUnavailableError, match=f"Redis at 127.0.0.1:{server.port}/0"):
            await a.refresh()
        assert not a.available
        with pytest.raises(RegistryUnavailableError):
            a.check_available()
        with pytest.raises(RegistryUnavailableError):
            await a.register(info("w2"), common_pb2.Load())
        server.start()  # same port, empty: workers register again on their next heartbeat
        await a.refresh()
        assert a.available and ids(a) == []
        assert not await a.heartbeat("w1", common_pb2.Load())
        await a.register(info("w1"), common_pb2.Load())
        assert ids(a) == ["w1"]
    finally:
        await a.close()
        server.stop()


async def test_meshes_sharing_a_redis_keep_apart_by_key_prefix(redis_server):
    a = Registry(
        RedisSection(url=redis_server.url, key_prefix="mesh-a:"), RegistrySection(), Fleet(ttl_s=3)
    )
    b = Registry(
        RedisSection(url=redis_server.url, key_prefix="mesh-b:"), RegistrySection(), Fleet(ttl_s=3)
    )
    try:
        await a.register(info("w1"), common_pb2.Load())
        await b.refresh()
        assert ids(b) == [] and not await b.heartbeat("w1", common_pb2.Load())
    finally:
        await a.close()
        await b.close()


_TAG = f"{{{RedisSection().key_prefix}}}"  # the registry's keys under the default prefix
_W1_KEY = f"{_TAG}worker:w1"
_INDEX = f"{_TAG}workers"


async def test_a_registration_racing_the_refresh_that_prunes_its_expired_key_stays(redis_server):
    """After an outage longer than the TTL, a refresh finds the worker's hash expired while the
    worker registers again: whatever the interleaving, the worker stays listed and routed."""
    a, b = registry(redis_server.url), registry(redis_server.url)
    raw = redis_client(redis_server.url, timeout_s=2)
    try:
        for delay in range(12):  # b's registration lands at a different point of a's refresh
            await a.register(info("w1"), common_pb2.Load())
            await raw.delete(_W1_KEY)  # expired; still in the index

            async def register_later(yields: int = delay) -> None:
                for _ in range(yields):
                    await asyncio.sleep(0)
                await b.register(info("w1"), common_pb2.Load())

            await asyncio.gather(a.refresh(), register_later())
            await a.refresh()
            assert ids(a) == ["w1"], f"unlisted with the registration {delay} yields late"
    finally:
        await raw.aclose()
        await a.close()
        await b.close()


async def test_a_heartbeating_worker_missing_from_the_index_is_listed_again(redis_server):
    a = registry(redis_server.url)
    raw = redis_client(redis_server.url, timeout_s=2)
    try:
        await a.register(info("w1"), common_pb2.Load())
        await raw.srem(_INDEX, "w1")  # however the index lost it, its hash lives on
        assert await a.heartbeat("w1", common_pb2.Load(running=1))
        await a.refresh()
        assert ids(a) == ["w1"] and a.fleet.get("w1").load.running == 1
    finally:
        await raw.aclose()
        await a.close()


async def test_a_worker_id_belongs_to_the_identity_that_registered_it_while_it_lives(
    redis_server,
):
    """Through either router: another identity can neither register the id again nor report
    its load; once the entry expired, the id is free again."""
    a, b = registry(redis_server.url, ttl_s=0.4), registry(redis_server.url, ttl_s=0.4)
    real, impostor = "spiffe://infermesh/worker/gpu-0", "spiffe://infermesh/worker/gpu-1"
    try:
        await a.register(info("w1"), common_pb2.Load(), real)
        moved = info("w1")
        moved.address = "127.0.0.1:50071"
        for r in (a, b):
            with pytest.raises(WorkerOwnedError, match=f"worker w1 is registered by {real}"):
                await r.register(moved, common_pb2.Load(), impostor)
            with pytest.raises(WorkerOwnedError):
                await r.heartbeat("w1", common_pb2.Load(running=9), impostor)
            assert await r.heartbeat("w1", common_pb2.Load(running=1), real)
        await b.refresh()
        assert b.fleet.get("w1").info.address == info("w1").address
        assert b.fleet.get("w1").load.running == 1
        assert not await b.heartbeat("w2", common_pb2.Load(), real)  # unknown: register first
        await asyncio.sleep(0.5)  # the entry expires
        await b.register(moved, common_pb2.Load(), impostor)
    finally:
        await a.close()
        await b.close()
