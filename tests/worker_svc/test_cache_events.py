"""Worker.CacheEvents over a real worker's gRPC stream: what a served prompt stores, what a small
cache evicts, reconnects that resume or resync, and a subscriber too slow to keep."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import grpc
import pytest

from infermesh.pb import common_pb2, worker_pb2, worker_pb2_grpc
from infermesh.prefix_hash import BLOCK_TOKENS, chain
from infermesh.sim_tokens import prompt_text, sim_token_ids
from tests.helpers import MODEL
from tests.helpers.inprocess import PLAINTEXT
from worker_svc import server as worker_server
from worker_svc.config import (
    CacheSection,
    EngineSection,
    ParallelSection,
    ServerSection,
    WorkerConfig,
)
from worker_svc.engine_api import InferenceEngine
from worker_svc.sim_engine.engine import SimEngine

# H100's 72 GB of KV room after 8 GB of FP8 weights, at this size a token: 2048 tokens, 128 blocks
_SMALL_CACHE_KV_BYTES = 64_000_000_000 // 2048


def _sim(cache: CacheSection | None = None, kv_bytes_per_token: int | None = None) -> SimEngine:
    engine = EngineSection(
        kind="sim", zero_latency=True, gpu_count=1, kv_bytes_per_token=kv_bytes_per_token
    )
    return SimEngine.from_config(
        WorkerConfig(
            parallel=ParallelSection(max_parallel=4), engine=engine, cache=cache or CacheSection()
        )
    )


@contextlib.asynccontextmanager
async def _worker(engine: InferenceEngine) -> AsyncIterator[worker_pb2_grpc.WorkerStub]:
    config = WorkerConfig(server=ServerSection(port=0), tls=PLAINTEXT)
    server, servicer = await worker_server.create_server(config, engine)
    try:
        async with grpc.aio.insecure_channel(servicer.info.address) as channel:
            yield worker_pb2_grpc.WorkerStub(channel)
    finally:
        await server.stop(grace=None)


async def _serve(stub: worker_pb2_grpc.WorkerStub, prompt: str) -> None:
    request = common_pb2.GenerateRequest(
        request_id="r",
        model=MODEL,
        prompt=prompt,
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=2),
    )
    await stub.Complete(request)


async def _next(call) -> worker_pb2.CacheEventBatch:
    batch = await asyncio.wait_for(call.read(), 10)
    assert batch is not grpc.aio.EOF, "the stream ended"
    return batch


def _sim_chain(prompt: str) -> list[int]:
    return chain(sim_token_ids(prompt_text(None, prompt)))


def _text(tag: str, tokens: int) -> str:
    """A prompt of exactly `tokens` simulated tokens, distinct per tag."""
    return (tag * (4 * tokens))[: 4 * tokens]


async def test_a_served_prompt_stores_the_chain_of_its_whole_blocks():
    engine = _sim()
    async with _worker(engine) as stub:
        call = stub.CacheEvents(worker_pb2.CacheEventsRequest())
        first = await _next(call)
        assert first.snapshot and not first.stored and first.seq == 0
        assert first.epoch == engine.cache_events.epoch != 0
        prompt = _text("a", 3 * BLOCK_TOKENS + 5)  # three whole blocks and a partial one
        await _serve(stub, prompt)
        batch = await _next(call)
        assert list(batch.stored) == _sim_chain(prompt) and len(batch.stored) == 3
        assert not batch.snapshot and not batch.removed and batch.seq == 3
        # a prompt that shares its first two blocks stores only what follows them
        longer = prompt[: 4 * 2 * BLOCK_TOKENS] + _text("b", 2 * BLOCK_TOKENS)
        await _serve(stub, longer)
        batch = await _next(call)
        assert list(batch.stored) == _sim_chain(longer)[2:] and batch.seq == 5
        call.cancel()


async def test_a_chat_prompt_is_hashed_as_its_rendered_text():
    engine = _sim()
    messages = [{"role": "system", "content": "s" * 80}, {"role": "user", "content": "hi"}]
    async with _worker(engine) as stub:
        call = stub.CacheEvents(worker_pb2.CacheEventsRequest())
        await _next(call)
        await stub.Complete(
            common_pb2.GenerateRequest(
                request_id="r",
                model=MODEL,
                messages=[common_pb2.ChatMessage(**m) for m in messages],
                sampling=common_pb2.SamplingParams(max_tokens=1),
            )
        )
        batch = await _next(call)
        assert list(batch.stored) == chain(sim_token_ids(prompt_text(messages, None)))
        call.cancel()


async def test_eviction_in_a_small_cache_publishes_removed():
    engine = _sim(kv_bytes_per_token=_SMALL_CACHE_KV_BYTES)
    assert engine.roofline.kv_capacity_tokens // BLOCK_TOKENS == 128
    prompts = [_text(tag, 60 * BLOCK_TOKENS) for tag in "xyz"]  # 60 blocks each
    async with _worker(engine) as stub:
        call = stub.CacheEvents(worker_pb2.CacheEventsRequest())
        held = set((await _next(call)).stored)
        removed: list[int] = []
        for prompt in prompts:
            await _serve(stub, prompt)
            batch = await _next(call)
            held.difference_update(batch.removed)
            held.update(batch.stored)
            removed += batch.removed
        # the third prompt's 60 blocks pushed out the first prompt's 52 least recent ones
        assert removed == _sim_chain(prompts[0])[:52]
        assert held == engine.cache_events.held() and len(held) == 128
        call.cancel()


async def test_a_reconnect_resumes_from_the_ring_else_gets_a_snapshot():
    engine = _sim(cache=CacheSection(events_history=5))
    async with _worker(engine) as stub:
        call = stub.CacheEvents(worker_pb2.CacheEventsRequest())
        await _next(call)
        first = _text("p", 3 * BLOCK_TOKENS)
        await _serve(stub, first)
        seen = await _next(call)
        call.cancel()
        # missed while away: two more prompts, 5 events, all still in the ring
        missed = [_text("q", 2 * BLOCK_TOKENS), _text("r", 3 * BLOCK_TOKENS)]
        for prompt in missed:
            await _serve(stub, prompt)
        call = stub.CacheEvents(worker_pb2.CacheEventsRequest(epoch=seen.epoch, after_seq=seen.seq))
        resumed = [await _next(call), await _next(call)]
        assert [list(b.stored) for b in resumed] == [_sim_chain(p) for p in missed]
        assert [b.seq for b in resumed] == [5, 8] and not any(b.snapshot for b in resumed)
        call.cancel()
        everything = {*_sim_chain(first), *_sim_chain(missed[0]), *_sim_chain(missed[1])}
        # the ring keeps 5 events (those after seq 3): an unknown epoch, a seq older than the
        # ring, and a seq no batch ended at each get a snapshot of everything held
        for epoch, after_seq in ((seen.epoch + 1, 8), (seen.epoch, 0), (seen.epoch, 4)):
            call = stub.CacheEvents(worker_pb2.CacheEventsRequest(epoch=epoch, after_seq=after_seq))
            snapshot = await _next(call)
            assert snapshot.snapshot and set(snapshot.stored) == everything
            assert snapshot.seq == 8
            call.cancel()
        # caught up: nothing until the next event
        call = stub.CacheEvents(worker_pb2.CacheEventsRequest(epoch=seen.epoch, after_seq=8))
        await _serve(stub, _text("s", BLOCK_TOKENS))
        batch = await _next(call)
        assert not batch.snapshot and list(batch.stored) == _sim_chain(_text("s", BLOCK_TOKENS))
        call.cancel()


async def test_a_slow_subscriber_is_dropped_not_buffered():
    engine = _sim(cache=CacheSection(events_backlog=50_000))
    events = engine.cache_events
    per_batch, batches = 4096, 1500  # 8192 events, 64 KiB a message: ~100 MB in all

    def engine_thread() -> None:  # as the torch engine's scheduler thread reports
        for i in range(batches):
            events.stored(range(i * per_batch, (i + 1) * per_batch))
            events.removed(range((i - 1) * per_batch, i * per_batch))
            events.flush()

    async with _worker(engine) as stub:
        call = stub.CacheEvents(worker_pb2.CacheEventsRequest())
        await _next(call)
        thread = threading.Thread(target=engine_thread)
        thread.start()
        await asyncio.to_thread(thread.join)  # the subscriber reads nothing meanwhile
        received = 0
        with pytest.raises(grpc.aio.AioRpcError) as error:
            while True:
                batch = await _next(call)
                received += len(batch.stored) + len(batch.removed)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "reconnect to resync" in (error.value.details() or "")
        assert received < batches * per_batch  # far from all of them was kept for it
        # the worker goes on publishing, and a new subscriber resyncs from a snapshot
        call = stub.CacheEvents(worker_pb2.CacheEventsRequest(epoch=events.epoch))
        snapshot = await _next(call)
        assert snapshot.snapshot and len(snapshot.stored) == per_batch
        call.cancel()
