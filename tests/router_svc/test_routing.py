"""Worker choice on a local fleet view: filters, the three policies, affinity, ejection."""

from __future__ import annotations

import collections
import dataclasses
import os
import subprocess
import sys
from collections.abc import Mapping
from types import MappingProxyType

import grpc
import pytest

from infermesh.pb import common_pb2
from infermesh.prefix_hash import chain
from router_svc.config import RoutingSection
from router_svc.fleet import Fleet
from router_svc.prefix_index import PrefixIndex
from router_svc.routing import Chooser, RouteError, RouteRequest, prefix_key
from tests.helpers.fleet import BF16, info

FP8 = common_pb2.PRECISION_FP8
ANY = common_pb2.PRECISION_UNSPECIFIED


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet_of(
    *infos: common_pb2.WorkerInfo,
    clock: Clock | None = None,
    running: Mapping[str, int] = MappingProxyType({}),
) -> Fleet:
    """A fleet of ``infos``, each with its ``running`` sequences (by worker id; else none)."""
    fleet = Fleet(ttl_s=3, clock=clock or Clock())
    for i in infos:
        load = common_pb2.Load(running=running.get(i.worker_id, 0))
        fleet.upsert(i, load, registered_at=0, expires_in_s=3)
    return fleet


def route(model: str = "m", precision=ANY, prompt: str = "hello") -> RouteRequest:
    return RouteRequest.of(
        common_pb2.GenerateRequest(model=model, precision=precision, prompt=prompt), 256
    )


def first_choice(chooser: Chooser, fleet: Fleet, request: RouteRequest | None = None) -> str:
    return chooser.choose(fleet, request or route()).workers[0].worker_id


def test_filter_by_model_and_precision_with_clear_errors():
    fleet = fleet_of(info("a", precision=FP8), info("b"), info("c", models=["other"]))
    chooser = Chooser(RoutingSection(policy="round_robin"))
    assert {first_choice(chooser, fleet, route(precision=FP8)) for _ in range(4)} == {"a"}
    assert {first_choice(chooser, fleet) for _ in range(4)} == {"a", "b"}
    with pytest.raises(RouteError) as e:
        chooser.choose(fleet, route(model="nope"))
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "served models: m, other" in str(e.value)
    with pytest.raises(RouteError) as e:
        chooser.choose(fleet, route(precision=common_pb2.PRECISION_FP16))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "available: bf16, fp8" in str(
        e.value
    )
    with pytest.raises(RouteError) as e:
        chooser.choose(fleet_of(), route())
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_least_load_prefers_free_slots_and_round_robin_rotates():
    fleet = fleet_of(info("a"), info("b"))
    fleet.set_load(fleet.get("a"), common_pb2.Load(running=3))
    least = Chooser(RoutingSection(policy="least_load"))
    assert [first_choice(least, fleet) for _ in range(3)] == ["b", "b", "b"]
    for _ in range(4):  # the router's own in-flight count outranks a stale heartbeat
        fleet.started(fleet.get("b"))
    assert first_choice(least, fleet) == "a"
    rr = Chooser(RoutingSection(policy="round_robin"))
    assert [first_choice(rr, fleet) for _ in range(4)] == ["a", "b", "a", "b"]


def test_random_ignores_load_and_reaches_every_worker():
    fleet = fleet_of(info("a"), info("b"), info("c"))
    fleet.set_load(fleet.get("a"), common_pb2.Load(running=3))
    chooser = Chooser(RoutingSection(policy="random"))
    assert {first_choice(chooser, fleet) for _ in range(200)} == {"a", "b", "c"}


def test_decision_names_a_fallback_on_another_worker():
    fleet = fleet_of(info("a"), info("b"), info("c"))
    for policy in ("random", "round_robin", "least_load", "balanced"):
        workers = Chooser(RoutingSection(policy=policy)).choose(fleet, route()).workers
        assert len(workers) == 2 and workers[0] is not workers[1]


