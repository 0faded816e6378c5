"""The router's choice to have a request's worker pull a cached prefix from a busy peer
(router_svc/kv_pull.py): a pull when the holder is full and the link makes sending the prefix
cheaper than computing it; none when the link is slow, the holder has room, or the two workers'
KV blocks differ."""

from __future__ import annotations

from infermesh.pb import common_pb2
from infermesh.prefix_hash import BLOCK_TOKENS, chain
from router_svc.config import RoutingSection
from router_svc.fleet import Fleet
from router_svc.routing import Chooser
from tests.helpers.fleet import info
from tests.router_svc.test_routing import cached_on, fleet_of, with_hashes

# DeepSeek-V3's latent cache in BF16: 61 layers x 576 values x 2 bytes
V3_BYTES_PER_TOKEN = 61 * 576 * 2


def _fleet(bytes_per_token: int = V3_BYTES_PER_TOKEN) -> Fleet:
    workers = [info(name, max_parallel=2) for name in ("holder", "other")]
    for worker in workers:
        worker.capabilities.prefill_tokens_per_second = 10_000.0
        worker.capabilities.kv_transfer_bytes_per_token = V3_BYTES_PER_TOKEN
    workers[1].capabilities.kv_transfer_bytes_per_token = bytes_per_token
    return fleet_of(*workers)


def _decide(fleet: Fleet, link_gbps: float, hashes: list[int], holder_running: int):
    chooser = Chooser(
        RoutingSection(link_gbps=link_gbps), cached_on(fleet, {"holder": hashes[:400]})
    )
    holder = fleet.get("holder")
    assert holder is not None
    fleet.set_load(holder, common_pb2.Load(running=holder_running))
    return chooser.choose(fleet, with_hashes(hashes))


def test_a_full_holder_has_its_prefix_pulled_when_the_link_beats_the_prefill():
    hashes = chain(list(range(16 * 500)))
    # 6,400 tokens cached: 0.64 s of prefill against the holder's next step (0.01 s at 100
    # tokens/s) and 0.45 GB over 100 Gb/s (0.036 s)
    decision = _decide(_fleet(), 100, hashes, holder_running=2)
    assert decision.workers[0].worker_id == "other"
    assert decision.pull is not None and decision.pull.holder.worker_id == "holder"
    assert decision.pull.prefix_hashes == hashes[:400]
    assert decision.reasons["pull_from"] == "holder" and decision.reasons["pull_blocks"] == 400
    pull = decision.pull.proto()
    assert pull.address == decision.pull.holder.info.address
    assert pull.timeout_ms == round(400 * BLOCK_TOKENS / 10_000 * 1000)  # the prefill it saves


def test_no_pull_over_a_slow_link_from_a_holder_with_room_or_between_unlike_caches():
    hashes = chain(list(range(16 * 500)))
    # 1 Gb/s: 3.6 s to send what computing takes 0.64 s
    slow = _decide(_fleet(), 1, hashes, holder_running=2)
    assert slow.workers[0].worker_id == "other" and slow.pull is None
    # off by default
    assert _decide(_fleet(), 0, hashes, holder_running=2).pull is None
    # the holder has a free slot: whichever the cost chose, no pull
    assert _decide(_fleet(), 100, hashes, holder_running=1).pull is None
    # another size of KV per token (another model or precision): its blocks are no use
    assert _decide(_fleet(bytes_per_token=1234), 100, hashes, holder_running=2).pull is None
    # 4 blocks: their 6.4 ms of prefill are done before the holder's next step (10 ms at 100
    # tokens/s) could send them
    assert _decide(_fleet(), 100, hashes[:4], holder_running=2).pull is None
