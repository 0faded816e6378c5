"""Pinning a request to a GPU kind (header or body), and the admin API's fleet listing.
Real router, simulated workers of two kinds, real Redis."""

from __future__ import annotations

import openai
import pytest

from tests.helpers import MODEL
from tests.helpers.gateway import ADMIN, CHAT, auth, make_config, sdk, start_gateway
from tests.helpers.inprocess import running_worker, sim_engine

_REQUEST = {**CHAT, "model": MODEL, "max_tokens": 2, "temperature": 0}


@pytest.fixture
async def mixed(redis_server, router):
    async with (
        running_worker(sim_engine("A100", zero_latency=True), router, "a100-0"),
        running_worker(
            sim_engine("H100", zero_latency=True, model="DeepSeek-V3"), router, "h100-0"
        ),
    ):
        gateway = await start_gateway(make_config(redis_server.url, router.address))
        yield gateway
        await gateway.close()


async def test_a_request_pinned_to_a_kind_is_served_by_that_kind(mixed, api_key):
    for kind in ("A100", "H100", "A100"):
        response = await mixed.post(
            "/v1/chat/completions",
            json=_REQUEST,
            headers={**auth(api_key), "x-infermesh-gpu": kind},
        )
        assert response.status == 200
        assert (response.headers["x-infermesh-gpu"], response.headers["x-infermesh-worker"]) == (
            kind,
            f"{kind.lower()}-0",
        )
    async with sdk(mixed, api_key) as client:
        raw = await client.chat.completions.with_raw_response.create(
            **_REQUEST, extra_body={"gpu": "H100"}
        )
        assert raw.headers["x-infermesh-worker"] == "h100-0"
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(**_REQUEST, extra_body={"gpu": "V100"})
    assert e.value.status_code == 400
    assert "GPU kind 'V100'; available kinds: A100, H100" in e.value.message
    response = await mixed.post(
        "/v1/chat/completions",
        json=_REQUEST,
        headers={**auth(api_key), "x-infermesh-gpu": "bad\tkind"},
    )
    assert response.status == 400 and (await response.json())["error"]["param"] == "x-infermesh-gpu"


async def test_admin_fleet_lists_kind_count_precision_and_memory(mixed, api_key):
    assert (await mixed.get("/admin/fleet", headers=auth(api_key))).status == 401
    response = await mixed.get("/admin/fleet", headers=ADMIN)
    assert response.status == 200
    workers = {w["worker_id"]: w for w in (await response.json())["data"]}
    assert set(workers) == {"a100-0", "h100-0"}
    a100, h100 = workers["a100-0"], workers["h100-0"]
    assert (a100["gpu_kind"], a100["gpu_count"], a100["precision"], a100["models"]) == (
        "A100",
        1,
        "bf16",
        [MODEL],
    )
    # DeepSeek-V3
    assert (h100["gpu_kind"], h100["gpu_count"], h100["precision"]) == ("H100", 10, "fp8")
    assert h100["memory_total_bytes"] == 10 * 80 * 10**9
    assert h100["weight_bytes"] <= h100["memory_used_bytes"] < h100["memory_total_bytes"]
    assert a100["max_parallel"] == 8
