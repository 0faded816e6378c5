"""KV cache blocks between workers (Worker.KVBlocks): a worker sends the cached blocks a peer
names, and pulls the blocks of a prompt the router told it a peer holds (the open's KVPull)
rather than computing them.

Blocks are named by the mesh's chained block hashes (infermesh/prefix_hash.py), the names the
router indexes from the workers' cache events, and travel as the engine's cache tensors of their
BLOCK_TOKENS tokens, as many to a message as MESSAGE_BYTES holds. A pull is best effort: whatever
ends it (the peer gone, the stream broken, a block evicted meanwhile, its deadline: what computing
the blocks was estimated to take) leaves the blocks that came, and the engine computes the rest;
the engine also refuses any block that is not what it would have computed (its name for this
prompt, its dtype and shape). A pull with ``compute`` (prefill on P, decode on D) sends the peer
the request, which it prefills before sending the blocks: the same RPC, caller check and fallback,
its deadline covering the peer's prefill too. Each pull is a span (``infermesh.kv_pull``) and
counted in ``infermesh_worker_kv_pull*``.

Each pull of a cached prefix (not ``compute``: a peer's prefill is no part of its link) measures
the link from its peer: the bytes of the blocks after the first message (their tokens'
``kv_transfer_bytes_per_token``) over the seconds from the first message to the last (the first
waits for the peer's step under way and its copy out of the cache, no part of the link), a pull
cut by its deadline included (what came, came at the link's pace), when at least
_MIN_MEASURED_BYTES came so. ``LinkRates`` smooths them per
peer, and the heartbeats tell the routers (``Load.links``), which price the next pull from that
peer by it.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence

import grpc
from opentelemetry import trace

from infermesh.channels import WorkerChannels
from infermesh.kv_link import MAX_MEASURED_PEERS
from infermesh.pb import common_pb2, worker_pb2
from infermesh.prefix_hash import BLOCK_TOKENS
from infermesh.tls import TlsSection
from telemetry import metrics
from worker_svc.engine.api import KVBlockPeer, PeerBlock, PeerPrefix, RawTensor

logger = logging.getLogger(__name__)

_tracer = trace.get_tracer(__name__)

# One message's blocks, at most (one block bigger goes alone): well within the mesh's message
# limit (infermesh.channels), small enough that the peer decodes one while the next travels.
MESSAGE_BYTES = 8 * 2**20
# The blocks copied out of the cache at once, between two of the engine's steps.
EXPORT_BYTES = 256 * 2**20
# A pull measures its link when at least this came: a smaller one's time is mostly the peer's
# step it waits for, not the link.
_MIN_MEASURED_BYTES = 2**20
# A new measurement's weight in a peer's smoothed rate (the rest: the rate before it).
_NEW_RATE_WEIGHT = 0.5


class BlockNotHeldError(Exception):
    """A block asked for is not (or no longer) in the cache."""


async def sent_blocks(
    engine: KVBlockPeer, hashes: Sequence[int], bytes_per_token: int
) -> AsyncIterator[worker_pb2.KVBlocksResponse]:
    """The messages of Worker.KVBlocks for ``hashes``; BlockNotHeldError at the first block the
    engine does not hold, after the messages of those before it."""
    per_export = max(1, EXPORT_BYTES // (bytes_per_token * BLOCK_TOKENS))
    sent = 0
    while sent < len(hashes):
        asked = hashes[sent : sent + per_export]
        blocks = await engine.export_blocks(asked)
        for message in _messages(blocks):
            yield message
        sent += len(blocks)
        if len(blocks) < len(asked):
            raise BlockNotHeldError(
                f"block {sent} of those asked ({hashes[sent]:016x}) is not cached here "
                "(evicted, or never computed)"
            )


def _messages(blocks: Iterable[PeerBlock]) -> Iterable[worker_pb2.KVBlocksResponse]:
    message = worker_pb2.KVBlocksResponse()
    size = 0
    for block in blocks:
        block_bytes = sum(len(t.data) for t in block.tensors)
        if message.blocks and size + block_bytes > MESSAGE_BYTES:
            yield message
            message, size = worker_pb2.KVBlocksResponse(), 0
        message.blocks.add(
            prefix_hash=block.prefix_hash,
            tensors=[
                worker_pb2.KVTensor(data=t.data, dtype=t.dtype, shape=t.shape)
                for t in block.tensors
            ],
        )
        size += block_bytes
    if message.blocks:  # a simulated engine's blocks carry no bytes, and count all the same
        yield message


class LinkRates:
    """The links from the peers this worker pulled from, Gb/s, each smoothed over its pulls
    (the latest weighing _NEW_RATE_WEIGHT); the MAX_MEASURED_PEERS most recently measured."""

    def __init__(self) -> None:
        self._gbps: collections.OrderedDict[str, float] = collections.OrderedDict()

    def measured(self, peer: str, kv_bytes: int, seconds: float) -> None:
        """A pull from ``peer`` brought ``kv_bytes`` in ``seconds``."""
        if kv_bytes < _MIN_MEASURED_BYTES or seconds <= 0:
            return
        gbps = kv_bytes * 8 / seconds / 1e9
        before = self._gbps.pop(peer, None)
        if before is not None:
            gbps = _NEW_RATE_WEIGHT * gbps + (1 - _NEW_RATE_WEIGHT) * before
        self._gbps[peer] = gbps
        if len(self._gbps) > MAX_MEASURED_PEERS:
            self._gbps.popitem(last=False)

    def links(self) -> list[common_pb2.PeerLink]:
        """What the heartbeats report (``Load.links``)."""
        return [common_pb2.PeerLink(worker_id=p, gbps=g) for p, g in self._gbps.items()]


class KVPuller:
    """Pulls a prompt's blocks from peers for ``engine`` (whose blocks hold ``bytes_per_token``
    a token), calling them with the worker's own certificate (``tls``); measures the links it
    pulled over in ``rates``."""

    def __init__(
        self, engine: object, worker_id: str, bytes_per_token: int, tls: TlsSection
    ) -> None:
        self._engine = engine if isinstance(engine, KVBlockPeer) else None
        self._worker_id = worker_id
        self._bytes_per_token = bytes_per_token
        self._channels = WorkerChannels(tls)
        self.rates = LinkRates()

    async def pull(
        self, pull: common_pb2.KVPull, request: common_pb2.GenerateRequest
    ) -> PeerPrefix | None:
        """The blocks of ``pull`` this engine's cache lacks, as far as they came; None when
        none did (or none was needed). With ``pull.compute`` the peer prefills ``request``
        first."""
        if self._engine is None or not pull.address:
            return None
        wanted = self._engine.blocks_to_pull(pull.prefix_hashes)
        if not wanted:
            return None
        labels = (pull.worker_id, self._worker_id)
        blocks: list[PeerBlock] = []
        received = 0
        outcome = "OK"
        started = time.perf_counter()
        # the link's measure: the blocks after the first message, and when they came
        first_came = last_came = 0.0
        measured_blocks = 0
        with _tracer.start_as_current_span(
            "infermesh.kv_pull",
            attributes={
                "infermesh.kv_pull.from": pull.worker_id,
                "infermesh.kv_pull.to": self._worker_id,
                "infermesh.kv_pull.blocks_asked": len(wanted),
                "infermesh.kv_pull.compute": pull.compute,
            },
        ) as span:
            call = self._channels.stub(pull.address).KVBlocks(
                worker_pb2.KVBlocksRequest(
                    prefix_hashes=pull.prefix_hashes[wanted.start : wanted.stop],
                    prefill=request if pull.compute else None,
                ),
                timeout=pull.timeout_ms / 1000 if pull.timeout_ms else None,
                wait_for_ready=False,
            )
            try:
                async for message in call:
                    for block in message.blocks:
                        tensors = tuple(
                            RawTensor(t.data, t.dtype, tuple(t.shape)) for t in block.tensors
                        )
                        received += sum(len(t.data) for t in tensors)
                        blocks.append(PeerBlock(block.prefix_hash, tensors))
                    last_came = time.perf_counter()
                    if first_came:
                        measured_blocks += len(message.blocks)
                    else:
                        first_came = last_came
            except grpc.aio.AioRpcError as e:
                outcome = e.code().name
                logger.warning(
                    "pulling %d KV blocks from %s ended with %s after %d (%s): computing the rest",
                    len(wanted),
                    pull.worker_id,
                    outcome,
                    len(blocks),
                    e.details(),
                )
            seconds = time.perf_counter() - started
            span.set_attributes(
                {
                    "infermesh.kv_pull.blocks": len(blocks),
                    "infermesh.kv_pull.bytes": received,
                    "infermesh.kv_pull.outcome": outcome,
                }
            )
        metrics.KV_PULLS.labels(*labels, outcome).inc()
        metrics.KV_PULL_BYTES.labels(*labels).inc(received)
        metrics.KV_PULL_BLOCKS.labels(*labels).inc(len(blocks))
        metrics.KV_PULL_SECONDS.labels(*labels).inc(seconds)
        if not pull.compute:
            kv_bytes = measured_blocks * BLOCK_TOKENS * self._bytes_per_token
            self.rates.measured(pull.worker_id, kv_bytes, last_came - first_came)
        return PeerPrefix(wanted.start, tuple(blocks)) if blocks else None

    async def close(self) -> None:
        await self._channels.close()
