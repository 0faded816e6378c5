from __future__ import annotations

import math

import grpc
import pytest

from infermesh.pb import common_pb2
from router_svc.registry import Registry, RegistrationError
from router_svc.routing import Chooser, RouteError, candidates


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def worker(worker_id: str, models=("m",), precision=common_pb2.PRECISION_BF16,
           max_parallel: int = 4) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(
        worker_id=worker_id, address=f"127.0.0.1:{abs(hash(worker_id)) % 50000 + 1000}",
        models=list(models), capabilities=common_pb2.Capabilities(
            device="cuda", precision=precision, max_parallel=max_parallel))


def test_worker_expires_after_ttl_and_heartbeat_keeps_it():
    clock = _Clock()
    registry = Registry(ttl_s=3, clock=clock)
    registry.register(worker("a"), common_pb2.Load())
    clock.now += 2
    assert registry.heartbeat("a", common_pb2.Load(running=1))
    clock.now += 2.5
    assert list(registry.live()) == ["a"]
    clock.now += 1
    assert registry.live() == {}
    assert not registry.heartbeat("a", common_pb2.Load())


@pytest.mark.parametrize("info, load, message", [
    (common_pb2.WorkerInfo(address="h:1", models=["m"]), common_pb2.Load(), "worker_id is empty"),
    (common_pb2.WorkerInfo(worker_id="w", address="nohost", models=["m"]), common_pb2.Load(),
     "is not host:port"),
    (common_pb2.WorkerInfo(worker_id="w", address="h:1"), common_pb2.Load(), "at least one model"),
    (worker("w"), common_pb2.Load(kv_cache_usage=math.nan), "kv_cache_usage"),
    (worker("w"), common_pb2.Load(kv_cache_usage=3), "above 1"),
    (worker("w"), common_pb2.Load(tokens_per_second=-1), "tokens_per_second"),
])
def test_nonsense_registration_is_refused(info, load, message):
    with pytest.raises(RegistrationError, match=message):
        Registry(ttl_s=3).register(info, load)


def test_registering_twice_keeps_one_entry():
    registry = Registry(ttl_s=3)
    registry.register(worker("a"), common_pb2.Load())
    registry.register(worker("a"), common_pb2.Load(running=2))
    assert len(registry.live()) == 1 and registry.live()["a"].load.running == 2


def _entries(*infos):
    registry = Registry(ttl_s=3)
    for info in infos:
        registry.register(info, common_pb2.Load())
    return list(registry.live().values())


def test_candidates_filter_by_model_and_precision():
    entries = _entries(worker("a", precision=common_pb2.PRECISION_FP8),
                       worker("b"), worker("c", models=["other"]))
    assert [w.worker_id for w in candidates(entries, "m", common_pb2.PRECISION_UNSPECIFIED)] == ["a", "b"]
    assert [w.worker_id for w in candidates(entries, "m", common_pb2.PRECISION_FP8)] == ["a"]
    with pytest.raises(RouteError) as e:
        candidates(entries, "nope", common_pb2.PRECISION_UNSPECIFIED)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "served models: m, other" in str(e.value)
    with pytest.raises(RouteError) as e:
        candidates(entries, "m", common_pb2.PRECISION_FP16)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "available: bf16, fp8" in str(e.value)
    with pytest.raises(RouteError) as e:
        candidates([], "m", common_pb2.PRECISION_UNSPECIFIED)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_least_load_prefers_free_slots_and_round_robin_rotates():
    entries = _entries(worker("a", max_parallel=4), worker("b", max_parallel=4))
    entries[0].load = common_pb2.Load(running=3)
    chooser = Chooser("least_load")
    assert [chooser.rank(entries)[0].worker_id for _ in range(3)] == ["b", "b", "b"]
    entries[1].in_flight = 4  # the router's own count outranks a stale heartbeat
    assert chooser.rank(entries)[0].worker_id == "a"
    rr = Chooser("round_robin")
    assert [rr.rank(entries)[0].worker_id for _ in range(4)] == ["a", "b", "a", "b"]