def test_balanced_prefers_fast_hardware_until_it_is_busy():
    fleet = fleet_of(
        info("v100", speed=56, max_parallel=4),
        info("h100", precision=FP8, speed=417, max_parallel=8),
    )
    chooser = Chooser(RoutingSection(affinity_weight=0))
    assert [first_choice(chooser, fleet) for _ in range(3)] == ["h100"] * 3
    fleet.set_load(fleet.get("h100"), common_pb2.Load(running=8, waiting=4))
    decision = chooser.choose(fleet, route())
    assert decision.workers[0].worker_id == "v100"
    assert decision.reasons["policy"] == "balanced" and decision.reasons["hardware"] > 0.8


def test_prefix_affinity_keeps_a_prefix_on_one_worker_and_spreads_prefixes():
    fleet = fleet_of(*(info(f"w{i}") for i in range(8)))
    chooser = Chooser(RoutingSection(hardware_weight=0))
    system = "You are a helpful assistant. " * 20
    homes = {
        first_choice(chooser, fleet, route(prompt=system + f"question {i}")) for i in range(10)
    }
    assert len(homes) == 1, "the same leading bytes go to the same worker"
    assert chooser.choose(fleet, route(prompt=system)).reasons["prefix_home"] is True
    spread = {
        first_choice(chooser, fleet, route(prompt=f"{i} different prompt")) for i in range(40)
    }
    assert len(spread) >= 5, f"distinct prefixes should spread over the fleet, got {spread}"


def test_prefix_home_passes_load_beyond_its_bound_to_others():
    fleet = fleet_of(*(info(f"w{i}") for i in range(4)))
    chooser = Chooser(RoutingSection(hardware_weight=0, load_weight=0.1, affinity_weight=1.0))
    request = route(prompt="shared system prompt " * 20)
    placed = collections.Counter()
    for _ in range(12):  # each choice starts a stream that stays open
        worker = chooser.choose(fleet, request).workers[0]
        fleet.started(worker)
        placed[worker.worker_id] += 1
    # fair share of 12 streams on 4 equal workers is 3; the bound is 1.25x that, rounded up
    assert max(placed.values()) <= 4 and len(placed) >= 3, placed


def session(name: str, gpu: str = "") -> RouteRequest:
    request = common_pb2.GenerateRequest(model="m", prompt="the same system prompt", gpu=gpu)
    request.affinity_key = name
    return RouteRequest.of(request, 256)


def test_a_session_stays_on_its_worker_until_it_is_full():
    fleet = fleet_of(info("a", max_parallel=4), info("b", max_parallel=4))
    chooser = Chooser(RoutingSection(hardware_weight=0))
    home = first_choice(chooser, fleet, session("s1"))
    placed = []
    for _ in range(6):  # each choice starts a stream that stays open
        decision = chooser.choose(fleet, session("s1"))
        assert decision.reasons["session"] is True
        fleet.started(decision.workers[0])
        placed.append(decision.workers[0].worker_id)
    # busier than the other worker, the home keeps the session while it has a free slot
    assert placed[:4] == [home] * 4 and home not in placed[4:], placed
    assert len(decision.workers) == 2 and decision.workers[1].worker_id == home


def test_sessions_spread_over_the_fleet_by_their_names_not_their_prompts():
    fleet = fleet_of(*(info(f"w{i}") for i in range(8)))
    chooser = Chooser(RoutingSection())
    homes = {first_choice(chooser, fleet, session(f"s{i}")) for i in range(40)}
    assert len(homes) >= 5, homes
    assert {first_choice(chooser, fleet, session("s7")) for _ in range(5)} == {
        first_choice(chooser, fleet, session("s7"))
    }


