"""Async Redis clients from a URL: one server, a Redis Cluster, or the master that
Redis Sentinel names. The gateway and the router build theirs here.

- ``redis://``, ``rediss://``, ``unix://``: one server (redis-py's URL form).
- ``redis+cluster://[[user]:password@]host:port[,host:port...]``: a Redis Cluster; the
  nodes listed are only where discovery starts, the client follows the cluster's slot
  map (and its changes: failovers, resharding) from there. No database number: a
  cluster has only database 0.
- ``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]``: the
  master that the Sentinels listed name for ``service``; after a failover the client
  reconnects to the new master. The password is the master's; the Sentinels are
  reached without one.
- ``rediss+cluster://`` and ``rediss+sentinel://``: the same over TLS (to every node, and to
  the Sentinels and the master), taking ``ssl_ca_certs``, ``ssl_certfile`` and ``ssl_keyfile``
  in the query as redis-py's ``rediss://`` does; the server's certificate is checked against
  the CA given (else the system's) and its host name.

Every key a Lua script or a transaction of infermesh touches shares one hash slot
(``{...}`` hash tags), so the same code runs on all three.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, TypeAlias, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis.asyncio as redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.connection import HiredisRespSerializer
from redis.exceptions import ConnectionError, RedisClusterException, RedisError

Mode = Literal["single", "cluster", "sentinel"]
# What redis_client returns: a client of one server (also behind Sentinel) or of a cluster.
RedisClient: TypeAlias = redis.Redis | RedisCluster

SCHEMES: dict[str, Mode] = {
    "redis": "single",
    "rediss": "single",
    "unix": "single",
    "redis+cluster": "cluster",
    "redis+sentinel": "sentinel",
    "rediss+cluster": "cluster",
    "rediss+sentinel": "sentinel",
}
# What the query of a rediss+cluster:// or rediss+sentinel:// URL may set (redis-py's names).
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
# What a Redis call can raise when Redis is unreachable or failing over: a cluster client
# also raises RedisClusterException (e.g. a slot no live node serves), not a RedisError.
REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, RedisClusterException)
_DEFAULT_PORT = 6379
_DEFAULT_SENTINEL_PORT = 26379


def decoded(value: bytes | str) -> str:
    """A reply's string, whether or not the client decodes replies (decode_responses)."""
    return value.decode() if isinstance(value, bytes) else value


class RedisUrlError(ValueError):
    """A Redis URL infermesh cannot use; the message never holds its password."""


@dataclasses.dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names, parsed once."""

    mode: Mode
    url: str  # as given; "single" mode passes it to redis-py as it is
    nodes: tuple[tuple[str, int], ...] = ()  # cluster seeds or Sentinels
    service: str = ""  # sentinel: the master's name
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: tuple[tuple[str, str], ...] | None = None  # cluster, sentinel: None, or its options

    def where(self) -> str:
        """host:port list of the URL, never its credentials: for logs and errors."""
        if self.mode == "single":
            parsed = urlsplit(self.url)
            if not parsed.hostname:
                return parsed.path
            return f"{parsed.hostname}:{parsed.port or _DEFAULT_PORT}{parsed.path}"
        host, port = self.nodes[0]
        more = f" (+{len(self.nodes) - 1})" if len(self.nodes) > 1 else ""
        return f"{self.mode} {host}:{port}{more}" + (f" {self.service}" if self.service else "")


def parse_redis_url(url: str) -> RedisTarget:
    """Parses and checks ``url``; raises ``RedisUrlError`` naming what is wrong."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    mode = SCHEMES.get(scheme)
    if mode is None:
        raise RedisUrlError(
            f"expected one of {', '.join(s + '://' for s in SCHEMES)}, "
            f"got {repr(scheme) if scheme else 'no scheme'}"
        )
    if mode == "single":
        return RedisTarget(mode=mode, url=url)
    address, _, query = url.split("://", 1)[1].partition("?")
    netloc, _, rest = address.partition("/")
    credentials, _, hosts = netloc.rpartition("@")
    username, _, password = credentials.partition(":")
    path = [p for p in rest.split("/") if p]
    default_port = _DEFAULT_SENTINEL_PORT if mode == "sentinel" else _DEFAULT_PORT
    target = RedisTarget(
        mode=mode,
        url=url,
        nodes=_nodes(hosts, default_port),
        username=unquote(username) or None,
        password=unquote(password) or None,
        tls=_tls_options(scheme, query),
    )
    if mode == "cluster":
        if path:
            raise RedisUrlError("a redis+cluster:// URL takes no path: a cluster has only db 0")
        return target
    if not path or len(path) > 2:
        raise RedisUrlError("a redis+sentinel:// URL needs /service or /service/db after the hosts")
    if len(path) == 2 and not (path[1].isascii() and path[1].isdigit()):
        raise RedisUrlError(f"database {path[1]!r} is not a number")
    return dataclasses.replace(
        target, service=unquote(path[0]), db=int(path[1]) if len(path) == 2 else 0
    )


