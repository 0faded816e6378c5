"""Routing by the workers' cache events, with a real router and real simulated workers on
loopback: a cached prefix wins over the prompt's byte-window home, an eviction moves the next
request, a restarted router and a restarted worker are resynced from snapshots, the events come
over mutual TLS."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from prometheus_client import REGISTRY

from devtools.certs import role_tls, write_certs
from infermesh.pb import common_pb2
from infermesh.ports import free_port
from infermesh.prefix_hash import BLOCK_TOKENS, chain
from infermesh.sim_tokens import prompt_text, sim_token_ids
from router_svc.config import RoutingSection
from router_svc.routing import Chooser, RouteRequest
from tests.helpers import MODEL
from tests.helpers.inprocess import (
    RunningRouter,
    RunningWorker,
    eventually,
    gateway_route,
    running_router,
    running_worker,
    sim_engine,
)
from tests.helpers.worker_client import worker_client

# kv bytes a token that leave an H100 2,048 tokens (128 blocks) of cache
SMALL_CACHE_KV_BYTES = 64_000_000_000 // 2048


def text(tag: str, tokens: int) -> str:
    """A prompt of exactly ``tokens`` simulated tokens, distinct per tag."""
    return (tag * (4 * tokens))[: 4 * tokens]


def hashes_of(prompt: str) -> list[int]:
    return chain(sim_token_ids(prompt_text(None, prompt)))


def request(prompt: str, with_hashes: bool = True) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        model=MODEL,
        prompt=prompt,
        prefix_hashes=hashes_of(prompt) if with_hashes else [],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=2),
    )


def worker_sim(**engine):
    return sim_engine("H100", zero_latency=True, gpu_count=1, **engine)


async def serve_on(worker: RunningWorker, prompt: str) -> None:
    """Serves ``prompt`` on that worker directly (the router does not see it), which caches it."""
    async with worker_client() as client:
        await client.complete(worker.servicer.info.address, request(prompt, with_hashes=False))


async def routed_to(router: RunningRouter, prompt: str, with_hashes: bool = True) -> str:
    """The worker the router routes ``prompt`` to on the gateway's path (which then caches
    it)."""
    return (await gateway_route(router, request(prompt, with_hashes))).worker_id


def indexed_blocks(router: RunningRouter, worker: RunningWorker, prompt: str) -> int:
    """How many leading blocks of ``prompt`` the router's index has on that worker."""
    entry = router.resources.registry.fleet.get(worker.servicer.info.worker_id)
    if entry is None:
        return 0
    fleet = router.resources.registry.fleet
    blocks = router.resources.index.cached_blocks(
        hashes_of(prompt), 1 << entry.slot, fleet.slot_count
    )
    return 0 if blocks is None else int(blocks[entry.slot])


def saved(worker_id: str) -> float:
    value = REGISTRY.get_sample_value(
        "infermesh_router_prefix_tokens_saved_total", {"worker": worker_id}
    )
    return value or 0.0


def prompt_homed_on(router: RunningRouter, worker_id: str, blocks: int) -> str:
    """A prompt whose leading bytes' home (the routing without prefix hashes) is ``worker_id``."""
    fleet, config = router.resources.registry.fleet, RoutingSection()
    for tag in "abcdefghijklmnopqrstuvwxyz":
        prompt = text(tag, blocks * BLOCK_TOKENS)
        routed = RouteRequest.of(request(prompt, with_hashes=False), config.prefix_bytes)
        decision = Chooser(config).choose(fleet, routed)
        if decision.reasons["prefix_home"] is True and decision.workers[0].worker_id == worker_id:
            return prompt
    raise AssertionError(f"no prompt's byte-window home is {worker_id}")


async def test_a_prefix_cached_on_b_goes_to_b_though_its_leading_bytes_hash_to_a(redis_server):
    async with (
        running_router(redis_url=redis_server.url) as router,
        running_worker(worker_sim(), router, "a") as a,
        running_worker(worker_sim(), router, "b") as b,
    ):
        # 24k tokens: 0.2 s of prefill on the simulated H100, which its cache saves
        prompt = prompt_homed_on(router, "a", blocks=1536)
        await serve_on(b, prompt)
        await eventually(lambda: indexed_blocks(router, b, prompt) == 1536)
        assert indexed_blocks(router, a, prompt) == 0
        gauge = REGISTRY.get_sample_value("infermesh_router_index_blocks", {"worker": "b"})
        assert gauge == 1536
        before = saved("b")
        assert await routed_to(router, prompt) == "b"
        assert saved("b") - before == 1536 * BLOCK_TOKENS
        # all of it cached: nothing for b to prefill, its queue stays empty
        fleet, b_entry = router.resources.registry.fleet, router.resources.registry.fleet.get("b")
        assert b_entry is not None and fleet.prefill_until[b_entry.slot] == 0
        # a prompt that goes on from the cached prefix goes there too, and queues its 300
        # uncached tokens' prefill there
        assert await routed_to(router, prompt + text("z", 300)) == "b"
        assert fleet.prefill_until[b_entry.slot] > 0
        # asked without hashes (a gateway that could not tokenize it, an internal caller's
        # text): the router hashes it, and its cached prefix wins over its bytes' home
        assert await routed_to(router, prompt, with_hashes=False) == "b"
        reply = await router.stub.Complete(request(prompt, with_hashes=False))
        assert reply.route.worker_id == "b" and reply.usage.cached_prompt_tokens > 0


