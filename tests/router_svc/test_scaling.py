"""The series an autoscaler scales worker pools on, per model and pool, as a Prometheus scrape
reads them from a router's fleet view and fair queue."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from infermesh.pb import common_pb2
from router_svc.fleet import Fleet
from router_svc.scaling import ScalingSignals
from tests.helpers.fleet import info


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _worker(worker_id: str, role: str, models=("m",), max_parallel: int = 4):
    worker = info(worker_id, models=models, max_parallel=max_parallel)
    worker.capabilities.role = role
    return worker


def _scrape(signals: ScalingSignals) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(signals)
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(scraped, name: str, **labels: str) -> float | None:
    return scraped.get((f"infermesh_router_{name}", tuple(sorted(labels.items()))))


@pytest.fixture
def fleet_and_signals():
    clock = _Clock()
    fleet = Fleet(ttl_s=3.0, clock=clock)
    for worker_id, role in (("d1", "decode"), ("d2", "decode"), ("p1", "prefill")):
        fleet.upsert(_worker(worker_id, role), common_pb2.Load(), 0.0, 3.0)
    fleet.upsert(_worker("x", "", models=("other",), max_parallel=2), common_pb2.Load(), 0.0, 3.0)
    queued = {"m": 5}
    signals = ScalingSignals(fleet, lambda: queued, lambda ahead: 0.5 * (ahead + 1))
    return clock, fleet, signals


def test_each_pool_of_each_model_reports_its_own_load_and_backlog(fleet_and_signals):
    clock, fleet, signals = fleet_and_signals
    d1, d2, p1 = (fleet.get(w) for w in ("d1", "d2", "p1"))
    for _ in range(3):
        fleet.started(d1)
    fleet.started(d2)
    fleet.queued_prefill(d1, 0.4)
    fleet.queued_prefill(p1, 2.0)
    scraped = _scrape(signals)
    decode = {"model": "m", "pool": "decode"}
    prefill = {"model": "m", "pool": "prefill"}
    assert _value(scraped, "pool_workers", **decode) == 2
    assert _value(scraped, "pool_decode_utilisation", **decode) == 4 / 8  # 4 busy of 8 slots
    assert _value(scraped, "pool_queue_depth", **decode) == 5
    # the queue's wait for 5 ahead (3 s) + the least backlogged decode worker's prefill (d2: 0)
    assert _value(scraped, "pool_predicted_ttft_seconds", **decode) == pytest.approx(3.0)
    assert _value(scraped, "pool_prefill_utilisation", **decode) == 0.5  # d1 of d1, d2
    assert _value(scraped, "pool_prefill_backlog_seconds", **decode) == pytest.approx(0.4)
    # the prefill pool: no request waits for it (it is never a request's worker)
    assert _value(scraped, "pool_queue_depth", **prefill) == 0
    assert _value(scraped, "pool_prefill_backlog_seconds", **prefill) == pytest.approx(2.0)
    assert _value(scraped, "pool_prefill_utilisation", **prefill) == 1.0
    # a worker without a role serves both phases; nothing waits for its model
    both = {"model": "other", "pool": "both"}
    assert _value(scraped, "pool_workers", **both) == 1
    assert _value(scraped, "pool_predicted_ttft_seconds", **both) == 0.0
    clock.now += 1.0  # prefill drains as time passes
    later = _scrape(signals)
    assert _value(later, "pool_prefill_backlog_seconds", **prefill) == pytest.approx(1.0)
    assert _value(later, "pool_prefill_utilisation", **decode) == 0.0


def test_a_pool_with_no_live_worker_is_absent_not_zero(fleet_and_signals):
    _clock, fleet, signals = fleet_and_signals
    fleet.remove("p1")
    fleet.failed(fleet.get("x"), failures_to_eject=1, cooldown_s=10.0)  # ejected: not live
    scraped = _scrape(signals)
    names = {name for name, _ in scraped}
    assert "infermesh_router_pool_workers" in names
    for name, labels in scraped:
        assert ("pool", "prefill") not in labels, name
        assert ("model", "other") not in labels, name
    assert _value(scraped, "pool_queue_depth", model="nope", pool="decode") is None


def test_the_batch_backlog_is_absent_until_the_batch_builder_reports_one(fleet_and_signals):
    _clock, _fleet, signals = fleet_and_signals
    assert not any(name == "infermesh_router_batch_backlog" for name, _ in _scrape(signals))
    signals.report_batch_backlog("m", 7)
    assert _value(_scrape(signals), "batch_backlog", model="m") == 7
    with pytest.raises(ValueError, match="requests: must be >= 0"):
        signals.report_batch_backlog("m", -1)
