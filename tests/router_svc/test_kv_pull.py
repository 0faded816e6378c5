"""The router's choice to have a request's worker pull a cached prefix from a busy peer
(router_svc/kv_pull.py): a pull when the holder is full and the link makes sending the prefix
cheaper than computing it; none when the link is slow, the holder has room, or the two workers'
KV blocks differ. Worker roles: a prefill worker never decodes; a decode worker has its prompt
prefilled on the prefill worker that finishes it first."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import grpc
import pytest

from infermesh.pb import common_pb2
from infermesh.prefix_hash import BLOCK_TOKENS, chain
from router_svc.config import RoutingSection
from router_svc.fleet import Fleet
from router_svc.kv_pull import PREFILL_MIN_TIMEOUT_S
from router_svc.routing import Chooser, RouteError
from tests.helpers.fleet import info
from tests.router_svc.test_routing import cached_on, fleet_of, route, with_hashes

# DeepSeek-V3's latent cache in BF16: 61 layers x 576 values x 2 bytes
V3_BYTES_PER_TOKEN = 61 * 576 * 2


def _fleet(bytes_per_token: int = V3_BYTES_PER_TOKEN, zones: tuple[str, str] = ("", "")) -> Fleet:
    workers = [info(name, max_parallel=2) for name in ("holder", "other")]
    for worker, zone in zip(workers, zones, strict=True):
        worker.capabilities.prefill_tokens_per_second = 10_000.0
        worker.capabilities.kv_transfer_bytes_per_token = V3_BYTES_PER_TOKEN
        worker.capabilities.zone = zone
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


def _roles_fleet(
    *roles: tuple[str, str],
    slow: str = "",
    bytes_per_token: int = 0,
    zones: Mapping[str, str] = MappingProxyType({}),
) -> Fleet:
    """Workers (name, role) prefilling 10,000 tokens/s (``slow``: 1,000) with DeepSeek-V3's KV
    size (the first: ``bytes_per_token`` when set), in their ``zones`` (else the unnamed one)."""
    workers = [info(name, max_parallel=2) for name, _ in roles]
    for worker, (name, role) in zip(workers, roles, strict=True):
        worker.capabilities.zone = zones.get(name, "")
        worker.capabilities.prefill_tokens_per_second = 1_000.0 if name == slow else 10_000.0
        worker.capabilities.kv_transfer_bytes_per_token = V3_BYTES_PER_TOKEN
        worker.capabilities.role = role
    workers[0].capabilities.kv_transfer_bytes_per_token = bytes_per_token or V3_BYTES_PER_TOKEN
    return fleet_of(*workers)


def test_a_prefill_worker_is_never_a_requests_worker():
    # idle prefill workers beside a decode worker with one free slot and a "both" one full
    fleet = _roles_fleet(("p1", "prefill"), ("p2", "prefill"), ("d", "decode"), ("b", "both"))
    b = fleet.get("b")
    assert b is not None
    fleet.set_load(b, common_pb2.Load(running=2))
    hashes = chain(list(range(16 * 50)))
    chooser = Chooser(RoutingSection(), cached_on(fleet, {"p1": hashes}))
    for i in range(20):
        for request in (with_hashes(hashes, prompt=f"{i}"), route(prompt=f"{i}")):
            decision = chooser.choose(fleet, request)
            assert {w.worker_id for w in decision.workers} <= {"d", "b"}
    # a fleet of prefill workers only decodes nothing
    only_prefill = _roles_fleet(("p1", "prefill"))
    with pytest.raises(RouteError) as error:
        Chooser(RoutingSection()).choose(only_prefill, with_hashes(hashes))
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert "prefill worker" in str(error.value)


def test_a_decode_worker_has_the_prompt_prefilled_on_the_prefill_worker_that_finishes_first():
    fleet = _roles_fleet(
        ("p1", "prefill"), ("p2", "prefill"), ("d", "decode"), ("b", "both"), slow="p2"
    )
    b = fleet.get("b")
    assert b is not None
    fleet.set_load(b, common_pb2.Load(running=2))  # full: D is chosen
    hashes = chain(list(range(16 * 50)))  # 800 tokens: 0.08 s on p1, 0.8 s on p2
    decision = Chooser(RoutingSection(link_gbps=100)).choose(fleet, with_hashes(hashes))
    assert decision.workers[0].worker_id == "d"
    pull = decision.pull
    assert pull is not None and pull.compute and pull.holder.worker_id == "p1"
    assert pull.prefix_hashes == hashes
    assert pull.prefill_s == pytest.approx(0.08) and decision.prefill_s == 0
    assert decision.reasons["pull_compute"] is True
    proto = pull.proto()
    assert proto.compute and proto.worker_id == "p1"
    assert proto.timeout_ms == round(PREFILL_MIN_TIMEOUT_S * 1000)  # 2 x 0.087 s is less
    # a prefill already queued on p1 past p2's whole prefill: p2 is sooner
    p1 = fleet.get("p1")
    assert p1 is not None
    fleet.queued_prefill(p1, 2.0)
    later = Chooser(RoutingSection()).choose(fleet, with_hashes(hashes))
    assert later.pull is not None and later.pull.holder.worker_id == "p2"
    # a long prompt: twice the estimate (p1's queue and prefill, then the transfer)
    long = chain(list(range(16 * 500)))  # 8,000 tokens: 2 + 0.8 s on p1, 8 s on p2
    long_pull = Chooser(RoutingSection(link_gbps=100)).choose(fleet, with_hashes(long)).pull
    assert long_pull is not None and long_pull.holder.worker_id == "p1"
    transfer_s = 8000 * V3_BYTES_PER_TOKEN * 8 / 100e9
    assert long_pull.timeout_s == pytest.approx(2 * (2.8 + transfer_s))
    # a "both" worker computes its own prompt; no prefill worker of its KV size: D computes
    fleet.set_load(b, common_pb2.Load())
    d = fleet.get("d")
    assert d is not None
    fleet.set_load(d, common_pb2.Load(running=2))
    both = Chooser(RoutingSection()).choose(fleet, with_hashes(hashes))
    assert both.workers[0].worker_id == "b" and both.pull is None
    unlike = _roles_fleet(("p1", "prefill"), ("d", "decode"), bytes_per_token=1234)
    refused = Chooser(RoutingSection()).choose(unlike, with_hashes(hashes))
    assert refused.pull is None
    assert str(refused.reasons["prefill_here"]).startswith("no prefill worker of its KV block")


@pytest.mark.parametrize("vllm", ["prefill", "decode"])
def test_a_mixed_fleet_of_torch_and_vllm_workers_decodes_where_it_prefills_saying_why(vllm: str):
    """A vLLM worker sends and takes no KV blocks (Capabilities.kv_transfer_bytes_per_token 0):
    paired with a torch worker as P or as D, D computes the prompt itself, and the decision
    says why (infermesh.route.prefill_here on the route span)."""
    torch_only = _roles_fleet(("p", "prefill"), ("d", "decode"))
    workers = [common_pb2.WorkerInfo() for _ in "pd"]
    for worker, name in zip(workers, "pd", strict=True):
        entry = torch_only.get(name)
        assert entry is not None
        worker.CopyFrom(entry.info)
        if (name == "p") == (vllm == "prefill"):
            worker.capabilities.engine = "vllm"
            worker.capabilities.kv_transfer_bytes_per_token = 0
    fleet = fleet_of(*workers)
    decision = Chooser(RoutingSection()).choose(fleet, with_hashes(chain(list(range(16 * 50)))))
    assert decision.workers[0].worker_id == "d" and decision.pull is None
    assert decision.reasons["prefill_here"] == (
        "its engine (vllm) takes no KV blocks"
        if vllm == "decode"
        else "no prefill worker of its KV block layout (a KV engine, the same bytes per token, "
        "the same precision), in service and linked to it"
    )


def test_a_decode_worker_holding_most_of_the_prompt_computes_the_rest_itself():
    """A session's next turn: D holds its history, so a prefill worker would compute it all again
    to spare D a shorter tail; D computes the tail. When a prefill worker holds as much, it
    computes only the tail (and D keeps decoding); a fresh prompt goes to P as before."""
    fleet = _roles_fleet(("p1", "prefill"), ("p2", "prefill"), ("d", "decode"))
    turn = chain(list(range(16 * 60)))  # 960 tokens, the last 160 new
    history = turn[:50]
    d_holds = Chooser(RoutingSection(link_gbps=100), cached_on(fleet, {"d": history}))
    decision = d_holds.choose(fleet, with_hashes(turn))
    assert decision.workers[0].worker_id == "d" and decision.pull is None
    # p2 holds the history too: it computes the tail, sooner than p1 computing it all
    both_hold = Chooser(RoutingSection(link_gbps=100), cached_on(fleet, {"d": history, "p2": turn}))
    pull = both_hold.choose(fleet, with_hashes(turn)).pull
    assert pull is not None and pull.compute and pull.holder.worker_id == "p2"
    assert pull.prefill_s == pytest.approx(0.0)  # p2 caches the whole prompt
    # D holds less than it lacks: P computes the prompt
    short = Chooser(RoutingSection(link_gbps=100), cached_on(fleet, {"d": turn[:20]}))
    fresh = short.choose(fleet, with_hashes(turn)).pull
    assert fresh is not None and fresh.compute and fresh.prefill_s == pytest.approx(0.096)


def test_kv_cache_moves_over_the_link_between_the_two_workers_zones():
    """Within a zone the link is [routing] link_gbps; across two, zone_link_gbps; two zones it
    does not list have no link. P is the one that delivers the blocks first, its transfer
    included, and a busy holder's prefix is pulled only over a link fast enough."""
    zones = {"near": "rack-a", "far": "rack-b", "d": "rack-a"}
    fleet = _roles_fleet(
        ("near", "prefill"), ("far", "prefill"), ("d", "decode"), slow="near", zones=zones
    )
    hashes = chain(list(range(16 * 500)))  # 8,000 tokens: 8 s on near, 0.8 s on far
    sent_s = 8000 * V3_BYTES_PER_TOKEN * 8 / 1e9  # 4.5 s over 1 Gb/s

    def p(zone_links: dict[str, float]) -> str:
        routing = RoutingSection(link_gbps=100, zone_link_gbps=zone_links)
        pull = Chooser(routing).choose(fleet, with_hashes(hashes)).pull
        assert pull is not None and pull.compute
        return pull.holder.worker_id

    # far's 0.8 s + 4.5 s over 1 Gb/s beat near's 8 s; over 0.25 Gb/s (18 s) they do not
    assert p({"rack-b/rack-a": 1}) == "far"
    assert p({"rack-a/rack-b": 0.25}) == "near"
    # no link across the racks: only near can send D its blocks
    assert p({}) == "near"
    far = Chooser(RoutingSection(zone_link_gbps={"rack-a/rack-b": 1}))
    pull = far.choose(fleet, with_hashes(hashes)).pull
    assert pull is not None and pull.timeout_s == pytest.approx(2 * (0.8 + sent_s))
    # a peer pull from a busy holder in another zone: over the zones' link, only a fast one
    for zones_of_two, gbps, pulled in (
        (("rack-b", "other-rack"), 100, True),
        (("rack-b", "other-rack"), 1, False),
        (("rack-b", "rack-b"), 100, False),  # within one zone: link_gbps, which is 0 here
    ):
        pulls = _fleet(zones=zones_of_two)
        chooser = Chooser(
            RoutingSection(zone_link_gbps={"rack-b/other-rack": gbps}),
            cached_on(pulls, {"holder": hashes[:400]}),
        )
        holder = pulls.get("holder")
        assert holder is not None
        pulls.set_load(holder, common_pb2.Load(running=2))
        assert (chooser.choose(pulls, with_hashes(hashes)).pull is not None) is pulled


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ({"a/a": 1.0}, "zone_link_gbps.a/a: name two different zones"),
        ({"a": 1.0}, "zone_link_gbps.a: name two different zones"),
        ({"a/b": -1.0}, "zone_link_gbps.a/b: must be a number >= 0"),
        ({"a/b": "fast"}, "zone_link_gbps.a/b: must be a number >= 0"),
        ({"a/b": 1.0, "b/a": 2.0}, "the link is given twice"),
    ],
)
def test_a_zone_link_is_two_different_zones_and_a_speed(links: dict[str, float], message: str):
    with pytest.raises(ValueError, match=message):
        RoutingSection(zone_link_gbps=links)
    section = RoutingSection(link_gbps=40, zone_link_gbps={"a/b": 10})
    assert section.link_between("b", "a") == section.link_between("a", "b") == 10
    assert section.link_between("a", "a") == 40 and section.link_between("a", "c") == 0


