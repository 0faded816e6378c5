"""Worker choice: filter the fleet (model, precision, GPU kind, not ejected), then rank by a policy.

``random`` picks any worker (a benchmarks' baseline); ``round_robin`` rotates; ``least_load``
takes the lowest share of busy slots; ``balanced`` (the default) ranks by one cost, lower is
better (RoutingSection says it with its keys)::

    load_weight * (busy + 1) / max_parallel
      + prefill_weight * (queued_s + prefill_s * (busy + 1))                         (a)
      [+ hardware_weight * slowness, for a request with thinking on]
      with prefill_s = (prompt_tokens - cached_tokens) / prefill_tokens_per_second
    or, for a request without ``prefix_hashes``,
    load_weight * (busy + 1) / max_parallel + kv_weight * kv_use + hardware_weight * slowness
      - affinity_weight * [the worker is the home of the prompt's leading bytes]       (b)

``cached_tokens`` is the longest prefix of the request's ``prefix_hashes`` that the worker's
cache holds, as the workers' cache events have told the router's index (prefix_index.py). Term
(a) is in seconds, one documented estimate of what the request costs on that worker:
``queued_s + prefill_s`` is its time to first token there (the prefill queued ahead of it, then
its own uncached tokens at the worker's measured prefill speed), and ``prefill_s * busy`` what its
prefill costs the streams decoding there, whose next tokens a continuous-batching engine holds
back while it prefills. ``queued_s`` is the prefill this router has sent the worker and, by the
same estimate, the worker has not finished yet (Fleet.prefill_until: each routed request's
``prefill_s``, one after another from when it was routed; a request without prefix hashes adds
none, its tokens unknown). What a cache saves is prefill time, which depends on the prompt's
length and the worker's prefill speed, so (a) is the hardware fitness too, measured where it
counts for this prompt (the decode-speed ``slowness`` and the KV use, a second reading of the
load, made cached prefixes lose to fast empty workers: bench/cache_routing.py). A hit is worth the
seconds it saves and no more: one short block that every prompt shares does not outweigh seconds
of another prompt's prefill queued on its holder (bench/cache_routing.py's production workload:
without the queue, the few fastest workers took most long prompts and their queues set the p90).
Counting the stalled streams keeps a hot prefix on its busy holders, which need not prefill it
again, rather than on another busy worker, whose every stream would wait for that prefill
(bench/cache_routing.py: 94 % of the oracle's hits, from 87 % without). One weight says what a
second of one stream's prefill is worth against a full worker's load; the load term alone spreads
a hot prefix: its holder is passed over for an idle worker once it is ``prefill_weight`` x the
prefill's seconds busier. A bonus proportional to the share cached would rank a cached 200 tokens
like a cached 80,000. A request with thinking on is one whose output may be long (a reasoning
model's thinking runs to thousands of tokens): its decode, not its prefill, is most of its time,
so the decode-speed ``slowness`` counts for it in (a) as well; so it does for every request to a
model that always thinks (R1, whose workers report the reasoning format "deepseek_r1"), whether or
not the request asked.

Sessions (``affinity_key``: an agent's turns, which resend their whole growing history) go to the
session's worker while it has a free slot; only a full worker passes the session on. Its history
is cached there, and agents' prompts all begin with the same system prompt, so without the
request's ``prefix_hashes`` nothing else could tell their sessions apart. With them, a session
whose history the index finds cached further on another worker with a free slot follows the
cache (its worker was full once and passed it on), once its own worker holds the prompt's first
block: a new session stays on its worker even when the system prompt it shares with others is
cached only elsewhere yet, so that sessions spread.

Prompt-byte homes (b) and session homes are found by rendezvous (highest random weight) hashing
of the key over the workers; (b) is only for requests without ``prefix_hashes``.

Everything is vectorized over the candidates' slots in the Fleet's arrays: a decision over a
thousand workers takes tens of microseconds and no I/O, the prefix lookup included
(bench/router_decision.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random
from collections.abc import Sequence
from typing import NamedTuple

import grpc
import numpy as np

from infermesh.names import precision_name
from infermesh.pb import common_pb2
from infermesh.prefix_hash import BLOCK_TOKENS
from router_svc.config import RoutingSection
from router_svc.fleet import Fleet, Group, WorkerEntry
from router_svc.kv_pull import PullPlan, ZoneLinks
from router_svc.phases import PhaseInputs, PhasePlan, plan_phases
from router_svc.prefix_index import PrefixIndex

_MIX1 = np.uint64(0xBF58476D1CE4E5B9)  # a splitmix64 multiplier: mixes (salt ^ key)


class RouteError(Exception):
    """No worker can take the request; carries the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class RouteRequest(NamedTuple):  # a tuple: built on every request, cheaply
    """What the choice looks at in a GenerateRequest."""

    model: str
    precision: common_pb2.Precision
    prefix_key: int  # 64-bit hash of the session's affinity key, else of the prompt's leading bytes
    # How much of the hashed window the prompt fills, 0..1: a short prompt has little
    # cache to reuse, so its affinity counts for less.
    prefix_weight: float = 1.0
    gpu: str = ""  # a GPU kind the worker must be of; "": any
    session: bool = False  # prefix_key names a session: its worker takes it while not full
    prefix_hashes: Sequence[int] = ()  # the prompt's blocks (infermesh/prefix_hash.py)
    prompt_tokens: int = 0  # known with prefix_hashes
    long_output: bool = False  # thinking on: a reasoning model's output may be long

    @classmethod
    def of(cls, request: common_pb2.GenerateRequest, prefix_bytes: int) -> RouteRequest:
        model, precision, gpu = request.model, request.precision, request.gpu
        hashes = request.prefix_hashes
        tokens = max(len(request.prompt_token_ids), len(hashes) * BLOCK_TOKENS)
        long = request.thinking
        if request.affinity_key:
            key = _hash64(request.affinity_key.encode())
            return cls(model, precision, key, 1.0, gpu, True, hashes, tokens, long)
        if hashes:
            return cls(model, precision, 0, 0.0, gpu, False, hashes, tokens, long)
        head = _prompt_head(request, prefix_bytes)
        return cls(model, precision, _hash64(head), len(head) / prefix_bytes, gpu, long_output=long)


