"""The gateway's one config object: ``[server]``, ``[redis]``, ``[router]``, ``[limits]``,
``[admin]``, ``[console]``, ``[models]``, ``[responses]``, ``[files]`` and ``[batches]``.

Built once by ``python -m gateway`` with
``load_config(GatewayConfig, path, "infermesh_gateway")``; every key can be
overridden as ``INFERMESH_GATEWAY_<SECTION>_<KEY>``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import re

from aiohttp import web

from infermesh.channels import GRPC_MESSAGE_LIMIT_BYTES
from infermesh.config import MetricsSection, section
from infermesh.redact import redact_url
from infermesh.redis_client import check_redis_url
from infermesh.tls import TlsSection

# A route ask holds the prompt's text (at most the body's bytes), its token ids (up to 5 bytes
# each, a token per byte at worst) and a block hash per 16 tokens: under 7 bytes a body byte.
MAX_BODY_BYTES = GRPC_MESSAGE_LIMIT_BYTES // 8


@section
class HttpServerSection:
    # The address the HTTP API listens on ("0.0.0.0": every interface).
    host: str = "127.0.0.1"
    # The HTTP API's port; 0: any free port (one process only).
    port: int = 8000
    # The largest request body accepted; a larger one is a 413. At most an eighth of the mesh's
    # gRPC message limit, so that a request's route ask fits one message.
    max_body_bytes: int = 4 * 1024 * 1024
    # A second base path serving the same API as /v1, e.g. "/api"; empty: none.
    alias_base: str = ""
    # A client slower than these gets a 408 and its connection closed, so slow or stalled
    # senders cannot hold connections: from a request's first byte to its last header,
    # and for its body once the handler reads it.
    header_timeout_s: float = 15.0
    # The longest wait for a request's whole body once the handler reads it (408 past it).
    body_timeout_s: float = 60.0
    # An idle keep-alive connection is closed after this long (no answer: nothing was asked).
    keepalive_timeout_s: float = 75.0
    # Gateway processes sharing the port (SO_REUSEPORT; the kernel spreads connections), so
    # that one gateway uses every core; each keeps its own streams to router and workers.
    processes: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if self.processes < 1:
            raise ValueError(f"processes must be >= 1, got {self.processes}")
        if self.processes > 1 and self.port == 0:
            raise ValueError("processes > 1 needs a fixed port, not 0")
        if not 1024 <= self.max_body_bytes <= MAX_BODY_BYTES:
            raise ValueError(
                f"max_body_bytes must be 1024..{MAX_BODY_BYTES}, got {self.max_body_bytes}: a "
                "request's route ask (its text, token ids and block hashes) must fit the mesh's "
                f"gRPC message limit of {GRPC_MESSAGE_LIMIT_BYTES} bytes"
            )
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.alias_base and (
            not re.fullmatch(r"(/[A-Za-z0-9._-]+)+", self.alias_base)
            or self.alias_base in ("/v1", "/admin", "/console")
        ):
            raise ValueError(
                f"alias_base must be a path such as /api (not /v1, /admin or /console), "
                f"got {self.alias_base!r}"
            )


@section
class RedisSection:
    # One server (redis://, rediss://, unix://), a Redis Cluster (redis+cluster://host:port,...)
    # or Sentinel (redis+sentinel://host:port,.../service), over TLS as rediss+cluster:// and
    # rediss+sentinel://: see infermesh.redis_client.
    RENAMED = {"key_cache_ttl_ms": "key_cache_ttl_s (seconds)"}

    # Where API keys, limits, usage, sessions, recent requests and stored responses live.
    url: str = "redis://127.0.0.1:6379/0"
    # Positive authentications are cached this long; a revoked key keeps
    # working in this process for at most this time.
    key_cache_ttl_s: float = 1.0
    # Bounds every Redis call so an unreachable Redis answers 503 quickly; also how long a
    # request waits for a free connection when all max_connections are busy.
    timeout_s: float = 1.0
    # The Retry-After (seconds) of the 503 a request gets while Redis is unreachable.
    retry_after_s: int = 1
    # Connections to Redis per gateway process; a request past them waits (timeout_s).
    max_connections: int = 100

    def __post_init__(self) -> None:
        check_redis_url(self.url)
        if not 0 <= self.key_cache_ttl_s <= 1:  # revocation must reach every process in 1 s
            raise ValueError(f"key_cache_ttl_s must be 0..1, got {self.key_cache_ttl_s}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


@section
class RouterSection:
    """Every generation is routed on one long-lived Router.RouteStream per process and served
    over long-lived Worker.Serve streams to the chosen worker (gateway.mesh.client)."""

    REMOVED = {
        "relay": "every request is routed on the route stream and served by the chosen worker",
        "streams": "every request travels the long-lived route and Serve streams",
    }

    # The router's gRPC target. Several routers of one mesh (active-active on one registry):
    # "ipv4:10.0.0.5:50051,10.0.0.6:50051", or a DNS name that resolves to each
    # ("dns:///routers:50051"); calls go round robin to the routers whose health check says
    # SERVING (one cut from its registry in Redis says NOT_SERVING and ends its route streams),
    # and a request whose route ask a failed router never answered is asked again.
    address: str = "127.0.0.1:50051"
    # Deadline of a whole generation, first token to last.
    request_timeout_s: float = 600.0
    # How long a request waits for a connection to the router before a 503.
    connect_timeout_s: float = 2.0
    # Deadline of the small calls (ListModels, Tokenize) and of a route decision.
    control_timeout_s: float = 5.0
    # The longest silence of a worker's stream after its first chunk: past it the worker
    # counts as failed (stuck) and the stream ends with an error event, the failure
    # reported to the router. (Before the first chunk silence is queueing or prefill; a
    # frozen worker is noticed by the channel's keepalive pings, see infermesh.channels.)
    stall_timeout_s: float = 30.0
    # The Retry-After (seconds) of a 503 when the router or every worker is unreachable, or the
    # router refused a request without an estimate of its own (its fair queue's).
    retry_after_s: int = 1
    # Streams per worker; more than one where one stream's flow-control window limits.
    streams_per_worker: int = 1
    # A request's chunks its client has not read yet, at most; past them (a client reading
    # slower than the worker writes) the request ends with an error, the others go on.
    stream_buffer_chunks: int = 4096
    # true: the gateway renders and tokenizes each prompt with its model's tokenizer (fetched
    # from a worker, Worker.TextFiles) and sends the ids and their prefix hashes, so the router
    # routes by cached prefixes and the worker does not tokenize again (infermesh.prompt_tokens)
    prompt_tokens: bool = True
    # How often the gateway asks the router which tokenizer each model's workers have.
    tokenizer_refresh_s: float = 10.0

    def __post_init__(self) -> None:
        for name in (
            "request_timeout_s",
            "connect_timeout_s",
            "control_timeout_s",
            "stall_timeout_s",
            "tokenizer_refresh_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("streams_per_worker", "stream_buffer_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@section
class LimitsSection:
    # Tokens reserved for the completion of a request without max_tokens; the
    # reservation is settled to the real usage when the request ends.
    default_completion_reserve: int = 256
    # A concurrency slot of a gateway that died is freed after this long; live
    # gateways renew theirs every third of it.
    lease_ttl_s: float = 30.0
    # Settlements (usage to record) that failed while Redis was unreachable wait in memory,
    # about 1 KB each, and are retried when it is back; past this many the oldest are
    # dropped (metric infermesh_usage_settlements_dropped_total, logged).
    settle_retry_max: int = 100_000

    def __post_init__(self) -> None:
        if self.default_completion_reserve < 0:
            raise ValueError(
                f"default_completion_reserve must be >= 0, got {self.default_completion_reserve}"
            )
        if self.lease_ttl_s < 1:
            raise ValueError(f"lease_ttl_s must be >= 1, got {self.lease_ttl_s}")
        if self.settle_retry_max < 0:
            raise ValueError(f"settle_retry_max must be >= 0, got {self.settle_retry_max}")


@section
class AdminSection:
    """The admin API (/admin/keys) credential: the token itself, or better its SHA-256 hex.
    With neither set the admin API refuses every call."""

    # The admin token itself (at least 16 characters).
    token: str = ""
    # The admin token's SHA-256, 64 lowercase hex digits: the token never written to the file.
    token_sha256: str = ""

    def __post_init__(self) -> None:
        if self.token and self.token_sha256:
            raise ValueError("set token or token_sha256, not both")
        if self.token and len(self.token) < 16:
            raise ValueError("token must be at least 16 characters")
        if self.token_sha256 and not re.fullmatch(r"[0-9a-f]{64}", self.token_sha256):
            raise ValueError("token_sha256 must be 64 lowercase hex digits")

    def digest(self) -> str | None:
        """SHA-256 hex of the admin token; None when the admin API is off."""
        if self.token:
            return hashlib.sha256(self.token.encode()).hexdigest()
        return self.token_sha256 or None


@section
class ConsoleSection:
    """The operator's console (``/console``, gateway.console), served by a gateway with the admin
    credential only, and the recent requests every gateway records for it."""

    # A sign-in lasts this long (the session cookie's and the Redis session's lifetime).
    session_ttl_s: int = 8 * 3600
    # The session cookie is Secure (sent over HTTPS only) when the request came over TLS or a
    # proxy says so (X-Forwarded-Proto: https); true: always, for a proxy that says nothing.
    secure_cookie: bool = False
    # Wrong admin tokens at sign-in from one address past this many (within the window) make each
    # further sign-in from it wait, doubling per failure up to max_delay_s.
    sign_in_failures_free: int = 3
    # How long an address's failed sign-ins count against it.
    sign_in_failure_window_s: int = 900
    # The longest wait a failed sign-in from one address imposes on the next.
    sign_in_max_delay_s: float = 30.0
    # Trace ids link to this Jaeger UI ("http://jaeger:16686"); empty: shown without a link.
    jaeger_url: str = ""
    # The router's /metrics ("http://router:9101/metrics"): the Fleet page shows its cache hits
    # and fair queue from it; empty: not shown.
    router_metrics_url: str = ""
    # The recent requests kept per API key (a capped Redis stream each).
    recent_per_key: int = 100
    # The recent requests kept of all keys together (one capped Redis stream).
    recent_total: int = 1000

    def __post_init__(self) -> None:
        for name in ("session_ttl_s", "sign_in_failure_window_s", "recent_per_key", "recent_total"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sign_in_failures_free < 0 or self.sign_in_max_delay_s < 0:
            raise ValueError("sign_in_failures_free and sign_in_max_delay_s must be >= 0")
        for name in ("jaeger_url", "router_metrics_url"):
            url = getattr(self, name)
            if url and not re.fullmatch(r"https?://[^\s]+", url):
                raise ValueError(f"{name} must be an http(s) URL, got {redact_url(url)!r}")


@section
class ModelsSection:
    """Other names clients may ask for, each standing for a served model: exact names or glob
    patterns (``"claude-*"``), tried exact names first, then patterns in order. An agent's
    default model name (Claude Code's ``claude-...``, Codex's ``gpt-...``) then works without
    configuring the client."""

    # Alias (an exact name or a glob pattern) -> the served model it stands for:
    # {"claude-*" = "deepseek-v3"}. Listed by /v1/models apart from the models (docs/API.md).
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for alias, target in self.aliases.items():
            if not alias or not isinstance(target, str) or not target:
                raise ValueError(f"aliases: {alias!r} must name a served model, got {target!r}")

    def resolve(self, name: str) -> str:
        """The served model ``name`` stands for (itself when no alias matches)."""
        if name in self.aliases:
            return self.aliases[name]
        return next((t for a, t in self.aliases.items() if fnmatch.fnmatchcase(name, a)), name)


@section
class ResponsesSection:
    # How long a stored response (store: true) can be read and continued from
    # (previous_response_id); OpenAI keeps them 30 days (2592000).
    ttl_s: int = 86400

    def __post_init__(self) -> None:
        if self.ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1, got {self.ttl_s}")


@section
class FilesSection:
    """Uploaded files (``/v1/files``): their bytes in a store, their metadata in Redis."""

    # The local store's directory (created when missing); gateways that share batch work must
    # share it. Empty: infermesh-files under the system's temporary directory.
    directory: str = ""
    # An upload past this many bytes is refused (413); OpenAI's limit is 200 MB.
    max_file_bytes: int = 200 * 1024 * 1024
    # A batch input file past this many lines is refused; OpenAI's limit is 50000.
    max_lines: int = 50_000

    def __post_init__(self) -> None:
        for name in ("max_file_bytes", "max_lines"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@section
class BatchesSection:
    """The batch runner (``/v1/batches``, ``/v1/messages/batches``): every gateway process runs
    lines of every batch, through its own API, at the router's ``batch`` tier."""

    # Lines one gateway process runs at once; interactive requests keep the rest of the fleet.
    # 0: this gateway runs no lines (its batches run on replicas that do), so that live traffic
    # has its CPU to itself.
    concurrency: int = 8
    # The batch lines' fair-queue weight against the keys' interactive traffic (a key's own
    # weight, or its tier's, is usually 1 or more).
    weight: int = 1
    # The fraction of a batch's tokens not billed: 0.5 bills half, as OpenAI's Batch API.
    discount: float = 0.5
    # A batch not done this long after its creation expires ("24h", OpenAI's window).
    completion_window_s: int = 86400
    # A line a gateway claimed is run again by another once its claim is this old unrenewed
    # (the gateway died); live gateways renew theirs every third of it.
    lease_s: float = 30.0
    # How often an idle runner looks for work.
    poll_s: float = 1.0
    # Live requests first: while this process's event loop runs its timers later than this on
    # average (its live requests' chunks wait behind ready work), its runner starts no new line.
    # 0: no bound.
    max_loop_lag_ms: float = 2.0

    def __post_init__(self) -> None:
        if self.max_loop_lag_ms < 0:
            raise ValueError(f"max_loop_lag_ms must be >= 0, got {self.max_loop_lag_ms}")
        if self.concurrency < 0 or self.weight < 1:
            raise ValueError("concurrency must be >= 0 and weight >= 1")
        if not 0 <= self.discount <= 1:
            raise ValueError(f"discount must be 0..1, got {self.discount}")
        if self.completion_window_s < 60:
            raise ValueError(f"completion_window_s must be >= 60, got {self.completion_window_s}")
        if self.lease_s <= 0 or self.poll_s <= 0:
            raise ValueError("lease_s and poll_s must be > 0")


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """Every section of the gateway's config; the app holds it under ``CONFIG``, and every room
    reads its sections from there."""

    server: HttpServerSection = dataclasses.field(default_factory=HttpServerSection)
    redis: RedisSection = dataclasses.field(default_factory=RedisSection)
    router: RouterSection = dataclasses.field(default_factory=RouterSection)
    limits: LimitsSection = dataclasses.field(default_factory=LimitsSection)
    admin: AdminSection = dataclasses.field(default_factory=AdminSection)
    console: ConsoleSection = dataclasses.field(default_factory=ConsoleSection)
    models: ModelsSection = dataclasses.field(default_factory=ModelsSection)
    responses: ResponsesSection = dataclasses.field(default_factory=ResponsesSection)
    files: FilesSection = dataclasses.field(default_factory=FilesSection)
    batches: BatchesSection = dataclasses.field(default_factory=BatchesSection)
    # the side port of every metric, the per-key series too (the API's /metrics has them not)
    metrics: MetricsSection = dataclasses.field(default_factory=MetricsSection)
    tls: TlsSection = dataclasses.field(default_factory=TlsSection)


CONFIG = web.AppKey[GatewayConfig]("config")