def test_a_session_keeps_the_gpu_kind_it_asks_for():
    fleet = fleet_of(info("a"), info("b"))
    with pytest.raises(RouteError) as e:
        Chooser(RoutingSection()).choose(fleet, session("s1", gpu="H200"))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_report_does_not_drop_what_the_router_counts_in_flight():
    fleet = fleet_of(info("a"))
    entry = fleet.entries()[0]
    for _ in range(3):
        fleet.started(entry)
    fleet.set_load(entry, common_pb2.Load(report=1))  # idle: sent before the three arrived
    assert fleet.busy_now[entry.slot] == 3
    fleet.started(entry)
    fleet.set_load(entry, common_pb2.Load(report=1))  # the same report, read again from Redis
    assert fleet.busy_now[entry.slot] == 4
    fleet.set_load(entry, common_pb2.Load(running=4, report=2))  # it counts all four: once
    assert fleet.busy_now[entry.slot] == 4


def test_a_request_frees_its_slot_when_it_ends_not_at_the_next_report():
    fleet = fleet_of(info("a"))
    entry = fleet.entries()[0]
    fleet.started(entry)
    fleet.started(entry)
    # the worker reports both, and one more from a caller this router does not see
    fleet.set_load(entry, common_pb2.Load(running=3, report=1))
    assert fleet.busy_now[entry.slot] == 3
    fleet.ended(entry)  # before the next report: the slot is free at once
    assert fleet.busy_now[entry.slot] == 2
    fleet.set_load(entry, common_pb2.Load(running=2, report=2))
    assert fleet.busy_now[entry.slot] == 2  # one of ours, one of theirs: not counted twice
    for _ in range(3):  # never below zero: a request ends once
        fleet.ended(entry)
    assert fleet.in_flight[entry.slot] == 0 and fleet.busy_now[entry.slot] == 1


def test_prefix_key_is_the_same_in_every_router_process_and_reads_only_the_leading_bytes():
    a = common_pb2.GenerateRequest(prompt="x" * 300 + "tail one")
    b = common_pb2.GenerateRequest(prompt="x" * 300 + "tail two")
    assert prefix_key(a, 256) == prefix_key(b, 256)
    other_process = subprocess.run(
        [
            sys.executable,
            "-c",
            "from infermesh.pb import common_pb2; from router_svc.routing import prefix_key; "
            "print(prefix_key(common_pb2.GenerateRequest(prompt='x' * 300), 256))",
        ],
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(other_process.stdout) == prefix_key(a, 256)
    assert prefix_key(a, 512) != prefix_key(b, 512)
    chat = common_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(role="system", content="hi")]
    )
    assert prefix_key(chat, 256) != prefix_key(common_pb2.GenerateRequest(prompt="hi"), 256)


def test_failing_worker_is_ejected_for_the_cooldown():
    clock = Clock()
    fleet = fleet_of(info("bad"), info("good"), clock=clock)
    chooser = Chooser(RoutingSection(policy="round_robin"))
    bad = fleet.get("bad")
    assert not fleet.failed(bad, failures_to_eject=2, cooldown_s=10)
    fleet.succeeded(bad)  # a success resets the count
    assert not fleet.failed(bad, failures_to_eject=2, cooldown_s=10)
    assert fleet.failed(bad, failures_to_eject=2, cooldown_s=10)
    assert {first_choice(chooser, fleet) for _ in range(4)} == {"good"}
    clock.now += 11
    assert {first_choice(chooser, fleet) for _ in range(4)} == {"bad", "good"}
    fleet.failed(fleet.get("good"), failures_to_eject=1, cooldown_s=10)
    fleet.failed(bad, failures_to_eject=1, cooldown_s=10)
    assert first_choice(chooser, fleet) in ("bad", "good"), "all ejected: still tried"


def test_slots_are_reused_without_carrying_counts_over():
    fleet = fleet_of(info("a"), info("b"))
    old = fleet.get("a")
    fleet.started(old)
    fleet.remove("a")
    fleet.upsert(info("c"), common_pb2.Load(), registered_at=0, expires_in_s=3)
    new = fleet.get("c")
    assert new.slot == old.slot and fleet.in_flight[new.slot] == 0
    fleet.ended(old)  # the stream to the removed worker ends: c's count is untouched
    assert fleet.in_flight[new.slot] == 0


