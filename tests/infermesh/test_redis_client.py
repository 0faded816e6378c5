"""Redis URLs: one server, Redis Cluster and Sentinel; a bad one is refused by name, never
with its password. A Redis that stops answering fails a call within the timeout."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.exceptions

from gateway.config import GatewayConfig
from infermesh.config import ConfigError, load_config
from infermesh.redis_client import RedisUrlError, parse_redis_url, redis_client
from router_svc.config import RouterConfig


def test_a_cluster_url_lists_its_seed_nodes_and_credentials():
    target = parse_redis_url("redis+cluster://app:s%40cret@10.0.0.1:7000,10.0.0.2")
    assert target.mode == "cluster"
    assert target.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379))
    assert (target.username, target.password) == ("app", "s@cret")
    assert "s@cret" not in target.where() and "s%40cret" not in target.where()


def test_a_sentinel_url_names_its_service_and_database():
    target = parse_redis_url("redis+sentinel://:pw@s1:26380,s2/mymaster/2")
    assert (target.mode, target.service, target.db) == ("sentinel", "mymaster", 2)
    assert target.nodes == (("s1", 26380), ("s2", 26379))
    assert (target.username, target.password) == (None, "pw")
    assert parse_redis_url("redis+sentinel://s1/mymaster").db == 0


def test_a_tls_url_of_a_cluster_or_sentinel_carries_its_tls_options():
    target = parse_redis_url("rediss+cluster://:pw@h1:7000?ssl_ca_certs=/tls/ca.crt")
    assert (target.mode, target.nodes, target.tls) == (
        "cluster",
        (("h1", 7000),),
        (("ssl_ca_certs", "/tls/ca.crt"),),
    )
    target = parse_redis_url("rediss+sentinel://s1/svc/1?ssl_certfile=c&ssl_keyfile=k")
    assert (target.service, target.db) == ("svc", 1)
    assert target.tls == (("ssl_certfile", "c"), ("ssl_keyfile", "k"))
    assert parse_redis_url("rediss+cluster://h1").tls == ()
    assert parse_redis_url("redis+cluster://h1").tls is None


def test_single_server_urls_pass_through():
    for url in ("redis://:pw@host:6380/1", "rediss://host", "unix:///run/redis.sock"):
        target = parse_redis_url(url)
        assert target.mode == "single" and target.url == url
    assert parse_redis_url("redis://:pw@host:6380/1").where() == "host:6380/1"


@pytest.mark.parametrize(
    "url, says",
    [
        ("http://:secret@host", "expected one of"),
        ("secret@host:6379", "no scheme"),
        ("redis+cluster://:secret@h1:7000/0", "takes no path"),
        ("redis+cluster://:secret@h1:port", "port is not a number"),
        ("redis+cluster://:secret@h1:70000", "port is not a number"),
        ("redis+cluster://:secret@h1:7000,,h2", "is not host"),
        ("redis+sentinel://:secret@s1:26379", "needs /service"),
        ("redis+sentinel://:secret@s1/svc/x", "is not a number"),
        ("redis+sentinel://:secret@s1/svc/1/2", "needs /service"),
        ("rediss+cluster://:secret@h1?ssl=false", "unknown option 'ssl'"),
        ("redis+cluster://:secret@h1?ssl_ca_certs=/ca", "use rediss\\+cluster://"),
    ],
)
def test_a_bad_url_is_refused_by_what_is_wrong_without_its_password(url, says):
    with pytest.raises(RedisUrlError, match=says) as info:
        parse_redis_url(url)
    assert "secret" not in str(info.value)


@pytest.mark.parametrize(
    "config, prefix", [(GatewayConfig, "INFERMESH_GATEWAY"), (RouterConfig, "INFERMESH_ROUTER")]
)
def test_services_refuse_a_bad_redis_url_at_start(config, prefix):
    with pytest.raises(ConfigError, match=r"redis.*url: a redis\+cluster:// URL takes no path"):
        load_config(
            config,
            None,
            prefix.lower(),
            {f"{prefix}_REDIS_URL": "redis+cluster://:secret@h1:7000/0"},
        )
    loaded = load_config(
        config, None, prefix.lower(), {f"{prefix}_REDIS_URL": "redis+sentinel://s1,s2/infermesh"}
    )
    assert loaded.redis.url == "redis+sentinel://s1,s2/infermesh"


def test_the_registry_prefix_is_a_hash_tag_so_it_takes_no_braces():
    with pytest.raises(ConfigError, match="key_prefix: must be non-empty without braces"):
        load_config(
            RouterConfig,
            None,
            "infermesh_router",
            {"INFERMESH_ROUTER_REDIS_KEY_PREFIX": "mesh{a}:"},
        )


async def test_a_redis_that_stops_answering_fails_a_call_within_one_timeout_not_two():
    """A peer that takes connections and never answers: a Redis cut off the network without a
    reset, as the kernel still completes a handshake for a frozen one. A timeout is not retried
    (a reset connection is: see redis_client)."""
    held: list[asyncio.StreamWriter] = []

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = redis_client(f"redis://127.0.0.1:{port}/0", timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(redis.exceptions.TimeoutError):
        await client.get("k")
    elapsed = time.monotonic() - started
    await client.aclose()
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()
    assert 0.3 <= elapsed < 0.5, elapsed  # one wait: two would be 0.6 s