_UNPLANNED = PhasePlan("aggregated", "unhashed")  # no prefix hashes: nothing to plan by
_BY_POLICY = PhasePlan("aggregated", "policy")  # least_load, round_robin, random: no cost


class FleetFullError(RouteError):
    """Every worker that could serve the request is at max_parallel."""


@dataclasses.dataclass
class Decision:
    workers: list[WorkerEntry]  # best first: the first try, then the fallback
    reasons: dict[str, str | float | bool | int]  # for the span: why the first was chosen
    cached_tokens: int = 0  # of the prompt, in the first worker's cache as the index predicts
    # what chose the first worker, for the decisions metric: "turn" (round robin, random),
    # "session" (the session's worker), "cache" (it holds part of the prompt), "affinity" (the
    # prompt's head hashes to it) or "load" (the cost alone)
    basis: str = "load"
    # the first worker takes a longer cached prefix from a busy peer (router_svc/kv_pull.py),
    # or has its prompt prefilled on a prefill worker (router_svc/phases.py)
    pull: PullPlan | None = None
    # how the request's phases are served, and the term that decided it (phases.PhasePlan):
    # a request without prefix hashes, or under a policy without a cost, is served aggregated
    phases: PhasePlan = _UNPLANNED
    # the first worker's prefill of the prompt, estimated: what the request adds to its queue
    # (Fleet.queued_prefill) once routed there
    prefill_s: float = 0.0


def _basis(request: RouteRequest, at_home: bool, cached_tokens: int) -> str:
    """What chose the first worker of a cost-ranked decision (``Decision.basis``)."""
    if request.session and at_home:
        return "session"
    if cached_tokens:
        return "cache"
    if at_home:
        return "affinity"
    return "load"


def prefix_key(request: common_pb2.GenerateRequest, prefix_bytes: int) -> int:
    """Hash of the first ``prefix_bytes`` of the prompt (chat: roles and contents in order),
    the same in every router process."""
    return _hash64(_prompt_head(request, prefix_bytes))


