"""The mesh's Prometheus metrics, defined once for every service.

Names follow the OpenTelemetry GenAI conventions mapped to Prometheus
(``gen_ai.server.time_to_first_token`` → ``gen_ai_server_time_to_first_token_seconds``);
the rest are ``infermesh_*``. Each service serves them on an HTTP side port (``[metrics]
port``); the gateway also at ``/metrics`` on its API port, less ``PER_KEY_FAMILIES``."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

logger = logging.getLogger(__name__)

# Latency buckets spanning a sub-millisecond relay to a long CPU prefill.
_LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)
_TOKEN_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)

REQUESTS = Counter(
    "infermesh_requests",
    "Requests answered, by service, model and status",
    ["service", "model", "status"],
)
REQUEST_DURATION = Histogram(
    "gen_ai_server_request_duration_seconds",
    "Time from request to last token",
    ["service", "model"],
    buckets=_LATENCY_BUCKETS_S,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "gen_ai_server_time_to_first_token_seconds",
    "Time from request to the first output token",
    ["service", "model"],
    buckets=_LATENCY_BUCKETS_S,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "gen_ai_server_time_per_output_token_seconds",
    "Time between output tokens after the first",
    ["service", "model"],
    buckets=_TOKEN_BUCKETS_S,
)
TOKENS = Counter(
    "infermesh_tokens", "Tokens processed, by type (input or output)", ["service", "model", "type"]
)
# Of the output tokens, those a reasoning model spent thinking (gateway.api.generation), per model
REASONING_TOKENS = Counter(
    "infermesh_reasoning_tokens",
    "Output tokens reasoning models spent thinking, by model (the gateway's count)",
    ["model"],
)
# Per API key by its name, which an operator chose (never the key or its hash): one series per key
# and type, so as many series as keys
KEY_TOKENS = Counter(
    "infermesh_gateway_key_tokens",
    "Tokens the gateway billed per API key, by the key's name and tier, and type (input, output)",
    ["key", "tier", "type"],
)
# Families only the metrics side port serves: who the keys are and how much each uses
PER_KEY_FAMILIES = frozenset({"infermesh_gateway_key_tokens"})
TOKENS_PER_SECOND = Gauge("infermesh_worker_tokens_per_second", "Recent decode rate")
QUEUE_DEPTH = Gauge("infermesh_worker_queue_depth", "Requests waiting for a batch slot")
RUNNING_SEQUENCES = Gauge("infermesh_worker_running_sequences", "Sequences being generated")
KV_CACHE_USAGE = Gauge("infermesh_worker_kv_cache_usage_ratio", "Fraction of KV cache in use")
ASYNCIO_TASKS = Gauge(
    "infermesh_asyncio_tasks",
    "Tasks alive in the service's event loop; growing at a steady load is a leak",
)
RATE_LIMITED = Counter(
    "infermesh_rate_limit_rejections", "Requests refused by a key's limit, by limit", ["limit"]
)
SETTLEMENTS_PENDING = Gauge(
    "infermesh_usage_settlements_pending",
    "Usage settlements that failed and wait for Redis to be retried",
)
SETTLEMENTS_RETRIED = Counter(
    "infermesh_usage_settlements_retried",
    "Usage settlements recorded on a retry, after Redis came back",
)
SETTLEMENTS_DROPPED = Counter(
    "infermesh_usage_settlements_dropped",
    "Usage settlements lost: more than [limits] settle_retry_max waited",
)

# The gateway's long-lived streams (to the router: "router"; to workers: "worker").
STREAMS_OPEN = Gauge(
    "infermesh_gateway_streams_open", "Long-lived gRPC streams open, by peer", ["peer"]
)
STREAM_BREAKS = Counter(
    "infermesh_gateway_stream_breaks",
    "Long-lived streams that ended with requests still open on them (each failed), by peer",
    ["peer"],
)
STREAM_MESSAGES = Counter(
    "infermesh_gateway_stream_messages",
    "Messages on the long-lived streams, by peer and direction (sent, received)",
    ["peer", "direction"],
)
STREAM_REQUESTS_OPEN = Gauge(
    "infermesh_gateway_stream_requests_open", "Requests open on the long-lived worker streams"
)
SLOW_CLIENTS = Counter(
    "infermesh_gateway_slow_clients",
    "Requests ended because their client read more slowly than the worker wrote "
    "(client_too_slow: past [router] stream_buffer_chunks)",
)
GRPC_REFUSED = Counter(
    "infermesh_grpc_refused",
    "gRPC calls refused by the caller check, by service, method and reason "
    "(unauthenticated: no mesh identity; role: the caller's role may not call it; address: a "
    "worker registering an address its certificate does not name)",
    ["service", "method", "reason"],
)

ROUTER_QUEUE_DEPTH = Gauge(
    "infermesh_router_queue_depth",
    "Requests waiting in the router's fair queue for a free worker slot, by the tenant's tier",
    ["tier"],
)
ROUTER_QUEUE_WAIT = Histogram(
    "infermesh_router_queue_wait_seconds",
    "How long requests that got a worker waited in the router's fair queue, by tier",
    ["tier"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
ROUTER_QUEUE_REJECTED = Counter(
    "infermesh_router_queue_rejected",
    "Requests the router's fair queue refused, by tier and reason (tenant_full: the tenant's "
    "queue at max_per_tenant; fleet_full: all queues at max_total; timeout: waited past the "
    "request's deadline or max_wait_s)",
    ["tier", "reason"],
)


ROUTER_DECISIONS = Counter(
    "infermesh_router_decisions",
    "Requests the router placed, by policy and by what chose the worker (turn: round robin or "
    "random; session: the session's worker; cache: it held part of the prompt; affinity: the "
    "prompt's head hashes to it; load: the cost alone)",
    ["policy", "basis"],
)

ROUTER_PHASE_PLANS = Counter(
    "infermesh_router_phase_plans",
    "Requests the router placed, by how their phases are served (aggregated; split: prefilled on "
    "a prefill worker; pull: a busy peer's cached prefix pulled) and the term that decided it "
    "(router_svc/phases.py)",
    ["plan", "term"],
)

ROUTER_UNHASHED_ASKS = Counter(
    "infermesh_router_unhashed_asks",
    "Route asks with a prompt decided without its block hashes: neither the caller nor the "
    "router could tokenize it in time (no loadable tokenizer, a load or a long prompt slower "
    "than the router's bound, a prompt that does not render); decided on its text, unhashed",
)


# The router's index of the workers' prefix caches (router_svc/prefix_index.py).
PREFIX_TOKENS_SAVED = Counter(
    "infermesh_router_prefix_tokens_saved",
    "Prompt tokens the chosen worker had cached, as the router's index predicted, by worker",
    ["worker"],
)
PREFIX_TOKENS_SAVED_PER_REQUEST = Histogram(
    "infermesh_router_prefix_tokens_saved_per_request",
    "Prompt tokens the chosen worker had cached per request routed with prefix hashes",
    buckets=(0, 16, 256, 1024, 4096, 16384, 32768, 65536, 131072),
)
INDEX_BLOCKS = Gauge(
    "infermesh_router_index_blocks", "Cached blocks the router's index holds, by worker", ["worker"]
)
INDEX_SIZE = Gauge(
    "infermesh_router_index_size", "Distinct cached blocks in the router's index, all workers'"
)
CACHE_EVENTS = Counter(
    "infermesh_router_cache_events",
    "Workers' cache events the router applied (blocks stored and removed), by worker",
    ["worker"],
)
CACHE_RESYNCS = Counter(
    "infermesh_router_cache_resyncs",
    "Snapshots that replaced a worker's blocks in the index, by worker and reason (start: the "
    "first; gap: a seq skipped; epoch: the worker's cache started over; stale: the worker no "
    "longer had the events after the router's last)",
    ["worker", "reason"],
)
CACHE_EVENTS_CONNECTED = Gauge(
    "infermesh_router_cache_events_connected",
    "1 while the router's cache-event stream from the worker is open, by worker",
    ["worker"],
)
CACHE_BATCH_APPLY = Histogram(
    "infermesh_router_cache_batch_apply_seconds",
    "Time the router's event loop spent applying one cache-event batch to its index",
    buckets=(0.00001, 0.0001, 0.001, 0.01, 0.1, 1),
)


# KV blocks a worker pulled from a peer instead of computing them
# (worker_svc/service/kv_transfer.py): counted by the worker that pulled, labelled by the peer they
# came from and itself.
KV_PULLS = Counter(
    "infermesh_worker_kv_pulls",
    "Pulls of a prompt's KV blocks from a peer, by the peer (from), this worker (to) and outcome "
    "(OK: every block asked came; else the gRPC status that ended it, the rest computed)",
    ["from", "to", "outcome"],
)
KV_PULL_BYTES = Counter(
    "infermesh_worker_kv_pull_bytes", "KV cache bytes pulled from peers", ["from", "to"]
)
KV_PULL_BLOCKS = Counter(
    "infermesh_worker_kv_pull_blocks",
    "KV blocks (of infermesh.prefix_hash.BLOCK_TOKENS tokens) pulled from peers",
    ["from", "to"],
)
KV_PULL_SECONDS = Counter(
    "infermesh_worker_kv_pull_seconds", "Time spent pulling KV blocks from peers", ["from", "to"]
)
KV_PULL_REFUSED_BLOCKS = Counter(
    "infermesh_worker_kv_pull_refused_blocks",
    "KV blocks a peer sent that did not match the prompt or the cache (name, dtype, shape or "
    "size), computed instead",
)


class MetricsEndpoint(Protocol):
    """Where /metrics is served: a service's ``[metrics]`` config section
    (infermesh.config.MetricsSection), taken as a value so telemetry depends on no config
    loader."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


