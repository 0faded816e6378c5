"""Faults under load on a mesh of real processes: the short versions of bench/chaos.py's
scenarios (persistent Redis, router, three simulated workers, gateway; c=32 streaming
clients). Each scenario puts the mesh back as it found it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from bench.chaos import STALL_TIMEOUT_S, ChaosMesh, outage, revocations, worker_fault

HEARTBEAT_TTL_S = 3.0  # the router's default [registry] ttl_ms
SLACK_S = 1.5  # a shared 2-core machine runs six processes and 32 clients here
SHORT = {"concurrency": 32, "before_s": 1.0, "after_s": 2.0, "max_tokens": 32}

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chaos(tmp_path_factory) -> AsyncIterator[ChaosMesh]:
    async with ChaosMesh(tmp_path_factory.mktemp("chaos")) as mesh:
        yield mesh


def _served_and_counted(figures: dict[str, Any]) -> None:
    accounts = figures["accounts"]
    assert accounts.recorded == accounts.delivered  # usage == tokens delivered, per key
    assert accounts.limited_rpm_counted == accounts.limited_served
    assert figures["streams not ended cleanly"] == 0


@pytest.mark.parametrize("freeze_s", [None, 4.0], ids=["sigkill", "sigstop"])
async def test_a_worker_that_dies_or_freezes_loses_no_request_and_no_usage(chaos, freeze_s):
    figures = await worker_fault(chaos, freeze_s=freeze_s, **SHORT)
    # the fault met streams: requests whose first chunks came from the struck worker were open
    # on it at that moment, and each ended with an error event and [DONE]
    assert figures["in flight on the worker"] > 0, figures
    assert figures["cut mid-stream (error event + [DONE])"] > 0, figures
    assert figures["failed (not 200)"] == 0, figures["statuses"]  # no token yet: served elsewhere
    assert figures["cut mid-stream, other ending"] == 0
    assert figures["left routing after s"] <= HEARTBEAT_TTL_S + SLACK_S
    if freeze_s is not None:  # nothing waits on the frozen worker much past the stall timeout
        assert figures["longest silence of a stream s"] <= STALL_TIMEOUT_S + SLACK_S
    _served_and_counted(figures)


async def test_redis_restart_answers_503_never_401_and_counts_every_request(chaos):
    figures = await outage(chaos, "redis", down_s=2.0, **SHORT)
    assert set(figures["during the outage"]) <= {"503 auth_unavailable", "503 service_unavailable"}
    assert figures["during the outage"].get("503 auth_unavailable", 0) > 0
    assert figures["401 at any time"] == 0
    assert figures["503 without Retry-After"] == 0
    assert figures["in flight, completed"] == figures["in flight at the fault"]
    assert figures["last failure ended, s after return"] <= 2.0 + SLACK_S
    _served_and_counted(figures)


async def test_router_restart_fails_fast_and_serves_again_within_seconds(chaos):
    # down longer than the heartbeat TTL: the workers must register again
    figures = await outage(chaos, "router", down_s=HEARTBEAT_TTL_S + 1, **SHORT)
    assert figures["in flight, completed"] == figures["in flight at the fault"] > 0
    assert set(figures["during the outage"]) == {"503 router_unavailable"}
    assert figures["503 without Retry-After"] == 0
    assert figures["failure latency p50/p99/max s"][1] < 1.0  # fail fast, not a timeout
    assert figures["last failure ended, s after return"] <= 2.5  # workers back within ~1 s
    _served_and_counted(figures)  # the 503s counted against no limit


async def test_a_revoked_key_is_refused_by_every_gateway_within_a_second(chaos):
    figures = await revocations(chaos, 3, concurrency=8, max_tokens=32)
    for label, (_p50, _p99, worst) in figures.items():
        assert worst <= 1.0, (label, worst)
