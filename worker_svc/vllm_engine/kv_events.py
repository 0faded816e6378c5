"""vLLM's KV-cache events, translated into the mesh's names for the worker's CacheEvents.

vLLM publishes what its prefix cache stores and evicts over ZeroMQ (`kv_events_config`): the
worker binds a SUB socket on a free loopback port, vLLM's PUB connects to it, and a thread
decodes each batch (one per engine step; msgpack, vLLM's own structs), names the blocks by
`infermesh.prefix_hash` (vLLM's hash of a stored block maps to the names of its tokens, so its
children chain from there) and flushes them as one batch. A gap in vLLM's sequence numbers means
lost events: the worker then reports everything cleared rather than guess.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

import msgspec
import zmq
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from infermesh import prefix_hash
from worker_svc.engine.cache_events import CacheEvents

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often the thread looks whether it was stopped
_GPU_MEDIA = (None, "GPU")  # offloaded tiers (CPU, storage) are not what a request reuses


class VllmBlockNames:
    """Names vLLM's blocks as the mesh does and reports them to `events`."""

    def __init__(self, events: CacheEvents) -> None:
        self._events = events
        self._names: dict[Hashable, list[int]] = {}  # a held vLLM block's names, in order
        self._warned_block_size = False

    def apply(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        if isinstance(event, AllBlocksCleared):
            self._names.clear()
            self._events.cleared()
        elif event.medium not in _GPU_MEDIA:
            return
        elif isinstance(event, BlockStored):
            self._stored(event)
        else:
            for block in event.block_hashes:
                if (names := self._names.pop(block, None)) is not None:
                    self._events.removed(names)

    def _stored(self, event: BlockStored) -> None:
        per_block = event.block_size // prefix_hash.BLOCK_TOKENS
        if event.block_size % prefix_hash.BLOCK_TOKENS:
            if not self._warned_block_size:
                logger.warning(
                    "vLLM's block size %d is not a multiple of %d: its cache is not reported",
                    event.block_size,
                    prefix_hash.BLOCK_TOKENS,
                )
                self._warned_block_size = True
            return
        parent = prefix_hash.ROOT
        if event.parent_block_hash is not None:
            parent_names = self._names.get(event.parent_block_hash)
            if parent_names is None:  # its parent's event was lost: no name to chain from
                return
            parent = parent_names[-1]
        names = prefix_hash.chain(event.token_ids, parent)
        for i, block in enumerate(event.block_hashes):
            self._names[block] = names[i * per_block : (i + 1) * per_block]
        self._events.stored(names)


class VllmKvEvents:
    """The SUB socket and its thread; `config` is what vLLM's engine arguments take."""

    def __init__(self, events: CacheEvents) -> None:
        self._names = VllmBlockNames(events)
        self.events = events
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        port: int = self._socket.bind_to_random_port("tcp://127.0.0.1")
        # an endpoint without a wildcard: vLLM's publisher connects to it
        self.config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}"
        )
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        next_seq: int | None = None
        try:
            while not self._stopped.is_set():
                if not self._socket.poll(_POLL_MS):
                    continue
                _, seq_bytes, payload = self._socket.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if next_seq is not None and seq != next_seq:
                    logger.warning(
                        "vLLM's KV events %d to %d were lost: reporting the cache cleared",
                        next_seq,
                        seq - 1,
                    )
                    self._names.apply(AllBlocksCleared())
                next_seq = seq + 1
                for event in self._decoder.decode(payload).events:
                    self._names.apply(event)
                self.events.flush()
        except Exception:  # the engine serves on without its cache reports; say why once
            logger.exception("vLLM's KV events stopped being read")
        finally:
            self._socket.close(linger=0)