def observe_generation(
    service: str,
    model: str,
    first_token_s: float,
    total_s: float,
    input_tokens: int,
    output_tokens: int,
) -> None:
    """One finished generation's latency (duration, TTFT, TPOT over the tokens after the
    first) and token counts, the same way in the gateway and the worker."""
    series = _generation_series.get((service, model))
    if series is None:
        series = _generation_series[service, model] = _GenerationSeries(
            REQUEST_DURATION.labels(service, model),
            TIME_TO_FIRST_TOKEN.labels(service, model),
            TIME_PER_OUTPUT_TOKEN.labels(service, model),
            TOKENS.labels(service, model, "input"),
            TOKENS.labels(service, model, "output"),
        )
    series.duration.observe(total_s)
    series.first_token.observe(first_token_s)
    if output_tokens > 1:
        series.per_output_token.observe((total_s - first_token_s) / (output_tokens - 1))
    series.input_tokens.inc(input_tokens)
    series.output_tokens.inc(output_tokens)


def observe_key_tokens(name: str, tier: str, input_tokens: int, output_tokens: int) -> None:
    """One finished generation's tokens, billed to the key named ``name`` (its two series looked
    up once, as _GenerationSeries)."""
    series = _key_series.get((name, tier))
    if series is None:
        series = _key_series[name, tier] = (
            KEY_TOKENS.labels(name, tier, "input"),
            KEY_TOKENS.labels(name, tier, "output"),
        )
    series[0].inc(input_tokens)
    series[1].inc(output_tokens)