def test_reregistration_with_new_capabilities_regroups():
    fleet = fleet_of(info("a"))
    chooser = Chooser(RoutingSection())
    assert first_choice(chooser, fleet, route(precision=BF16)) == "a"
    fleet.upsert(info("a", precision=FP8), common_pb2.Load(), registered_at=0, expires_in_s=3)
    assert len(fleet.entries()) == 1
    assert first_choice(chooser, fleet, route(precision=FP8)) == "a"
    with pytest.raises(RouteError):
        chooser.choose(fleet, route(precision=BF16))


def test_a_thousand_workers_grow_the_arrays():
    fleet = fleet_of(*(info(f"w{i}", max_parallel=1 + i % 8) for i in range(1000)))
    chooser = Chooser(RoutingSection())
    decision = chooser.choose(fleet, route())
    assert decision.reasons["candidates"] == 1000
    assert dataclasses.asdict(RoutingSection())["policy"] == "balanced"


def cached_on(fleet: Fleet, holdings: dict[str, list[int]]) -> PrefixIndex:
    index = PrefixIndex(max_blocks=10_000)
    for worker_id, hashes in holdings.items():
        entry = fleet.get(worker_id)
        assert entry is not None
        index.apply(entry.slot, hashes, ())
    return index


def with_hashes(hashes: list[int], session: str = "", prompt: str = "x") -> RouteRequest:
    request = common_pb2.GenerateRequest(
        model="m", prompt=prompt, prefix_hashes=hashes, affinity_key=session
    )
    return RouteRequest.of(request, 256)


def test_the_worker_caching_the_longest_prefix_wins_and_the_byte_window_is_not_used():
    fleet = fleet_of(*(info(f"w{i}") for i in range(6)))
    hashes = chain(list(range(16 * 40)))
    index = cached_on(fleet, {"w1": hashes[:10], "w4": hashes[:30], "w5": hashes[:2]})
    chooser = Chooser(RoutingSection(), index)
    decision = chooser.choose(fleet, with_hashes(hashes))
    assert [w.worker_id for w in decision.workers] == ["w4", "w1"]
    assert decision.cached_tokens == decision.reasons["cached_tokens"] == 30 * 16
    assert decision.reasons["prefix_home"] is False
    # the same prompt without hashes: its leading bytes' home, whatever the index holds
    byte_home = first_choice(Chooser(RoutingSection()), fleet, route(prompt="x"))
    assert first_choice(chooser, fleet, route(prompt="x")) == byte_home


def test_a_cache_saves_more_on_slow_prefill_hardware_and_load_still_counts():
    # decoding 100x faster, as well: that fitness does not count where the prefill is known
    slow, fast = info("slow", speed=1), info("fast", speed=100)
    slow.capabilities.prefill_tokens_per_second = 1000.0
    fast.capabilities.prefill_tokens_per_second = 20000.0
    fleet = fleet_of(slow, fast)
    hashes = chain(list(range(16 * 64)))
    chooser = Chooser(RoutingSection(hardware_weight=5), cached_on(fleet, {"slow": hashes}))
    # 1,024 tokens: one second of prefill on the slow worker, saved by its cache
    assert first_choice(chooser, fleet, with_hashes(hashes)) == "slow"
    # nothing cached: the fast prefill wins
    assert first_choice(chooser, fleet, with_hashes(chain(list(range(1, 16 * 64 + 1))))) == "fast"
    # busier by more than the second it saves (3 slots of 4: 0.75), the holder is passed over
    fleet.set_load(fleet.get("slow"), common_pb2.Load(running=3))
    assert first_choice(chooser, fleet, with_hashes(hashes)) == "fast"
    # without prefix hashes the decode speed counts: the slow worker even idle loses
    fleet.set_load(fleet.get("slow"), common_pb2.Load(running=0, report=2))
    assert first_choice(chooser, fleet, route(prompt="another")) == "fast"


