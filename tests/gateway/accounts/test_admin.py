"""The admin API for keys and the ``python -m infermesh keys`` CLI over it,
against real gateway apps, a real router and a real Redis."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest

from gateway.config import AdminSection
from infermesh.authz import role_uri
from infermesh.pb import common_pb2
from infermesh.usage import count_usage, identity_owner
from tests.helpers.gateway import ADMIN, ADMIN_TOKEN, CHAT, auth, start_gateway

_REPO = Path(__file__).resolve().parents[3]


async def _json(response, status: int = 200):
    assert response.status == status, await response.text()
    return await response.json()


async def test_admin_api_needs_the_admin_token(gateway, api_key, config):
    for headers in [
        {},
        auth(api_key),
        {"Authorization": "Bearer wrong-token-1234567"},
        {"Authorization": ADMIN_TOKEN},
    ]:
        response = await gateway.get("/admin/keys", headers=headers)
        assert (await _json(response, 401))["error"]["code"] == "invalid_admin_token"
    # the admin token is no API key
    assert (await gateway.get("/v1/models", headers=ADMIN)).status == 401

    off = await start_gateway(dataclasses.replace(config, admin=AdminSection()))
    try:
        response = await off.get("/admin/keys", headers=ADMIN)
        assert (await _json(response, 403))["error"]["code"] == "admin_disabled"
    finally:
        await off.close()


async def test_key_lifecycle(gateways, redis_server):
    gateway = gateways[0]
    created = await _json(
        await gateway.post(
            "/admin/keys",
            headers=ADMIN,
            json={"name": "ci", "rpm": 100, "models": ["tiny"], "expires_at": 2**40, "unknown": 1},
        ),
        201,
    )
    key, kid = created["key"], created["id"]
    assert key.startswith("sk-") and len(kid) == 64
    assert created["limits"] == {"rpm": 100} and created["models"] == ["tiny"]
    listed = await _json(await gateway.get("/admin/keys", headers=ADMIN))
    assert [k["id"] for k in listed["data"]] == [kid] and "key" not in listed["data"][0]

    response = await gateway.get("/v1/models", headers=auth(key))
    assert response.headers["x-ratelimit-remaining-requests"] == "99"
    updated = await _json(
        await gateway.patch(
            f"/admin/keys/{kid}", headers=ADMIN, json={"rpm": None, "tpm": 5000, "models": None}
        )
    )
    assert updated["limits"] == {"tpm": 5000} and updated["models"] == []
    response = await gateway.get("/v1/models", headers=auth(key))
    assert "x-ratelimit-limit-requests" not in response.headers  # applies at once
    assert response.headers["x-ratelimit-limit-tokens"] == "5000"

    usage = await _json(await gateway.get(f"/admin/keys/{kid}/usage?days=2", headers=ADMIN))
    assert usage["requests"] == 2 and usage["name"] == "ci" and len(usage["daily"]) == 2

    rotated = await _json(await gateway.post(f"/admin/keys/{kid}/rotate", headers=ADMIN), 201)
    assert rotated["rotated_from"] == kid and rotated["limits"] == {"tpm": 5000}
    assert (await gateway.get("/v1/models", headers=auth(key))).status == 401
    assert (await gateway.get("/v1/models", headers=auth(rotated["key"]))).status == 200
    old = await _json(await gateway.get(f"/admin/keys/{kid}", headers=ADMIN))
    assert old["revoked"] and old["rotated_to"] == rotated["id"]
    response = await gateway.patch(f"/admin/keys/{kid}", headers=ADMIN, json={"disabled": False})
    assert (await _json(response, 400))["error"]["param"] == "disabled"


@pytest.mark.parametrize("action", ["disable", "revoke"])
async def test_a_stopped_key_fails_on_every_gateway_within_a_second(gateways, action):
    created = await _json(
        await gateways[0].post("/admin/keys", headers=ADMIN, json={"name": "short-lived"}), 201
    )
    for gateway in gateways:  # each caches the key as valid
        assert (await gateway.get("/v1/models", headers=auth(created["key"]))).status == 200
    await _json(await gateways[0].post(f"/admin/keys/{created['id']}/{action}", headers=ADMIN))
    stopped = time.monotonic()
    for gateway in gateways:
        for method, path, body in [
            ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions", CHAT),
        ]:
            while (
                status := (
                    await gateway.request(method, path, json=body, headers=auth(created["key"]))
                ).status
            ) != 401:
                assert status == 200 or status == 404, status  # served until refused
                await asyncio.sleep(0.05)
    assert time.monotonic() - stopped < 1.0


@pytest.mark.parametrize(
    "method, path, body, status, param",
    [
        ("POST", "/admin/keys", {"name": "x", "rpm": "ten"}, 400, "rpm"),
        ("POST", "/admin/keys", {"name": "x", "tpm": 0}, 400, "tpm"),
        ("POST", "/admin/keys", {"rpm": 5}, 400, "name"),
        ("POST", "/admin/keys", {"name": "x", "models": ["a,b"]}, 400, "models.0"),
        ("POST", "/admin/keys", {"name": "x", "weight": 0}, 400, "weight"),
        ("POST", "/admin/keys", {"name": "x", "weight": 1.5}, 400, "weight"),
        ("POST", "/admin/keys", {"name": "x", "tier": "Gold tier!"}, 400, "tier"),
        ("PATCH", f"/admin/keys/{'0' * 64}", {"rpm": 5}, 404, "id"),
        ("PATCH", f"/admin/keys/{'0' * 64}", {"name": None}, 400, None),
        ("POST", f"/admin/keys/{'0' * 64}/revoke", None, 404, "id"),
        ("GET", f"/admin/keys/{'0' * 64}/usage", None, 404, "id"),
        ("GET", "/admin/callers/usage", None, 400, "identity"),
        ("GET", "/admin/callers/usage?identity=spiffe://infermesh/worker", None, 400, "identity"),
        ("GET", "/admin/callers/usage?identity=cert:client", None, 400, "identity"),
    ],
)
async def test_admin_errors_name_the_field(gateway, method, path, body, status, param):
    response = await gateway.request(method, path, json=body, headers=ADMIN)
    assert (await _json(response, status))["error"]["param"] == param


async def test_a_keys_weight_and_tier_are_set_kept_on_rotation_and_cleared(gateway):
    created = await _json(
        await gateway.post(
            "/admin/keys", json={"name": "q", "weight": 4, "tier": "gold"}, headers=ADMIN
        ),
        201,
    )
    assert (created["weight"], created["tier"]) == (4, "gold")
    kid = created["id"]
    updated = await _json(
        await gateway.patch(f"/admin/keys/{kid}", json={"weight": 2}, headers=ADMIN), 200
    )
    assert (updated["weight"], updated["tier"]) == (2, "gold")
    rotated = await _json(await gateway.post(f"/admin/keys/{kid}/rotate", headers=ADMIN), 201)
    assert (rotated["weight"], rotated["tier"]) == (2, "gold")
    cleared = await _json(
        await gateway.patch(
            f"/admin/keys/{rotated['id']}", json={"weight": None, "tier": None}, headers=ADMIN
        ),
        200,
    )
    assert (cleared["weight"], cleared["tier"]) == (None, None)


async def test_an_internal_callers_usage_is_read_by_its_identity(gateway, redis_client):
    identity = role_uri("client", "billing")
    usage = common_pb2.Usage(prompt_tokens=5, completion_tokens=3, cached_prompt_tokens=1)
    await count_usage(redis_client, identity_owner(identity), usage)
    await count_usage(redis_client, identity_owner(role_uri("client", "other")), usage)
    path = f"/admin/callers/usage?identity={identity}&days=1"
    body = await _json(await gateway.get(path, headers=ADMIN))
    assert body["identity"] == identity and body["requests"] == 1
    assert (body["prompt_tokens"], body["completion_tokens"], body["cached_tokens"]) == (5, 3, 1)
    assert body["daily"][0]["total_tokens"] == 8 and "in_flight" not in body


async def _cli(gateway, *args: str, token: str = ADMIN_TOKEN) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "infermesh",
        "keys",
        *args,
        cwd=_REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={
            **os.environ,
            "INFERMESH_ADMIN_URL": str(gateway.make_url("")),
            "INFERMESH_ADMIN_TOKEN": token,
        },
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None  # communicate() waited for the exit
    return proc.returncode, out.decode(), err.decode()


async def test_cli_over_the_admin_api(gateways):
    gateway = gateways[0]
    code, out, _ = await _cli(gateway, "create", "from-cli", "--rpm", "7", "--models", "a,b")
    created = json.loads(out)
    assert code == 0 and created["limits"] == {"rpm": 7} and created["models"] == ["a", "b"]
    code, out, _ = await _cli(gateway, "update", created["id"], "--rpm", "none", "--tpm", "9")
    assert code == 0 and json.loads(out)["limits"] == {"tpm": 9}
    assert json.loads(out)["models"] == ["a", "b"]  # flags not given are left alone
    code, out, _ = await _cli(gateway, "usage", created["id"], "--days", "1")
    assert code == 0 and json.loads(out)["requests"] == 0
    code, out, _ = await _cli(gateway, "revoke", created["id"])
    assert code == 0 and json.loads(out)["revoked"] is True

    code, _, err = await _cli(gateway, "get", "0" * 64)
    assert code == 1 and "404" in err and "No API key" in err
    code, _, err = await _cli(gateway, "list", token="wrong-token-1234567")
    assert code == 1 and "401" in err