def check_redis_url(url: str) -> None:
    """For config sections: raises ValueError (``RedisUrlError``) naming the key at fault."""
    try:
        parse_redis_url(url)
    except RedisUrlError as e:
        raise RedisUrlError(f"url: {e}") from None


def _tls_options(scheme: str, query: str) -> tuple[tuple[str, str], ...] | None:
    options = parse_qsl(query, keep_blank_values=True)
    for name, _ in options:
        if name not in _TLS_OPTIONS:
            raise RedisUrlError(f"unknown option {name!r}: takes only {', '.join(_TLS_OPTIONS)}")
    if not scheme.startswith("rediss"):
        if options:
            raise RedisUrlError(
                f"{options[0][0]} is a TLS option: use {scheme.replace('redis', 'rediss', 1)}://"
            )
        return None
    return tuple(options)


def _nodes(hosts: str, default_port: int) -> tuple[tuple[str, int], ...]:
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":") if ":" in item else (item.strip(), "", "")
        if not host:
            raise RedisUrlError(f"{item!r} is not host or host:port")
        if port and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
            raise RedisUrlError(f"{item!r}: port is not a number in 1..65535")
        nodes.append((host, int(port) if port else default_port))
    return tuple(nodes)


def redis_client(
    url: str, *, timeout_s: float, max_connections: int = 100, retries: bool = True
) -> RedisClient:
    """A client for ``url``. Every call is bounded by ``timeout_s``; a call past
    ``max_connections`` in use waits for one (up to ``timeout_s``) on a single server
    or behind Sentinel; in a cluster the bound is per node and a call past it fails.
    A call that fails on a dead connection is tried once more on a new one: after a Redis
    restart the pool still holds connections to the old process, each of which would
    otherwise fail one call (a settlement run twice counts once: gateway.accounts.limits).
    A call that timed out is not: a Redis that does not answer (cut off the network, no reset)
    would make every call wait twice ``timeout_s``.
    ``retries=False``: a failed call is reported at once; a cluster client always
    retries, as it must to follow redirections and failovers."""
    target = parse_redis_url(url)
    retry_policy = (
        {"retry": Retry(NoBackoff(), 1, supported_errors=(ConnectionError,))}
        if retries
        else {"retry": None}
    )
    sockets = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    tls: dict[str, Any] = {} if target.tls is None else {"ssl": True, **dict(target.tls)}
    if target.mode == "cluster":
        return _RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
            username=target.username,
            password=target.password,
            max_connections=max_connections,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            **tls,
        )
    if target.mode == "sentinel":
        sentinel = Sentinel(list(target.nodes), sentinel_kwargs={**sockets, **tls})
        master: _SentinelMaster = sentinel.master_for(
            target.service,
            redis_class=_SentinelMaster,
            connection_pool_class=_BlockingSentinelPool,
            max_connections=max_connections,
            timeout=timeout_s,
            db=target.db,
            username=target.username,
            password=target.password,
            **sockets,
            **retry_policy,
            **tls,
        )
        pool = master.connection_pool
        pool.connection_class = _packed_in_c(pool.connection_class)
        return master
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=timeout_s, **sockets, **retry_policy
    )
    pool.connection_class = _packed_in_c(pool.connection_class)
    return redis.Redis.from_pool(pool)


class _PackedInC:
    """redis-py's asyncio connections pack each command in Python (~10 µs for an EVALSHA of
    the limits' scripts here); its synchronous client packs with hiredis, the same bytes in
    ~4 µs. The gateway packs two commands per request."""

    _serializer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        return cast(list[bytes], self._serializer.pack(*args))


def _packed_in_c(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    """``connection_class`` (TCP, TLS or Unix socket, as the URL chose) packing with hiredis."""
    return type(connection_class.__name__, (_PackedInC, connection_class), {})


class _RedisCluster(RedisCluster):
    """redis-py's cluster client, with one of its failover races reported as what it is.

    When a master dies, the client drops the connections to it while other calls may be
    writing on them; those calls fail with AttributeError or RuntimeError ("the handler is
    closed") from inside redis-py instead of a ConnectionError (measured with
    bench/redis_failover.py). Raised as ConnectionError, callers treat them as the outage
    they are (503, settlement logged) rather than as a bug (500)."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except (AttributeError, RuntimeError) as e:
            raise ConnectionError(f"connection dropped during a failover: {e}") from e


class _SentinelMaster(redis.Redis):
    """The master's client, which also closes its connections to the Sentinels."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        pool = cast(SentinelConnectionPool, self.connection_pool)  # as master_for built it
        for sentinel in pool.sentinel_manager.sentinels:
            await sentinel.aclose()


class _BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """Sentinel's pool that waits for a free connection (as ``BlockingConnectionPool``)
    instead of failing a call at once when every connection is in use."""