def test_a_request_with_thinking_on_weighs_the_decode_speed_against_the_cache():
    """A reasoning model's thinking makes the output long: the decode speed counts beside the
    prefill the cache saves."""
    slow, fast = info("slow", speed=1), info("fast", speed=100)
    for worker in (slow, fast):
        worker.capabilities.prefill_tokens_per_second = 1000.0
    fleet = fleet_of(slow, fast)
    hashes = chain(list(range(16 * 64)))
    chooser = Chooser(RoutingSection(hardware_weight=5), cached_on(fleet, {"slow": hashes}))
    # one second of prefill saved on the slow decoder: it wins a short answer
    assert first_choice(chooser, fleet, with_hashes(hashes)) == "slow"
    for thinking in (True, False):
        request = common_pb2.GenerateRequest(
            model="m", prompt="x", prefix_hashes=hashes, thinking=thinking
        )
        decision = chooser.choose(fleet, RouteRequest.of(request, 256))
        assert decision.workers[0].worker_id == ("fast" if thinking else "slow")
    # R1 thinks whether or not a request asks: its workers' format says so
    for worker in (slow, fast):
        worker.capabilities.reasoning_format = "deepseek_r1"
    r1 = fleet_of(slow, fast)
    chooser = Chooser(RoutingSection(hardware_weight=5), cached_on(r1, {"slow": hashes}))
    assert first_choice(chooser, r1, with_hashes(hashes)) == "fast"


def test_a_busy_holder_keeps_its_prefix_from_a_less_busy_worker_but_not_from_an_idle_one():
    workers = [info(name, max_parallel=8) for name in ("holder", "busy", "idle")]
    for worker in workers:
        worker.capabilities.prefill_tokens_per_second = 10000.0
    fleet = fleet_of(*workers[:2])
    hashes = chain(list(range(16 * 200)))  # 3,200 tokens: 0.32 s of prefill, cached on holder
    chooser = Chooser(RoutingSection(), cached_on(fleet, {"holder": hashes}))
    fleet.set_load(fleet.get("holder"), common_pb2.Load(running=5))
    fleet.set_load(fleet.get("busy"), common_pb2.Load(running=2))
    # 3 busy slots more (0.375) against a prefill that would stall 3 streams there (0.96)
    assert first_choice(chooser, fleet, with_hashes(hashes)) == "holder"
    # an idle worker stalls no one: 5 busy slots more (0.625) against the request's own 0.32 s
    fleet.upsert(workers[2], common_pb2.Load(), registered_at=0, expires_in_s=3)
    assert first_choice(chooser, fleet, with_hashes(hashes)) == "idle"


def test_a_short_hit_behind_a_prefill_queue_loses_to_a_worker_without_one_a_long_hit_wins():
    clock = Clock()
    workers = [info(name, max_parallel=8) for name in ("holder", "other")]
    for worker in workers:
        worker.capabilities.prefill_tokens_per_second = 10_000.0
    fleet = fleet_of(*workers, clock=clock)
    holder = fleet.get("holder")
    assert holder is not None
    common = chain(list(range(16 * 32)))  # one short block every prompt starts with: 512 tokens
    prompt = chain([*range(16 * 32), *range(9, 16 * 468 + 9)])  # 8,000 tokens: 0.8 s of prefill
    assert prompt[:32] == common
    chooser = Chooser(RoutingSection(), cached_on(fleet, {"holder": common}))
    for worker in ("holder", "other"):  # as busy as each other: only the prefill terms differ
        fleet.set_load(fleet.get(worker), common_pb2.Load(running=2))
    # without a queue, the 0.05 s the block saves (on each of the 3 streams) wins
    assert first_choice(chooser, fleet, with_hashes(prompt)) == "holder"
    # a 20,000-token prompt routed there first: 2 s of prefill the next one would wait for
    long = chooser.choose(fleet, with_hashes(chain(list(range(1, 16 * 1250 + 1)))))
    assert long.prefill_s == pytest.approx(2.0)
    fleet.queued_prefill(holder, long.prefill_s)
    assert first_choice(chooser, fleet, with_hashes(prompt)) == "other"
    # 7,680 of the 8,000 tokens cached: 0.77 s saved on each of 3 streams outweighs the wait
    chooser = Chooser(RoutingSection(), cached_on(fleet, {"holder": prompt[:480]}))
    decision = chooser.choose(fleet, with_hashes(prompt))
    assert decision.workers[0].worker_id == "holder"
    assert decision.reasons["queued_prefill_s"] == pytest.approx(2.0)
    # the queue drains as the worker prefills: 2 s later the short hit wins again
    chooser = Chooser(RoutingSection(), cached_on(fleet, {"holder": common}))
    clock.now += 1.0
    assert first_choice(chooser, fleet, with_hashes(prompt)) == "other"
    clock.now += 1.0
    assert first_choice(chooser, fleet, with_hashes(prompt)) == "holder"


