"""The router's choice to have a request's worker pull a cached prefix from a busy peer
(router_svc/kv_pull.py): a pull when the holder is full and the link makes sending the prefix
cheaper than computing it; none when the link is slow, the holder has room, or the two workers'
KV blocks differ. Worker roles: a prefill worker never decodes; a split prompt is prefilled on
the prefill worker that finishes it first (when to split: tests/router_svc/test_phases.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    slow: Sequence[str] = (),
    bytes_per_token: int = 0,
    zones: Mapping[str, str] = MappingProxyType({}),
    decoding: Mapping[str, int] = MappingProxyType({}),
) -> Fleet:
    """Workers (name, role) prefilling 10,000 tokens/s (``slow`` ones: 1,000) in chunks of 256
    tokens beside decodes, with DeepSeek-V3's KV size (the first: ``bytes_per_token`` when set),
    in their ``zones`` (else the unnamed one), with ``decoding`` streams running."""
    workers = [info(name, max_parallel=2) for name, _ in roles]
    for worker, (name, role) in zip(workers, roles, strict=True):
        worker.capabilities.zone = zones.get(name, "")
        worker.capabilities.prefill_tokens_per_second = 1_000.0 if name in slow else 10_000.0
        worker.capabilities.prefill_chunk_tokens = 256
        worker.capabilities.kv_transfer_bytes_per_token = V3_BYTES_PER_TOKEN
        worker.capabilities.role = role
    workers[0].capabilities.kv_transfer_bytes_per_token = bytes_per_token or V3_BYTES_PER_TOKEN
    return fleet_of(*workers, running=decoding)


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


def test_a_split_prompt_is_prefilled_on_the_prefill_worker_that_finishes_first():
    """D (slow to prefill, one stream decoding: each of its 256-token chunks would stall it
    0.266 s) has the prompt prefilled on the P that delivers its blocks first."""
    fleet = _roles_fleet(
        ("p1", "prefill"),
        ("p2", "prefill"),
        ("d", "decode"),
        ("b", "both"),
        slow=("p2", "d"),
        decoding={"b": 2, "d": 1},  # b full: D is chosen among the free
    )
    hashes = chain(list(range(16 * 50)))  # 800 tokens: 0.08 s on p1, 0.8 s on p2 and on D
    decision = Chooser(RoutingSection(link_gbps=100)).choose(
        fleet, with_hashes(hashes), free_only=True
    )
    assert decision.workers[0].worker_id == "d"
    pull = decision.pull
    assert pull is not None and pull.compute and pull.holder.worker_id == "p1"
    assert pull.prefix_hashes == hashes
    assert pull.prefill_s == pytest.approx(0.08) and decision.prefill_s == 0
    assert decision.reasons["pull_compute"] is True
    proto = pull.proto()
    assert proto.compute and proto.worker_id == "p1"
    assert proto.timeout_ms == round(PREFILL_MIN_TIMEOUT_S * 1000)  # 2 x 0.087 s is less
    # a prefill already queued on p1 past p2's whole prefill: p2 is sooner (0.8 s, sooner than
    # D's own 0.8 s of prefill and the 4 decode steps its chunks share, 0.84 s)
    p1 = fleet.get("p1")
    assert p1 is not None
    fleet.queued_prefill(p1, 2.0)
    later = Chooser(RoutingSection()).choose(fleet, with_hashes(hashes), free_only=True)
    assert later.pull is not None and later.pull.holder.worker_id == "p2"
    # a long prompt: twice the estimate (p1's queue and prefill, then the transfer)
    long = chain(list(range(16 * 500)))  # 8,000 tokens: 2 + 0.8 s on p1, 8 s on p2
    routing = RoutingSection(link_gbps=100)
    long_pull = Chooser(routing).choose(fleet, with_hashes(long), free_only=True).pull
    assert long_pull is not None and long_pull.holder.worker_id == "p1"
    transfer_s = 8000 * V3_BYTES_PER_TOKEN * 8 / 100e9
    assert long_pull.timeout_s == pytest.approx(2 * (2.8 + transfer_s))
    # an idle "both" worker computes its own prompt: no stream of its own to stall
    b = fleet.get("b")
    assert b is not None
    fleet.set_load(b, common_pb2.Load())
    d = fleet.get("d")
    assert d is not None
    fleet.set_load(d, common_pb2.Load(running=2))
    both = Chooser(RoutingSection()).choose(fleet, with_hashes(hashes))
    assert both.workers[0].worker_id == "b" and both.pull is None
    assert both.phases.term == "idle"
    # no prefill worker of its KV size: D computes
    unlike = _roles_fleet(
        ("d", "decode"), ("p1", "prefill"), bytes_per_token=1234, slow=("d",), decoding={"d": 1}
    )
    unlike_decision = Chooser(RoutingSection()).choose(unlike, with_hashes(hashes))
    assert unlike_decision.pull is None and unlike_decision.phases.term == "no_prefill_worker"


@pytest.mark.parametrize("vllm", ["prefill", "decode"])
def test_a_mixed_fleet_of_torch_and_vllm_workers_decodes_where_it_prefills_saying_why(vllm: str):
    """A vLLM worker sends and takes no KV blocks (Capabilities.kv_transfer_bytes_per_token 0):
    paired with a torch worker as P or as D, D computes the prompt itself whatever its streams
    would stall, and the decision says why (its phase term, on the route span and counter)."""
    torch_only = _roles_fleet(("d", "decode"), ("p", "prefill"), slow=("d",), decoding={"d": 1})
    workers = [common_pb2.WorkerInfo() for _ in "dp"]
    for worker, name in zip(workers, "dp", strict=True):
        entry = torch_only.get(name)
        assert entry is not None
        worker.CopyFrom(entry.info)
        if (name == "p") == (vllm == "prefill"):
            worker.capabilities.engine = "vllm"
            worker.capabilities.kv_transfer_bytes_per_token = 0
    fleet = fleet_of(*workers, running={"d": 1})
    decision = Chooser(RoutingSection()).choose(fleet, with_hashes(chain(list(range(16 * 50)))))
    assert decision.workers[0].worker_id == "d" and decision.pull is None
    assert decision.phases.plan == "aggregated"
    assert decision.phases.term == ("no_kv_engine" if vllm == "decode" else "no_prefill_worker")
    # the same fleet all torch splits: the refusal is the vLLM worker's
    split = Chooser(RoutingSection()).choose(torch_only, with_hashes(chain(list(range(16 * 50)))))
    assert split.phases.plan == "split"


def test_a_decode_worker_holding_most_of_the_prompt_computes_the_rest_itself():
    """A session's next turn: D holds its history, so its tail's chunk stalls D's stream within
    the objective and D computes it; a fresh prompt on the same D goes to P."""
    fleet = _roles_fleet(("p1", "prefill"), ("d", "decode"), slow=("d",), decoding={"d": 1})
    turn = chain(list(range(16 * 60)))  # 960 tokens, the last 80 new
    chooser = Chooser(RoutingSection(link_gbps=100), cached_on(fleet, {"d": turn[:55]}))
    decision = chooser.choose(fleet, with_hashes(turn))
    assert decision.workers[0].worker_id == "d" and decision.pull is None
    assert decision.phases.term == "gap"  # 80 tokens at 1,000/s and a step: 0.09 s
    fresh = chain(list(range(1, 16 * 60 + 1)))
    split = chooser.choose(fleet, with_hashes(fresh))
    assert split.pull is not None and split.pull.compute and split.phases.plan == "split"
    assert split.pull.prefill_s == pytest.approx(0.096)


def test_kv_cache_moves_over_the_link_between_the_two_workers_zones():
    """Within a zone the link is [routing] link_gbps; across two, zone_link_gbps; two zones it
    does not list have no link. P is the one that delivers the blocks first, its transfer
    included, and a busy holder's prefix is pulled only over a link fast enough."""
    zones = {"near": "rack-a", "far": "rack-b", "d": "rack-a"}
    fleet = _roles_fleet(
        ("near", "prefill"),
        ("far", "prefill"),
        ("d", "decode"),
        slow=("near", "d"),
        zones=zones,
        decoding={"d": 1},
    )
    # 8,000 tokens: 8 s on near (8.32 s on D, its 32 chunks sharing decode steps), 0.8 s on far
    hashes = chain(list(range(16 * 500)))
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
    # the split by the rule that always splits: which P is what this test is about
    chooser = Chooser(RoutingSection(link_gbps=100, phase_split="always"))
    first = chooser.choose(fleet, with_hashes(long)).pull
    assert first is not None and first.holder.worker_id == "p1"
    # p1 -> d measured at 0.5 Gb/s: 0.8 + 9 s, later than p2's 8 + 0.05 s
    _measured(fleet, "d", p1=0.5)
    measured = chooser.choose(fleet, with_hashes(long)).pull
    assert measured is not None and measured.holder.worker_id == "p2"
    transfer_s = 8000 * V3_BYTES_PER_TOKEN * 8 / 100e9
    assert measured.timeout_s == pytest.approx(2 * (8 + transfer_s))
