"""Two routers active-active on one registry: the short version of bench/chaos.py's
router-failover scenario (two routers, two gateways each dialing both, three simulated
workers of 2 slots each, the rest of c=16 streaming clients waiting in the routers' fair
queues), the first router SIGKILLed mid-run."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from bench.chaos import QUEUEING_ENV, ChaosMesh, router_failover

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def routers(tmp_path_factory) -> AsyncIterator[ChaosMesh]:
    async with ChaosMesh(tmp_path_factory.mktemp("routers"), routers=2, env=QUEUEING_ENV) as mesh:
        yield mesh


async def test_a_router_killed_mid_run_loses_no_request(routers):
    figures = await router_failover(
        routers, concurrency=16, before_s=1.0, after_s=2.0, max_tokens=32
    )
    # every request served: those the dead router had not decided were asked of the other
    assert figures["failed (not 200)"] == 0, figures["statuses"]
    assert figures["sent after the kill"] > 0, figures
    # in flight at the kill: streams, which read from their workers, and asks waiting in the
    # dead router's fair queue (6 worker slots, 16 clients), asked again of the other
    assert figures["of them, no token yet (queued or in prefill)"] > 0, figures
    assert figures["in flight, completed"] == figures["in flight at the kill"], figures
    assert figures["streams not ended cleanly"] == 0, figures
    # the workers registered with the survivor, whose index holds what each worker caches
    assert figures["workers on the surviving router"] == 3, figures
    assert figures["long prompts served after the load"] == 9, figures
    blocks = figures["index blocks / cached blocks per worker"]
    assert all(indexed == held > 0 for indexed, held in blocks.values()), blocks
    # none served or billed twice: usage == tokens delivered per key, the rpm counter == 200s
    accounts = figures["accounts"]
    assert accounts.recorded == accounts.delivered
    assert accounts.limited_rpm_counted == accounts.limited_served