def _prompt_head(request: common_pb2.GenerateRequest, prefix_bytes: int) -> bytes:
    # A character is at least a byte: cutting at prefix_bytes characters first keeps the
    # encoding short for a long prompt.
    if request.messages:
        text = "".join(f"{m.role}\x00{m.content[:prefix_bytes]}\x00" for m in request.messages)
    else:
        text = request.prompt[:prefix_bytes]
    return text.encode()[:prefix_bytes]


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class Chooser:
    """Picks workers by the configured policy, reading the workers' cached prefixes in
    ``index``. One per router process."""

    def __init__(self, config: RoutingSection, index: PrefixIndex | None = None) -> None:
        self._config = config
        self._index = index
        self._links = ZoneLinks(config.link_between)
        self._turn = itertools.count()
        self._random = random.Random()

    def choose(self, fleet: Fleet, request: RouteRequest, *, free_only: bool = False) -> Decision:
        """The best worker and one fallback for ``request``; RouteError when none can serve it.
        ``free_only``: among the workers with a free slot only (FleetFullError when none has)."""
        group = _usable(fleet, request)
        if free_only:
            free = group.slots[~fleet.full(group)]
            if not len(free):
                raise FleetFullError(grpc.StatusCode.UNAVAILABLE, "every worker is full")
            if len(free) < len(group):
                group = Group.of(fleet, free)
        n = len(group)
        turn = next(self._turn) % n
        policy = self._config.policy
        if policy in ("round_robin", "random"):
            first = turn if policy == "round_robin" else self._random.randrange(n)
            picked = (
                [group.slots[first], group.slots[(first + 1) % n]] if n > 1 else [group.slots[0]]
            )
            return Decision(
                [fleet.entry_at(s) for s in picked],
                {"policy": policy},
                basis="turn",
                phases=_BY_POLICY,
            )
        busy = fleet.busy_now[group.slots]
        streams = busy + 1  # on the worker once this request is in
        cost = streams * group.inverse_capacity  # the share of its slots busy then
        home = -1
        cached = prefill_s = queued_s = held = None
        if policy == "balanced":
            config = self._config
            cost *= config.load_weight
            if request.prefix_hashes:
                # one lookup for the candidates and the prefill workers a decode worker among
                # them would have compute the prompt (phases.py)
                prefillers = fleet.group(request.model, request.precision, prefill=True)
                held = self._held(fleet, group.members | prefillers.members, request)
                cached = _tokens_in(held, group)
                prefill_s = group.prefill_s_per_token * (request.prompt_tokens - cached)
                queued_s = fleet.prefill_until[group.slots] - fleet.clock()
                np.maximum(queued_s, 0.0, out=queued_s)
                cost += config.prefill_weight * (queued_s + prefill_s * streams)
                if request.long_output or group.always_thinks:
                    cost += config.hardware_weight * group.slowness
            else:
                cost += config.kv_weight * fleet.kv_usage[group.slots]
                cost += config.hardware_weight * group.slowness
            if request.session:
                home = _session_home(group, busy, request.prefix_key)
                if cached is not None and cached.any():
                    home = _follow_cache(group, busy, cached, home)
            elif not request.prefix_hashes:
                home = self._affinity_home(group, busy, request.prefix_key)
                cost[home] -= config.affinity_weight * request.prefix_weight
        cost += group.ramp[n - turn : 2 * n - turn]  # equal costs: rotate which wins
        if request.session and home >= 0:
            cost[home] = -np.inf  # the session's worker first, the best of the rest as fallback
        order = [int(cost.argmin())]
        if n > 1:
            cost[order[0]] = np.inf
            order.append(int(cost.argmin()))
        best = order[0]
        slot = group.slots[best]
        reasons: dict[str, str | float | bool | int] = {
            "policy": policy,
            "load": float((busy[best] + 1) * group.inverse_capacity[best]),
            "candidates": n,
        }
        cached_tokens = 0 if cached is None else int(cached[best])
        first_prefill_s = 0.0 if prefill_s is None else float(prefill_s[best])
        if policy == "balanced":
            reasons |= {
                "kv_usage": float(fleet.kv_usage[slot]),
                "hardware": float(group.slowness[best]),
                "prefix_home": best == home,
                "session": request.session,
                "cached_tokens": cached_tokens,
            }
            if queued_s is not None:
                reasons["queued_prefill_s"] = float(queued_s[best])
        phases = _UNPLANNED if policy == "balanced" else _BY_POLICY
        if cached is not None and queued_s is not None:
            phases = plan_phases(
                self._links.of(fleet),
                fleet,
                PhaseInputs(request.model, group, busy, cached, best, float(queued_s[best]), held),
                request.prefix_hashes,
                self._config,
            )
            reasons["phase_plan"] = phases.plan
            reasons["phase_term"] = phases.term
            if phases.plan == "split":
                first_prefill_s = 0.0  # P's, not D's (Fleet.queued_prefill)
        pull = phases.pull
        if pull is not None:
            reasons["pull_from"] = pull.holder.worker_id
            reasons["pull_blocks"] = len(pull.prefix_hashes)
            reasons["pull_compute"] = pull.compute
        workers = [fleet.entry_at(group.slots[i]) for i in order]
        return Decision(
            workers,
            reasons,
            cached_tokens,
            _basis(request, best == home, cached_tokens),
            pull=pull,
            phases=phases,
            prefill_s=first_prefill_s,
        )

    def _held(self, fleet: Fleet, members: int, request: RouteRequest) -> np.ndarray | None:
        """Each fleet slot's blocks of the prompt's prefix in its cache, for the slots of
        ``members`` (None: none holds any, or no index)."""
        if self._index is None:
            return None
        return self._index.cached_blocks(request.prefix_hashes, members, fleet.slot_count)

    def _affinity_home(self, group: Group, busy: np.ndarray, key: int) -> int:
        """Index (into the group) of the prefix's worker: the highest rendezvous hash of
        (key, worker) among the workers under the load bound."""
        x = _rendezvous(group, key)
        home = int(x.argmax())
        # Bounded load: busy + 1 <= ceil(bound) is busy < bound, streams being whole.
        fair = self._config.affinity_load_factor * (busy.sum() + 1)
        if busy[home] < fair * group.capacity_share[home]:
            return home  # the common case: no need to bound every worker
        x[busy >= fair * group.capacity_share] = 0
        return int(x.argmax())