async def test_an_eviction_moves_the_next_request(redis_server):
    async with (
        running_router(redis_url=redis_server.url) as router,
        running_worker(worker_sim(), router, "a") as a,
        running_worker(worker_sim(kv_bytes_per_token=SMALL_CACHE_KV_BYTES), router, "b") as b,
    ):
        prompt = text("p", 64 * BLOCK_TOKENS)
        await serve_on(a, prompt[: 4 * 16 * BLOCK_TOKENS])  # its first 16 blocks on a
        await serve_on(b, prompt)  # all 64 on b
        await eventually(
            lambda: (
                (indexed_blocks(router, a, prompt), indexed_blocks(router, b, prompt)) == (16, 64)
            )
        )
        assert await routed_to(router, prompt) == "b"
        # 125 blocks of another prompt: b's 128-block cache evicts the oldest, the prompt's first
        await serve_on(b, text("q", 125 * BLOCK_TOKENS))
        await eventually(lambda: indexed_blocks(router, b, prompt) == 0)
        assert await routed_to(router, prompt) == "a"


@contextlib.asynccontextmanager
async def load_on(workers: list[RunningWorker], blocks: int) -> AsyncIterator[list[str]]:
    """Prompts of ``blocks`` blocks served on the workers directly, one after another, while the
    context runs; yields those served so far (the i-th cached on workers[i % len(workers)])."""
    served: list[str] = []

    async def keep_serving() -> None:
        for i in range(100_000):
            prompt = text(f"{i:05d}", blocks * BLOCK_TOKENS)
            await serve_on(workers[i % len(workers)], prompt)
            served.append(prompt)
            await asyncio.sleep(0.02)

    task = asyncio.create_task(keep_serving())
    try:
        yield served
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_router_restarted_under_load_rebuilds_its_index_and_routes_to_the_cache(
    redis_server,
):
    port = free_port()
    # the load's streams show in the workers' load reports: a cached 4k tokens (33 ms of prefill
    # on the simulated H100) weighs more than one stream when a second of prefill weighs 10
    routing = RoutingSection(prefill_weight=10)
    blocks = 256
    async with contextlib.AsyncExitStack() as first_router:
        router = await first_router.enter_async_context(
            running_router(redis_url=redis_server.url, port=port, routing=routing)
        )
        async with (
            running_worker(worker_sim(), router, "a") as a,
            running_worker(worker_sim(), router, "b") as b,
            load_on([a, b], blocks) as served,
        ):
            prompt = text("r", blocks * BLOCK_TOKENS)
            await serve_on(b, prompt)
            await eventually(lambda: indexed_blocks(router, b, prompt) == blocks)
            await first_router.aclose()  # the first router stops; its index goes with it
            async with running_router(
                redis_url=redis_server.url, port=port, routing=routing
            ) as restarted:
                # from b's snapshot
                await eventually(lambda: indexed_blocks(restarted, b, prompt) == blocks)
                assert await routed_to(restarted, prompt) == "b"
                # and from the events since: what the load served next goes where it is cached
                count = len(served)
                await eventually(lambda: len(served) >= count + 4)
                for i in range(count, count + 4):
                    worker = (a, b)[i % 2]
                    await eventually(
                        lambda i=i, worker=worker: (
                            indexed_blocks(restarted, worker, served[i]) == blocks
                        )
                    )
                    assert await routed_to(restarted, served[i]) == "ab"[i % 2]


def resyncs(worker_id: str, reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "infermesh_router_cache_resyncs_total", {"worker": worker_id, "reason": reason}
    )
    return value or 0.0


async def test_a_restarted_worker_s_new_epoch_replaces_what_the_router_held_for_it(redis_server):
    port = free_port()
    prompt = text("e", 64 * BLOCK_TOKENS)
    async with running_router(ttl_s=1.0, redis_url=redis_server.url) as router:
        async with running_worker(worker_sim(), router, "b", port=port) as b:
            await serve_on(b, prompt)
            await eventually(lambda: indexed_blocks(router, b, prompt) == 64)
            before = resyncs("b", "epoch")
        # the same worker at the same address, started again: an empty cache, a new epoch
        async with running_worker(worker_sim(), router, "b", port=port) as b:
            await eventually(lambda: resyncs("b", "epoch") == before + 1)
            assert indexed_blocks(router, b, prompt) == 0
            later = text("f", 32 * BLOCK_TOKENS)
            await serve_on(b, later)
            await eventually(lambda: indexed_blocks(router, b, later) == 32)
        # gone past its TTL, it leaves the fleet: nothing of it stays in the index
        await eventually(lambda: router.resources.registry.fleet.get("b") is None)
        assert len(router.resources.index) == 0 and router.resources.index.slots() == []


async def test_the_router_follows_cache_events_over_its_tls_worker_channels(redis_server, tmp_path):
    write_certs(tmp_path)
    async with (
        running_router(redis_url=redis_server.url, certs=tmp_path) as router,
        running_worker(worker_sim(), router, "b", certs=tmp_path) as b,
    ):
        prompt = text("t", 64 * BLOCK_TOKENS)
        # the gateway's certificate serves it on the worker; the router only hears of it
        async with worker_client(role_tls(tmp_path, "gateway")) as client:
            await client.complete(b.servicer.info.address, request(prompt, with_hashes=False))
        await eventually(lambda: indexed_blocks(router, b, prompt) == 64)
