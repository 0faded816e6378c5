"""How the gateway reaches workers: the router chooses on the route stream and the gateway
streams from the worker (falling back to the second choice, reporting the failure). Real
router, workers and Redis."""

from __future__ import annotations

from prometheus_client import REGISTRY

from gateway.accounts.keys import create_key
from router_svc.config import RoutingSection
from tests.helpers import MODEL
from tests.helpers.gateway import CHAT, auth, make_config, sdk, start_gateway
from tests.helpers.inprocess import (
    eventually,
    register_unreachable_worker,
    running_router,
    running_worker,
)

_GREEDY = {**CHAT, "model": MODEL, "temperature": 0, "max_tokens": 6}


async def test_streamed_and_whole_answers_agree(served, worker, api_key):
    response = await served.post("/v1/chat/completions", json=_GREEDY, headers=auth(api_key))
    assert response.status == 200
    assert response.headers["x-infermesh-worker"] == worker.servicer.info.worker_id
    async with sdk(served, api_key) as client:
        stream = await client.chat.completions.create(
            **_GREEDY, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
    whole = (await response.json())["choices"][0]["message"]["content"]
    assert whole == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 6


async def test_a_stream_falls_back_and_reports_a_dead_worker(redis_server, tiny_engine, api_key):
    routing = RoutingSection(policy="round_robin", failures_to_eject=2)
    # the dead worker never heartbeats: a TTL longer than the test keeps it registered, so that
    # what removes it from routing is the gateway's failure reports, not expiry (a loaded
    # machine took over the default 3 s for the four requests)
    async with (
        running_router(ttl_s=60, redis_url=redis_server.url, routing=routing) as router,
        running_worker(tiny_engine, router, "live"),
    ):
        await register_unreachable_worker(router)
        gateway = await start_gateway(make_config(redis_server.url, router.address))
        try:
            for _ in range(4):  # round robin puts the dead worker first half of the time
                response = await gateway.post(
                    "/v1/chat/completions", json=_GREEDY, headers=auth(api_key)
                )
                assert response.status == 200, await response.text()
                assert response.headers["x-infermesh-worker"] == "live"
        finally:
            await gateway.close()
        fleet = router.resources.registry.fleet
        entry = fleet.get("dead")
        # the gateway's reports (sent in the background) ejected it
        await eventually(lambda: fleet.ejected_until[entry.slot] > fleet.clock())


async def test_unreachable_workers_answer_503_naming_them(redis_server, api_key):
    async with running_router(redis_url=redis_server.url) as router:
        await register_unreachable_worker(router)
        gateway = await start_gateway(make_config(redis_server.url, router.address))
        try:
            response = await gateway.post(
                "/v1/chat/completions", json=_GREEDY, headers=auth(api_key)
            )
            error = (await response.json())["error"]
        finally:
            await gateway.close()
    assert response.status == 503 and "Retry-After" in response.headers
    assert "dead" in error["message"] and error["type"]


async def test_a_refused_request_hands_its_early_decision_back(redis_server, redis_client):
    """The gateway asks the router while admission runs; a request admission refuses does not
    leave its worker counted as busy with it."""
    key = await create_key(redis_client, "tiny", tpm=1)  # every request reserves more: 429
    async with running_router(ttl_s=60, redis_url=redis_server.url) as router:
        # never heartbeats: nothing but the gateway resets what the router counts for it
        await register_unreachable_worker(router)
        gateway = await start_gateway(make_config(redis_server.url, router.address))
        sent = REGISTRY.get_sample_value(_ROUTER_SENT, {"peer": "router", "direction": "sent"})
        try:
            # the router's channel connects on the first call: listing models makes it
            assert (await gateway.get("/v1/models", headers=auth(key))).status == 200
            for _ in range(5):
                response = await gateway.post(
                    "/v1/chat/completions", json=_GREEDY, headers=auth(key)
                )
                assert response.status == 429, await response.text()
        finally:
            await gateway.close()
        fleet = router.resources.registry.fleet
        # asked ahead (messages went to the router), then handed back: nothing counted
        assert REGISTRY.get_sample_value(_ROUTER_SENT, {"peer": "router", "direction": "sent"}) > (
            sent or 0
        )
        await eventually(lambda: fleet.in_flight[fleet.get("dead").slot] == 0)
        assert fleet.busy_now[fleet.get("dead").slot] == 0


_ROUTER_SENT = "infermesh_gateway_stream_messages_total"
