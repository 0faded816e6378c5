"""vLLM's KV-cache events in the mesh's names: vLLM's own ZeroMQ publisher (the one its engine
runs) sends its own event structs to the worker's subscriber, which reports them to CacheEvents.
vLLM's engine itself is started once, by the e2e mesh (tests/e2e/test_vllm.py)."""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Iterator

import pytest

from infermesh.prefix_hash import chain
from tests.helpers.inprocess import eventually
from worker_svc.engine.cache_events import CacheEvents

with warnings.catch_warnings():  # torch modules vLLM imports warn of their own deprecations
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    from worker_svc.vllm_engine.kv_events import VllmKvEvents


def _stored(hashes: list[bytes], parent: bytes | None, tokens: list[int], size: int = 16):
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


@pytest.fixture
def vllm_events() -> Iterator[tuple[VllmKvEvents, ZmqEventPublisher]]:
    subscriber = VllmKvEvents(CacheEvents())
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=subscriber.config.endpoint)
    try:
        _await_subscription(subscriber, publisher)
        yield subscriber, publisher
    finally:
        publisher.shutdown()
        subscriber.close()


def _publish(publisher: ZmqEventPublisher, *events) -> None:
    publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))


def _await_subscription(subscriber: VllmKvEvents, publisher: ZmqEventPublisher) -> None:
    """ZeroMQ's PUB drops what it sends until the SUB's subscription has reached it (as vLLM's
    engine, publishing only once it serves, never meets): the empty cache's "cleared" until one
    arrives, so that the tests' events all do. A second arrives only if one took over a second."""
    deadline = time.monotonic() + 30
    while subscriber.events.seq == 0:
        assert time.monotonic() < deadline, "vLLM's publisher never reached the subscriber"
        _publish(publisher, AllBlocksCleared())
        waited = time.monotonic() + 1
        while subscriber.events.seq == 0 and time.monotonic() < waited:
            time.sleep(0.01)


async def test_stored_blocks_chain_from_their_vllm_parent(vllm_events):
    subscriber, publisher = vllm_events
    events = subscriber.events
    assert subscriber.config.endpoint.startswith("tcp://127.0.0.1:")
    tokens = list(range(1000, 1048))
    settled = events.seq
    batches = events.subscribe()
    assert (await anext(batches)).snapshot
    _publish(publisher, _stored([b"a", b"b"], None, tokens[:32]))
    first = await asyncio.wait_for(anext(batches), 10)
    assert list(first.stored) == chain(tokens[:32])
    # a later step stores the third block, named from vLLM's parent "b"
    _publish(publisher, _stored([b"c"], b"b", tokens[32:]))
    second = await asyncio.wait_for(anext(batches), 10)
    assert list(second.stored) == chain(tokens)[2:]
    # evicting "a" removes its name; a child of an unknown parent is not named at all
    _publish(publisher, BlockRemoved(block_hashes=[b"a"], medium="GPU"))
    _publish(publisher, _stored([b"x"], b"never-stored", tokens[:16]))
    third = await asyncio.wait_for(anext(batches), 10)
    assert list(third.removed) == chain(tokens)[:1] and not third.stored
    await eventually(lambda: events.seq == settled + 4)
    assert events.held() == set(chain(tokens)[1:])
    _publish(publisher, AllBlocksCleared())
    cleared = await asyncio.wait_for(anext(batches), 10)
    assert cleared.cleared and not cleared.stored and events.held() == frozenset()
    await batches.aclose()


async def test_a_vllm_block_of_64_tokens_is_four_names(vllm_events):
    subscriber, publisher = vllm_events
    tokens = list(range(128))
    _publish(publisher, _stored([b"p", b"q"], None, tokens, size=64))
    await eventually(lambda: subscriber.events.held() == set(chain(tokens)))
    _publish(publisher, BlockRemoved(block_hashes=[b"q"], medium="GPU"))
    await eventually(lambda: subscriber.events.held() == set(chain(tokens)[:4]))
    # an offloaded copy is not what a request reuses on this worker
    offloaded = _stored([b"r"], b"p", tokens[64:], size=64)
    offloaded.medium = "CPU"
    other = list(range(500, 564))
    _publish(publisher, offloaded, _stored([b"s"], None, other, size=64))
    await eventually(lambda: subscriber.events.held() == set(chain(tokens)[:4] + chain(other)))