class _GenerationSeries(NamedTuple):
    """One service and model's series of ``observe_generation``, looked up once: a labels()
    lookup costs about as much as the observation itself, on every request."""

    duration: Histogram
    first_token: Histogram
    per_output_token: Histogram
    input_tokens: Counter
    output_tokens: Counter


_generation_series: dict[tuple[str, str], _GenerationSeries] = {}
_key_series: dict[tuple[str, str], tuple[Counter, Counter]] = {}  # (key name, tier) -> in, out


def serve_metrics(config: MetricsEndpoint) -> None:
    """Serves /metrics on the configured side port, from a thread."""
    if config.port:
        start_http_server(config.port, addr=config.host)
        logger.info("metrics on http://%s:%d/metrics", config.host, config.port)


class _FleetCollector:
    def __init__(self, workers: Callable[[], Iterable[tuple[str, str]]]) -> None:
        self._workers = workers

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "infermesh_router_workers",
            "Live workers by GPU kind and precision",
            labels=["gpu", "precision"],
        )
        for (gpu, precision), count in Tally(self._workers()).items():
            family.add_metric([gpu, precision], count)
        yield family


def watch_fleet(workers: Callable[[], Iterable[tuple[str, str]]]) -> None:
    """Exports the router's live workers, read at scrape time as (gpu, precision) pairs."""
    REGISTRY.register(_FleetCollector(workers))


class _LinkCollector:
    def __init__(self, links: Callable[[], Iterable[tuple[str, str, float]]]) -> None:
        self._links = links

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "infermesh_router_link_gbps",
            "The link between two workers as the router prices a KV transfer over it, Gb/s: "
            "measured by the receiving worker's pulls (only pairs measured are listed)",
            labels=["src", "dst"],
        )
        for source, destination, gbps in self._links():
            family.add_metric([source, destination], gbps)
        yield family


def watch_links(links: Callable[[], Iterable[tuple[str, str, float]]]) -> None:
    """Exports the router's measured links, read at scrape time as (from, to, Gb/s)."""
    REGISTRY.register(_LinkCollector(links))


class WorkerLoad(Protocol):
    """What the load gauges read (a common_pb2.Load)."""

    @property
    def waiting(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float: ...
    @property
    def tokens_per_second(self) -> float: ...


def watch_worker_load(load: Callable[[], WorkerLoad]) -> None:
    """Exports a worker's load gauges, read at scrape time from ``load()`` (a common_pb2.Load)."""
    QUEUE_DEPTH.set_function(lambda: load().waiting)
    RUNNING_SEQUENCES.set_function(lambda: load().running)
    KV_CACHE_USAGE.set_function(lambda: load().kv_cache_usage)
    TOKENS_PER_SECOND.set_function(lambda: load().tokens_per_second)


def watch_event_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Exports the live tasks of ``loop``, counted at scrape time (also from the side port's
    thread: ``asyncio.all_tasks`` copies its set, retrying while the loop changes it)."""
    ASYNCIO_TASKS.set_function(lambda: len(asyncio.all_tasks(loop)))