def test_prefills_routed_to_a_worker_queue_one_after_another():
    clock = Clock()
    fleet = fleet_of(info("w"), clock=clock)
    worker = fleet.get("w")
    assert worker is not None
    fleet.queued_prefill(worker, 2.0)
    fleet.queued_prefill(worker, 0.5)
    assert fleet.prefill_until[worker.slot] == clock.now + 2.5
    clock.now += 10.0  # the queue ran dry: the next prefill starts now
    fleet.queued_prefill(worker, 0.5)
    assert fleet.prefill_until[worker.slot] == clock.now + 0.5


def test_a_session_follows_its_history_cached_elsewhere_while_that_worker_has_room():
    fleet = fleet_of(*(info(f"w{i}", max_parallel=2) for i in range(4)))
    system, history = chain(list(range(16 * 8))), chain(list(range(16 * 40)))
    chooser = Chooser(RoutingSection(), PrefixIndex(max_blocks=10_000))
    home = first_choice(chooser, fleet, with_hashes(system, session="s"))
    elsewhere = next(f"w{i}" for i in range(4) if f"w{i}" != home)
    index = cached_on(fleet, {w.worker_id: system for w in fleet.entries()})
    chooser = Chooser(RoutingSection(), index)
    assert first_choice(chooser, fleet, with_hashes(history, session="s")) == home
    entry = fleet.get(elsewhere)
    assert entry is not None
    index.apply(entry.slot, history[:20], ())
    decision = chooser.choose(fleet, with_hashes(history, session="s"))
    assert decision.workers[0].worker_id == elsewhere and decision.cached_tokens == 20 * 16
    fleet.set_load(entry, common_pb2.Load(running=2))  # full: the session's own worker again
    assert first_choice(chooser, fleet, with_hashes(history, session="s")) == home


def test_a_new_session_stays_on_its_worker_though_its_system_prompt_is_cached_elsewhere():
    fleet = fleet_of(*(info(f"w{i}", max_parallel=2) for i in range(4)))
    system = chain(list(range(16 * 8)))
    home = first_choice(Chooser(RoutingSection()), fleet, with_hashes(system, session="s"))
    elsewhere = next(f"w{i}" for i in range(4) if f"w{i}" != home)
    chooser = Chooser(RoutingSection(), cached_on(fleet, {elsewhere: system}))
    decision = chooser.choose(fleet, with_hashes(system + chain(list(range(9, 200))), "s"))
    assert decision.workers[0].worker_id == home and decision.cached_tokens == 0


def test_a_decision_says_what_chose_its_worker():
    fleet = fleet_of(*(info(f"w{i}") for i in range(4)))
    hashes = chain(list(range(16 * 8)))
    index = cached_on(fleet, {"w2": hashes[:8]})
    balanced = Chooser(RoutingSection(hardware_weight=0), index)
    assert balanced.choose(fleet, with_hashes(hashes)).basis == "cache"
    assert balanced.choose(fleet, with_hashes(chain(list(range(99, 131))))).basis == "load"
    assert balanced.choose(fleet, session("s1")).basis == "session"
    assert balanced.choose(fleet, route(prompt="system " * 40)).basis == "affinity"
    for policy in ("round_robin", "random"):
        assert Chooser(RoutingSection(policy=policy)).choose(fleet, route()).basis == "turn"