def _rendezvous(group: Group, key: int) -> np.ndarray:
    """Each worker's random weight for ``key``: the highest is the key's home."""
    x = group.salt ^ np.uint64(key)
    x *= _MIX1  # the high bits, which argmax compares first, mix every bit of salt ^ key
    return x


def _session_home(group: Group, busy: np.ndarray, key: int) -> int:
    """Index (into the group) of the session's worker: the highest rendezvous hash among the
    workers with a free slot; -1 when every one is full. The hash alone decides, so a session
    stays where it is whatever the other workers' load, and moves only while its worker is full."""
    x = _rendezvous(group, key)
    x[busy * group.inverse_capacity >= 1] = 0
    home = int(x.argmax())
    return home if x[home] else -1


def _follow_cache(group: Group, busy: np.ndarray, cached: np.ndarray, home: int) -> int:
    """The session's worker, or the one with a free slot caching more of its prompt, once the
    session's worker holds the prompt's first block: a worker holding none of it has not served
    the session, whose first turns then stay there even when the system prompt they share is
    cached elsewhere only (so that new sessions spread)."""
    at_home = cached[home] if home >= 0 else 0
    best = int(cached.argmax())
    if cached[best] <= at_home or (home >= 0 and not at_home):
        return home  # no other worker caches more: no need to look at free slots
    free = busy * group.inverse_capacity < 1
    if not free[best]:
        best = int(np.where(free, cached, -1).argmax())
    return best if free[best] and cached[best] > at_home else home


def _tokens_in(held: np.ndarray | None, group: Group) -> np.ndarray:
    """Each of ``group``'s workers' tokens of the prompt in its cache (``Chooser._held``)."""
    if held is None:
        return np.zeros(len(group), dtype=np.int64)
    cached: np.ndarray = held[group.slots] * BLOCK_TOKENS  # prompt_tokens counts whole blocks
    return cached


def _usable(fleet: Fleet, request: RouteRequest) -> Group:
    """The workers that serve the model in the wished precision and are not ejected (all of
    them when every one is ejected: a cool-down is a preference, not a refusal)."""
    group = fleet.group(request.model, request.precision, request.gpu)
    if len(group) == 0:
        _explain_empty(fleet, request)
    now = fleet.clock()
    if fleet.ejected_until_max <= now:  # nobody ejected: the common case, no filtering
        return group
    live = group.slots[fleet.ejected_until[group.slots] <= now]
    return Group.of(fleet, live) if len(live) else group


def _explain_empty(fleet: Fleet, request: RouteRequest) -> None:
    entries = fleet.entries()
    if not entries:
        raise RouteError(grpc.StatusCode.UNAVAILABLE, "no worker is registered; retry later")
    serving = [e for e in entries if request.model in e.info.models]
    if serving and all(e.info.capabilities.role == "prefill" for e in serving):
        raise RouteError(
            grpc.StatusCode.UNAVAILABLE,
            f"every worker serving {request.model!r} is a prefill worker ([worker] role = "
            '"prefill"): none decodes; retry later',
        )
    if not serving:
        served = sorted({m for e in entries for m in e.info.models})
        raise RouteError(
            grpc.StatusCode.NOT_FOUND,
            f"model {request.model!r} is not served; served models: {', '.join(served)}",
        )
    kinds = sorted({e.info.capabilities.gpu_kind for e in serving})
    if request.gpu and request.gpu not in kinds:
        raise RouteError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"no worker serves {request.model!r} on GPU kind {request.gpu!r}; "
            f"available kinds: {', '.join(kinds)}",
        )
    serving = [e for e in serving if request.gpu in ("", e.info.capabilities.gpu_kind)]
    available = sorted({precision_name(e.info.capabilities.precision) for e in serving})
    on_kind = f" on GPU kind {request.gpu!r}" if request.gpu else ""
    raise RouteError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"no worker serves {request.model!r}{on_kind} in precision "
        f"{precision_name(request.precision)}; available: {', '.join(available)}",
    )
