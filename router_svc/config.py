"""Router configuration: ``[server]``, ``[redis]``, ``[registry]``, ``[routing]``,
``[fair_queue]``, ``[internal_callers]``, ``[metrics]``
and ``[tls]`` (``infermesh.tls``) sections."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from infermesh.config import MetricsSection, load_config, section
from infermesh.redis_client import check_redis_url
from infermesh.tls import TlsSection

Policy = Literal["balanced", "least_load", "round_robin", "random"]
PhaseSplit = Literal["cost", "always", "conditional", "never"]

# The bounds of a request's fair-queue weight (0: its tier's) and priority, as the gateway's
# admin API and request validation take them; past them a request is INVALID_ARGUMENT.
MAX_WEIGHT = 1000
PRIORITIES = range(-10, 11)


@section
class RouterServerSection:
    # The address the router's gRPC server listens on.
    host: str = "127.0.0.1"
    # The router's gRPC port.
    port: int = 50051


@section
class RedisSection:
    """Where the shared worker registry lives; every router of a mesh points at the same one.
    ``url``: one server (``redis://``, ``rediss://``, ``unix://``), a Redis Cluster
    (``redis+cluster://host:port,...``) or Sentinel (``redis+sentinel://host:port,.../service``),
    over TLS as ``rediss+cluster://`` and ``rediss+sentinel://``, see ``infermesh.redis_client``."""

    RENAMED = {"timeout_ms": "timeout_s (seconds)"}

    # The registry's Redis (the forms are the section's description above).
    url: str = "redis://127.0.0.1:6379/0"

    timeout_s: float = 0.5  # per Redis call; past it the registry counts as unreachable
    # Namespace of the registry's keys: the routers of one mesh share it; separate meshes on
    # one Redis use different ones. It is the registry's hash tag, so no braces.
    key_prefix: str = "infermesh:router:"

    def __post_init__(self) -> None:
        check_redis_url(self.url)
        if not self.key_prefix or "{" in self.key_prefix or "}" in self.key_prefix:
            raise ValueError(
                f"key_prefix: must be non-empty without braces, got {self.key_prefix!r}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be positive, got {self.timeout_s}")


@section
class RegistrySection:
    RENAMED = {
        "heartbeat_interval_ms": "heartbeat_interval_s (seconds)",
        "ttl_ms": "ttl_s (seconds)",
        "refresh_ms": "refresh_s (seconds)",
    }
    # How often each worker heartbeats its load (told to it when it registers).
    heartbeat_interval_s: float = 1.0
    ttl_s: float = 3.0  # a worker silent this long is dropped
    # How often this router re-reads the registry from Redis into its local view, which is
    # what every routing decision reads.
    refresh_s: float = 0.25

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0 or self.ttl_s <= self.heartbeat_interval_s:
            raise ValueError("need 0 < heartbeat_interval_s < ttl_s")
        if not 0 < self.refresh_s < self.ttl_s:
            raise ValueError("need 0 < refresh_s < ttl_s")

    @property
    def ttl_ms(self) -> int:
        """The TTL as Redis's PEXPIRE takes it."""
        return round(self.ttl_s * 1000)


@section
class RoutingSection:
    """The worker choice. ``balanced`` ranks by one weighted cost (lower is better):
    ``load_weight`` x (busy + 1) / max_parallel, and then

    - for a request with ``prefix_hashes``: + ``prefill_weight`` x seconds: the prefill this
      router has already queued on the worker and it has not finished by the estimate (the wait
      before the request's own), plus the request's own prefill there, (prompt tokens - tokens of
      the prompt's prefix its cache holds, as the workers' cache events say) / its prefill tokens
      per second, times the streams that wait for it (busy + 1: the request's own and those it
      stalls there); for a request with thinking on, or to a model that always thinks (R1),
      whose output may be long, + ``hardware_weight`` x (1 - decode speed / fastest
      candidate's) as well;
    - otherwise: + ``kv_weight`` x KV cache use + ``hardware_weight`` x (1 - decode speed /
      fastest candidate's) - ``affinity_weight`` if the worker is the home of the prompt's
      leading ``prefix_bytes`` (rendezvous hashing, bounded by ``affinity_load_factor`` x the
      worker's capacity-weighted fair share of the busy slots).

    ``index_max_blocks`` bounds how many cached blocks the router remembers per worker,
    ``index_max_probes`` the dict probes of one lookup (router_svc/prefix_index.py);
    ``cache_events = false`` subscribes to no worker's cache events (the index stays empty)."""

    RENAMED = {
        "eject_cooldown_ms": "eject_cooldown_s (seconds)",
        "stall_timeout_ms": "stall_timeout_s (seconds)",
    }

    # balanced: the weighted cost above; least_load: the lowest share of busy slots;
    # round_robin: the eligible workers in turn; random: any eligible one (a baseline).
    policy: Policy = "balanced"
    # Before the first token, a failed worker call is retried once elsewhere.
    retry_before_first_token: bool = True
    # The weight of a worker's busy slots over its max_parallel.
    load_weight: float = 1.0
    # The weight of a worker's KV cache use (0..1), for a request without prefix_hashes.
    kv_weight: float = 0.5
    # The weight of a worker's slowness: 1 - its decode speed over the fastest candidate's.
    hardware_weight: float = 0.5
    # The bonus of the worker that is home to the prompt's leading prefix_bytes.
    affinity_weight: float = 0.5
    # per second of prefill a worker would still have to do for the prompt, per stream waiting
    # for it (and per second of prefill queued ahead of it): one second of one stream weighs as
    # much as a full worker's load
    prefill_weight: float = 1.0
    # Subscribe to every worker's Worker.CacheEvents, to route by cached prefixes.
    cache_events: bool = True
    # cached blocks the index remembers per worker: 2**16 of 16 tokens hold a million tokens
    index_max_blocks: int = 65536
    # dict probes a prefix lookup may spend (past them, shallower prefixes are counted short)
    index_max_probes: int = 32
    # The prefix index's lookup: "compiled" (router_svc/_prefix_probe.c, built by `make native`;
    # a router that cannot load it refuses to start) or "python" (the reference, slower).
    index: Literal["compiled", "python"] = "compiled"
    prefix_bytes: int = 256  # leading prompt bytes whose hash is the prefix affinity key
    # Bounded-load consistent hashing: a prefix's home takes at most this factor of its fair share.
    affinity_load_factor: float = 1.25
    failures_to_eject: int = 3  # consecutive failed calls that eject a worker
    eject_cooldown_s: float = 10.0  # how long an ejected worker gets no traffic
    # Relayed streams: the longest silence of a worker's stream after its first chunk;
    # past it the worker has failed (stuck) and the stream ends with an error. (A frozen
    # worker is noticed sooner by the channel's keepalive pings, see infermesh.channels.)
    stall_timeout_s: float = 30.0
    # The link between workers, Gb/s: a request's worker pulls a longer cached prefix of its
    # prompt from a full peer when sending it is estimated faster than computing it
    # (router_svc/kv_pull.py); 0: never. This is the link between two workers of one zone
    # ([worker] zone), or of none. Once a worker has measured its pulls from a peer (reported on
    # its heartbeats), that pair is priced by the measured rate instead.
    link_gbps: float = 0.0
    # The links across zones, Gb/s, by the two zones' names in either order:
    # {"rack-a/rack-b" = 25}. Two zones not listed have no link: no KV cache moves between them.
    zone_link_gbps: dict[str, float] = dataclasses.field(default_factory=dict)
    # The inter-token objective (a p99), seconds: a request's phases are split (prefilled on
    # another worker) only when serving it aggregated would stall the streams decoding on its
    # worker past it, and the split's first token comes no later (router_svc/phases.py).
    inter_token_objective_s: float = 0.1
    # When a request's phases are split (router_svc/phases.py): "cost" (the rule above),
    # "always" (whenever a prefill worker can take it), "conditional" (Dynamo's rule: when the
    # part the worker lacks is at least 2,048 tokens and 0.7 of the prompt and the prefill
    # worker has nothing queued), "never" (aggregated); the last three are baselines to compare.
    phase_split: PhaseSplit = "cost"

    def __post_init__(self) -> None:
        weights = (
            self.load_weight,
            self.kv_weight,
            self.hardware_weight,
            self.affinity_weight,
            self.prefill_weight,
        )
        if any(w < 0 for w in weights):
            raise ValueError("the *_weight keys must be >= 0")
        if self.prefix_bytes < 1 or self.affinity_load_factor < 1:
            raise ValueError("need prefix_bytes >= 1 and affinity_load_factor >= 1")
        if self.failures_to_eject < 1 or self.eject_cooldown_s < 0:
            raise ValueError("need failures_to_eject >= 1 and eject_cooldown_s >= 0")
        for key in ("index_max_blocks", "index_max_probes"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s: must be positive, got {self.stall_timeout_s}")
        if self.inter_token_objective_s <= 0:
            raise ValueError(
                f"inter_token_objective_s: must be positive, got {self.inter_token_objective_s}"
            )
        if self.link_gbps < 0:
            raise ValueError(f"link_gbps: must be >= 0, got {self.link_gbps}")
        for pair, gbps in self.zone_link_gbps.items():
            zones = pair.split("/")
            if len(zones) != 2 or not all(zones) or zones[0] == zones[1]:
                raise ValueError(
                    f"zone_link_gbps.{pair}: name two different zones as 'a/b', got {pair!r}"
                )
            if f"{zones[1]}/{zones[0]}" in self.zone_link_gbps:
                raise ValueError(f"zone_link_gbps.{pair}: the link is given twice, both ways")
            if isinstance(gbps, bool) or not isinstance(gbps, int | float) or gbps < 0:
                raise ValueError(f"zone_link_gbps.{pair}: must be a number >= 0, got {gbps!r}")

    @property
    def moves_kv(self) -> bool:
        """Whether any link is set: without one, no cached prefix is pulled from a peer."""
        return self.link_gbps > 0 or any(self.zone_link_gbps.values())

    def link_between(self, zone: str, other: str) -> float:
        """The link's Gb/s between a worker of ``zone`` and one of ``other`` (0: none)."""
        if zone == other:
            return self.link_gbps
        links = self.zone_link_gbps
        return float(links.get(f"{zone}/{other}", links.get(f"{other}/{zone}", 0.0)))


@section
class FairQueueSection:
    """Fair queueing when every eligible worker is full (router_svc/fair_queue.py): asks wait
    in per-tenant queues instead of going to a worker past its max_parallel."""

    # true: asks wait in the fair queue while every eligible worker is full; false: the policy
    # places every ask at once, on a full worker too.
    enabled: bool = False
    max_per_tenant: int = 256  # waiting asks of one tenant; past it RESOURCE_EXHAUSTED (429)
    max_total: int = 4096  # waiting asks in all; past it UNAVAILABLE (503)
    # The longest wait in the queue (an ask's own deadline may be shorter); past it UNAVAILABLE.
    max_wait_s: float = 30.0
    # The retry-after of a refusal before the router has measured its service rate.
    default_retry_after_ms: int = 1000
    # The weight of a request that names none (an API key without its own), by its tier:
    # {"gold" = 4, "free" = 1}; a tier not listed weighs 1.
    tier_weights: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_per_tenant < 1 or self.max_total < self.max_per_tenant:
            raise ValueError("need 1 <= max_per_tenant <= max_total")
        if self.max_wait_s <= 0:
            raise ValueError(f"max_wait_s: must be positive, got {self.max_wait_s}")
        if self.default_retry_after_ms < 1:
            raise ValueError(
                f"default_retry_after_ms: must be >= 1, got {self.default_retry_after_ms}"
            )
        for tier, weight in self.tier_weights.items():
            _check_weight(f"tier_weights.{tier}", weight)


def _check_weight(key: str, weight: object) -> None:
    if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= MAX_WEIGHT:
        raise ValueError(f"{key}: must be an integer 1..{MAX_WEIGHT}, got {weight!r}")


@dataclasses.dataclass(frozen=True)
class Standing:
    """An internal caller's place in the fair queue: its tier, weight and priority."""

    tier: str
    weight: int
    priority: int


@section
class InternalCallersSection:
    """The fair-queue standing of internal callers (a client certificate's identity, which is
    also their tenant): ``tier``, ``weight`` and ``priority`` for every one, and per identity in
    ``identities``, keyed by the certificate's identity without ``spiffe://infermesh/``:
    ``{"client/batch-jobs" = {tier = "batch", weight = 1, priority = -5}}`` (a key left out: the
    defaults). What such a caller's request says of them is ignored: holding the client
    certificate grants no more than this table does."""

    # The tier of an internal caller not in identities (its tier_weights weight applies).
    tier: str = "internal"
    # The fair-queue weight of an internal caller not in identities (1..1000).
    weight: int = 1
    # The priority of an internal caller not in identities (-10..10; higher goes first).
    priority: int = 0
    # Identity -> its own {tier, weight, priority}, each key left out taking the defaults above.
    identities: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check("", {"tier": self.tier, "weight": self.weight, "priority": self.priority})
        for identity, standing in self.identities.items():
            if not isinstance(standing, dict):
                raise ValueError(f"identities.{identity}: expected a table, got {standing!r}")
            self._check(f"identities.{identity}.", standing)

    @staticmethod
    def _check(where: str, standing: dict[str, Any]) -> None:
        unknown = set(standing) - {"tier", "weight", "priority"}
        if unknown:
            raise ValueError(
                f"{where}{sorted(unknown)[0]}: unknown key; known: priority, tier, weight"
            )
        if "tier" in standing and (not isinstance(standing["tier"], str) or not standing["tier"]):
            raise ValueError(f"{where}tier: must be a non-empty string, got {standing['tier']!r}")
        if "weight" in standing:
            _check_weight(f"{where}weight", standing["weight"])
        priority = standing.get("priority", 0)
        if (
            not isinstance(priority, int)
            or isinstance(priority, bool)
            or priority not in PRIORITIES
        ):
            raise ValueError(
                f"{where}priority: must be an integer {PRIORITIES[0]}..{PRIORITIES[-1]}, "
                f"got {priority!r}"
            )

    def standing(self, identity: str) -> Standing:
        """The standing of the caller whose certificate names ``identity`` (``client/NAME``)."""
        own = self.identities.get(identity, {})
        return Standing(
            tier=own.get("tier", self.tier),
            weight=own.get("weight", self.weight),
            priority=own.get("priority", self.priority),
        )


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    server: RouterServerSection = dataclasses.field(default_factory=RouterServerSection)
    redis: RedisSection = dataclasses.field(default_factory=RedisSection)
    registry: RegistrySection = dataclasses.field(default_factory=RegistrySection)
    routing: RoutingSection = dataclasses.field(default_factory=RoutingSection)
    fair_queue: FairQueueSection = dataclasses.field(default_factory=FairQueueSection)
    internal_callers: InternalCallersSection = dataclasses.field(
        default_factory=InternalCallersSection
    )
    metrics: MetricsSection = dataclasses.field(default_factory=MetricsSection)
    tls: TlsSection = dataclasses.field(default_factory=TlsSection)


def load(path: str | None) -> RouterConfig:
    return load_config(RouterConfig, path, "infermesh_router")
