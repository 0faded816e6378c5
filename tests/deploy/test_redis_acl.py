"""The deployments' Redis ACL (deploy/k8s/redis/users.acl, rendered by render-acl.sh) on a real
redis-server: the gateway's and the router's own code paths work as their users, and each user
is refused every other key and command."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as redis
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from redis.exceptions import NoPermissionError

from devtools.redis_server import RedisServer
from gateway.accounts import keys
from gateway.accounts.limits import Limiter, read_usage
from gateway.accounts.recent import RecentRequest, RecentRequests
from gateway.accounts.usage import TokenUsage
from gateway.config import ConsoleSection
from gateway.console import session
from gateway.console.usage_pages import read_all
from gateway.openai.responses_store import ResponseStore, StoredResponse
from infermesh.authz import role_uri
from infermesh.pb import common_pb2
from infermesh.redis_client import RedisClient, redis_client
from infermesh.usage import count_usage, identity_owner
from router_svc.config import RedisSection, RegistrySection
from router_svc.fleet import Fleet
from router_svc.registry import Registry
from tests.helpers.fleet import info

ACL_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "redis"
PASSWORDS = {"gateway": "gateway-test-password", "router": "router-test-password"}


def render_acl(tmp_path: Path, passwords: dict[str, str]) -> subprocess.CompletedProcess[str]:
    secrets = tmp_path / "passwords"
    secrets.mkdir(exist_ok=True)
    for user, password in passwords.items():
        (secrets / user).write_text(password + "\n")  # as `kubectl create secret --from-file`
    return subprocess.run(
        [
            "sh",
            str(ACL_DIR / "render-acl.sh"),
            str(ACL_DIR / "users.acl"),
            str(secrets),
            str(tmp_path / "users.acl"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture
def acl_redis(tmp_path) -> Iterator[RedisServer]:
    assert render_acl(tmp_path, PASSWORDS).returncode == 0
    with RedisServer(workdir=tmp_path, args=["--aclfile", str(tmp_path / "users.acl")]) as server:
        yield server


def url_of(server: RedisServer, user: str) -> str:
    return f"redis://{user}:{PASSWORDS[user]}@127.0.0.1:{server.port}/0"


@pytest.fixture
async def gateway_redis(acl_redis) -> AsyncIterator[RedisClient]:
    client = redis_client(url_of(acl_redis, "gateway"), timeout_s=2.0)
    yield client
    await client.aclose()


@pytest.fixture
async def router_redis(acl_redis) -> AsyncIterator[RedisClient]:
    client = redis_client(url_of(acl_redis, "router"), timeout_s=2.0)
    yield client
    await client.aclose()


def test_the_rendered_file_holds_hashes_never_passwords(tmp_path):
    assert render_acl(tmp_path, PASSWORDS).returncode == 0
    rendered = (tmp_path / "users.acl").read_text()
    assert not any(p in rendered for p in PASSWORDS.values())
    assert "_PASSWORD_SHA256@" not in rendered  # no placeholder left
    assert (tmp_path / "users.acl").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(
    "passwords", [{"gateway": "only-the-gateway"}, {**PASSWORDS, "router": ""}]
)
def test_a_missing_or_empty_password_stops_the_render(tmp_path, passwords):
    result = render_acl(tmp_path, passwords)
    assert result.returncode != 0 and "router" in result.stderr


async def test_the_gateway_serves_keys_limits_usage_and_responses(gateway_redis):
    plaintext = await keys.create_key(gateway_redis, "acl", rpm=10, quota_tokens=1000)
    kid = keys.key_id(plaintext)
    store = keys.KeyStore(gateway_redis, cache_ttl_s=0)
    assert (await store.authenticate(plaintext)) is not None
    limiter = Limiter(gateway_redis, lease_ttl_s=30, settle_retry_max=10)
    admission = await limiter.admit(kid, 16)
    await limiter.settle(admission, TokenUsage(prompt_tokens=3, completion_tokens=4))
    usage = await read_usage(gateway_redis, kid, days=1)
    assert usage["completion_tokens"] == 4
    assert (await keys.update_key(gateway_redis, kid, {"rpm": 20})) is not None
    assert len(await keys.list_keys(gateway_redis)) == 1
    rotated = await keys.rotate_key(gateway_redis, kid)
    assert rotated is not None and await keys.revoke_key(gateway_redis, keys.key_id(rotated))
    responses = ResponseStore(gateway_redis, ttl_s=60, retry_after_s=1)
    stored = StoredResponse(
        response={"id": "resp_1", "output": []}, input=[], context=[], session=""
    )
    await responses.save(kid, stored)
    assert await responses.load(kid, "resp_1") == stored
    assert await responses.delete(kid, "resp_1")


async def test_the_gateway_serves_the_console_and_records_recent_requests(
    gateway_redis, router_redis
):
    config = ConsoleSection(sign_in_failures_free=1, sign_in_max_delay_s=0.2)
    await session.count_failure(gateway_redis, config, "10.0.0.1")
    await session.wait_out_failures(gateway_redis, config, "10.0.0.1")  # a free failure
    await session.count_failure(gateway_redis, config, "10.0.0.1")
    waiting = asyncio.create_task(session.wait_out_failures(gateway_redis, config, "10.0.0.1"))
    await asyncio.sleep(0.05)  # the wait claimed; another sign-in meanwhile is refused
    with pytest.raises(session.SignInPending):
        await session.wait_out_failures(gateway_redis, config, "10.0.0.1")
    await waiting
    await session.forget_failures(gateway_redis, "10.0.0.1")
    response = web.Response()
    await session.start(gateway_redis, config, make_mocked_request("POST", "/"), response)
    signed_in = make_mocked_request(
        "GET", "/", headers={"Cookie": f"{session.COOKIE}={response.cookies[session.COOKIE].value}"}
    )
    found = await session.find(gateway_redis, signed_in)
    assert found is not None
    await session.end(gateway_redis, found, response)

    kid = keys.key_id(await keys.create_key(gateway_redis, "acl"))
    recent = RecentRequests(gateway_redis, config)
    entry = RecentRequest(
        1.0, kid, "acl", "/v1/chat/completions", "m", 200, 3, 0, 4, 12, 20, "", "r"
    )
    recent.record(entry)
    await recent.drain()
    assert await recent.read(kid, 10) == [entry] == await recent.read(None, 10)

    owner = identity_owner(role_uri("client", "billing"))
    await count_usage(router_redis, owner, common_pb2.Usage(prompt_tokens=3))
    key_usage, caller_usage = await read_all(gateway_redis, 1)
    assert [u.id for u in key_usage] == [kid] and [u.id for u in caller_usage] == [owner]


async def test_the_router_keeps_its_registry(acl_redis):
    registry = Registry(
        RedisSection(url=url_of(acl_redis, "router"), timeout_s=2.0),
        RegistrySection(heartbeat_interval_s=0.1, ttl_s=3.0, refresh_s=0.05),
        Fleet(ttl_s=3.0),
    )
    try:
        await registry.register(info("w1"), common_pb2.Load())
        assert await registry.heartbeat("w1", common_pb2.Load(running=1))
        await registry.refresh()
        assert registry.available and [e.worker_id for e in registry.fleet.entries()] == ["w1"]
    finally:
        await registry.close()


async def test_the_router_counts_its_internal_callers_usage_and_no_keys(
    router_redis, gateway_redis
):
    owner = identity_owner(role_uri("client", "billing"))
    await count_usage(router_redis, owner, common_pb2.Usage(prompt_tokens=3, completion_tokens=2))
    # the admin API, on the gateway, reads it
    assert (await read_usage(gateway_redis, owner, 1))["completion_tokens"] == 2
    with pytest.raises(NoPermissionError):
        await count_usage(router_redis, keys.key_id("sk-a key"), common_pb2.Usage(prompt_tokens=1))


@pytest.mark.parametrize(
    "user, command",
    [
        ("gateway", ("HGETALL", "{infermesh:router:}worker:w1")),  # the router's registry
        ("gateway", ("GET", "other-app:session")),
        ("gateway", ("KEYS", "*")),
        ("gateway", ("FLUSHALL",)),
        ("gateway", ("CONFIG", "GET", "*")),
        ("gateway", ("SCRIPT", "FLUSH")),
        ("router", ("HGETALL", "infermesh:key:{abc}")),  # API keys
        ("router", ("SMEMBERS", "infermesh:keys")),
        ("router", ("SET", "{infermesh:router:}x", "1")),  # its keys, a command it never sends
        ("router", ("ACL", "LIST")),
    ],
)
async def test_each_user_is_refused_what_is_not_its_own(acl_redis, user, command):
    client = redis.Redis.from_url(url_of(acl_redis, user))
    try:
        with pytest.raises(NoPermissionError):
            await client.execute_command(*command)
    finally:
        await client.aclose()


async def test_a_script_cannot_reach_keys_its_user_may_not(router_redis):
    with pytest.raises(NoPermissionError):
        await router_redis.eval("return redis.call('HGETALL', KEYS[1])", 1, "infermesh:key:{a}")


async def test_without_credentials_only_ping_answers(acl_redis):
    client = redis.Redis(port=acl_redis.port)
    try:
        assert await client.ping()
        with pytest.raises(NoPermissionError):
            await client.get("infermesh:keys")
    finally:
        await client.aclose()