def _measured(fleet: Fleet, worker: str, **links_gbps: float) -> None:
    """``worker``'s heartbeat reporting the links from its peers as it measured them."""
    entry = fleet.get(worker)
    assert entry is not None
    links = [common_pb2.PeerLink(worker_id=p, gbps=g) for p, g in links_gbps.items()]
    fleet.set_load(entry, common_pb2.Load(running=entry.load.running, links=links))


def test_a_pair_measured_slow_is_priced_as_measured_and_one_unmeasured_as_configured():
    hashes = chain(list(range(16 * 500)))
    fleet = _fleet()
    # configured 100 Gb/s: 0.036 s to send what computing takes 0.64 s: pulled
    assert _decide(fleet, 100, hashes, holder_running=2).pull is not None
    # "other" measured its pulls from "holder" at 1 Gb/s: 3.6 s, more than computing
    _measured(fleet, "other", holder=1.0)
    assert fleet.measured_links() == [("holder", "other", 1.0)]
    slow = _decide(fleet, 100, hashes, holder_running=2)
    assert slow.workers[0].worker_id == "other" and slow.pull is None
    # a measurement of another pair (from a worker not in the fleet) leaves this one configured
    _measured(fleet, "other", elsewhere=1.0)
    assert fleet.measured_links() == []
    assert _decide(fleet, 100, hashes, holder_running=2).pull is not None
    # measured faster than configured: pulled over a configured 1 Gb/s link
    _measured(fleet, "other", holder=100.0)
    assert _decide(fleet, 1, hashes, holder_running=2).pull is not None
    # no configured link: no pull, whatever was measured
    assert _decide(fleet, 0, hashes, holder_running=2).pull is None
    # the measurements go with the worker that made them
    fleet.remove("other")
    assert fleet.measured_links() == []


def test_a_prefill_worker_measured_slow_loses_to_one_priced_by_config():
    fleet = _roles_fleet(("p1", "prefill"), ("p2", "prefill"), ("d", "decode"), slow="p2")
    d = fleet.get("d")
    assert d is not None
    long = chain(list(range(16 * 500)))  # 8,000 tokens: 0.8 s on p1, 8 s on p2
    chooser = Chooser(RoutingSection(link_gbps=100))
    first = chooser.choose(fleet, with_hashes(long)).pull
    assert first is not None and first.holder.worker_id == "p1"
    # p1 -> d measured at 0.5 Gb/s: 0.8 + 9 s, later than p2's 8 + 0.05 s
    _measured(fleet, "d", p1=0.5)
    measured = chooser.choose(fleet, with_hashes(long)).pull
    assert measured is not None and measured.holder.worker_id == "p2"
    transfer_s = 8000 * V3_BYTES_PER_TOKEN * 8 / 100e9
    assert measured.timeout_s == pytest.approx(2 * (8 + transfer_s))
