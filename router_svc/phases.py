"""Whether a request's phases are split: its prompt prefilled on one worker (P) and decoded on
another (D), or served aggregated, both on the worker the route score chose.

Splitting is paid for by a transfer (the prompt's KV cache over the link between P and D) and
saves D's decoding streams the stall of a prefill beside them; it pays only when that stall is
real and the first token comes no later. So, once the route score has chosen the request's worker
D (routing.py), one of three plans, tried in this order, the first that applies:

1. **pull**: a busy peer holds a longer cached prefix of the prompt than D and sending it is
   faster than computing it (kv_pull.plan_pull): D takes those blocks and computes the rest.
2. **split**: prefill on P, decode on D, when both hold:

   - the aggregated plan would stall the streams decoding on D beyond the inter-token objective
     (``[routing] inter_token_objective_s``, 0.1 s by default, a p99): while the prompt is
     prefilled there, every step of D's streams also computes a chunk of it, so each of their
     inter-token gaps is ::

         gap_s = min(uncached, chunk) * prefill_s_per_token + step_s

     (``uncached``: the prompt's tokens D's cache lacks; ``chunk``: D's prefill chunk beside
     decodes, ``Capabilities.prefill_chunk_tokens``, 0 counting the whole prompt as one step;
     ``step_s``: one decode step, 1 / D's decode tokens per second). A worker with no stream to
     stall (busy 0) or a gap within the objective serves the request aggregated;
   - the split's first token is no later than the aggregated one's ::

         split:      delivered_s + step_s
                     (P's queued prefill, then what P's cache lacks at P's speed, then what D lacks
                      over the link between their zones: _prefill_worker, then D's step)
         aggregated: queued_s + uncached * prefill_s_per_token + ceil(uncached / chunk) * step_s
                     (D's queued prefill, its own prefill, and the decode steps its chunks share)

   P is a worker of role "prefill", or an idle one of role "both" other than D (a fleet need not
   be partitioned by hand); D may be of role "decode" or "both". A split whose P dies or stalls
   past the pull's deadline still ends with D computing the prompt itself (worker_svc's
   kv_transfer).
3. **aggregated** otherwise.

``[routing] phase_split`` replaces the split's rule by a baseline's, to compare against: "always"
splits whenever a P can take the prompt (the rule of a fleet partitioned by role before this
one), "conditional" is Dynamo's (its KV router's ``conditional_disagg``: a prompt whose part D
lacks is under 2,048 tokens or under 0.7 of it stays on D, and so does one whose P has prefill
queued), "never" serves every request aggregated.

Each plan names its deciding term (``PhasePlan.term``), which the decision's span and the
``infermesh_router_phase_plans`` counter carry: ``holder`` (a busy holder's prefix is pulled),
``stall`` (split: D's streams would stall past the objective, and P's first token is no later),
``cached`` (nothing left to compute), ``idle`` (no stream decodes on D), ``gap`` (the stall is
within the objective), ``no_kv_engine`` (D's engine takes no KV blocks: a vLLM worker's, today),
``no_prefill_worker`` (no P can take it: none of D's KV size and
precision, linked and idle or of role "prefill"), ``first_token`` (the split's first token would
come later); under a baseline's rule: ``always`` and ``conditional`` (split by that rule),
``short`` (conditional: too little to compute), ``busy_prefill`` (conditional: P has prefill
queued), ``never``. A request without block hashes is ``unhashed``, and one under a policy without
a cost (not ``balanced``) ``policy`` (routing.py): both served aggregated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from infermesh.kv_link import kv_transfer_s
from infermesh.prefix_hash import BLOCK_TOKENS
from router_svc.config import PhaseSplit, RoutingSection
from router_svc.fleet import Fleet, Group
from router_svc.kv_pull import PREFILL_MIN_TIMEOUT_S, PullPlan, exchange_blocks, plan_pull


@dataclass(frozen=True)
class PhasePlan:
    """How a request's phases are served: ``plan`` ("aggregated", "split" or "pull"), the term
    that decided it, and the pull D makes (None: aggregated)."""

    plan: str
    term: str
    pull: PullPlan | None = None


@dataclass(frozen=True)
class PhaseInputs:
    """What the route score measured of the request on its candidates (``group``)."""

    model: str
    group: Group
    busy: np.ndarray  # each candidate's streams
    cached_tokens: np.ndarray  # each candidate's tokens of the prompt in its cache
    chosen: int  # D: an index into group
    queued_s: float  # the prefill queued on D ahead of the request
    held: np.ndarray | None  # each fleet slot's blocks of the prompt (None: none holds any)


def plan_phases(
    links: np.ndarray,
    fleet: Fleet,
    inputs: PhaseInputs,
    prefix_hashes: Sequence[int],
    routing: RoutingSection,
) -> PhasePlan:
    """The module's rule for a request of ``prefix_hashes`` whose worker the route score chose,
    as ``routing`` configures it; ``links``: ZoneLinks.of(fleet)."""
    group, chosen = inputs.group, inputs.chosen
    if routing.moves_kv:
        pull = plan_pull(
            links, fleet, group, inputs.busy, inputs.cached_tokens, chosen, prefix_hashes
        )
        if pull is not None:
            return PhasePlan("pull", "holder", pull)
    uncached = len(prefix_hashes) * BLOCK_TOKENS - int(inputs.cached_tokens[chosen])
    if uncached <= 0:
        return PhasePlan("aggregated", "cached")
    if routing.phase_split != "cost":
        return _baseline(links, fleet, inputs, prefix_hashes, routing.phase_split, uncached)
    if inputs.busy[chosen] <= 0:
        return PhasePlan("aggregated", "idle")
    slot = int(group.slots[chosen])
    s_per_token = float(group.prefill_s_per_token[chosen])
    speed = float(fleet.speed[slot])
    step_s = 1 / speed if speed > 0 else 0.0
    chunk = int(fleet.prefill_chunk[slot]) or uncached
    if min(uncached, chunk) * s_per_token + step_s <= routing.inter_token_objective_s:
        return PhasePlan("aggregated", "gap")
    if fleet.kv_bytes[slot] <= 0:
        return PhasePlan("aggregated", "no_kv_engine")
    split = _prefill_worker(links, fleet, inputs, prefix_hashes)
    if split is None:
        return PhasePlan("aggregated", "no_prefill_worker")
    pull, delivered_s = split
    aggregated_s = inputs.queued_s + uncached * s_per_token + math.ceil(uncached / chunk) * step_s
    if delivered_s + step_s > aggregated_s:
        return PhasePlan("aggregated", "first_token")
    return PhasePlan("split", "stall", pull)


# Dynamo's conditional disaggregation: a prompt whose new part is shorter, or a smaller share of
# it, is prefilled where it is decoded
_CONDITIONAL_MIN_TOKENS = 2048
_CONDITIONAL_MIN_SHARE = 0.7


def _baseline(
    links: np.ndarray,
    fleet: Fleet,
    inputs: PhaseInputs,
    prefix_hashes: Sequence[int],
    rule: PhaseSplit,
    uncached: int,
) -> PhasePlan:
    """The plan under a baseline's rule (``[routing] phase_split``: always, conditional, never)."""
    if rule == "never":
        return PhasePlan("aggregated", "never")
    whole = len(prefix_hashes) * BLOCK_TOKENS
    if rule == "conditional" and (
        uncached < _CONDITIONAL_MIN_TOKENS or uncached < _CONDITIONAL_MIN_SHARE * whole
    ):
        return PhasePlan("aggregated", "short")
    split = _prefill_worker(links, fleet, inputs, prefix_hashes)
    if split is None:
        return PhasePlan("aggregated", "no_prefill_worker")
    pull = split[0]
    if rule == "conditional" and fleet.prefill_until[pull.holder.slot] > fleet.clock():
        return PhasePlan("aggregated", "busy_prefill")
    return PhasePlan("split", rule, pull)


def _prefill_worker(
    links: np.ndarray, fleet: Fleet, inputs: PhaseInputs, prefix_hashes: Sequence[int]
) -> tuple[PullPlan, float] | None:
    """The P that delivers D the prompt's blocks first, with the pull D makes and the seconds
    until its blocks are delivered; None when no P can. Candidates: the workers of role
    "prefill" of D's model and precision, and the idle ones of role "both" among D's peers; each
    of D's KV size and precision, not ejected, and linked to D (within one zone always, a
    ``link_gbps`` of 0 counting the transfer 0; across two only as ``zone_link_gbps`` lists them).
    P's estimate: the prefill queued there, then what its cache lacks at its prefill speed, then
    what D lacks sent over the link between their zones."""
    group, chosen = inputs.group, inputs.chosen
    decoder = fleet.entry_at(int(group.slots[chosen]))
    mine = decoder.info.capabilities
    whole = len(prefix_hashes) * BLOCK_TOKENS
    tokens = whole - int(inputs.cached_tokens[chosen])
    if mine.kv_transfer_bytes_per_token <= 0:
        return None
    prefillers = fleet.group(inputs.model, mine.precision, prefill=True)
    lenders = (inputs.busy <= 0) & fleet.lends_prefill[group.slots]
    lenders[chosen] = False
    slots = np.concatenate((prefillers.slots, group.slots[lenders]))
    if not len(slots):
        return None
    s_per_token = np.concatenate(
        (prefillers.prefill_s_per_token, group.prefill_s_per_token[lenders])
    )
    theirs_cached = (
        np.zeros(len(slots), dtype=np.int64)
        if inputs.held is None
        else inputs.held[slots] * BLOCK_TOKENS
    )
    now = fleet.clock()
    queued_s = np.maximum(fleet.prefill_until[slots] - now, 0.0)
    prefill_s = queued_s + (whole - theirs_cached) * s_per_token
    zone = fleet.zone_of[decoder.slot]
    gbps = links[zone, fleet.zone_of[slots]]
    # no link: an infinite one, the transfer counted 0 (and, across zones, refused below);
    # a link D measured its pulls over, as measured
    priced = fleet.link_gbps(slots, decoder.slot, np.where(gbps > 0, gbps, np.inf))
    transfer_s = kv_transfer_s(tokens, mine.kv_transfer_bytes_per_token, priced)
    usable = (
        exchange_blocks(fleet, decoder.slot, slots)
        & (fleet.ejected_until[slots] <= now)
        & ((gbps > 0) | (fleet.zone_of[slots] == zone))
    )
    delivered_s = np.where(usable, prefill_s + transfer_s, np.inf)
    best = int(delivered_s.argmin())
    estimate = float(delivered_s[best])
    if not np.isfinite(estimate):
        return None
    pull = PullPlan(
        fleet.entry_at(int(slots[best])),
        prefix_hashes,
        max(PREFILL_MIN_TIMEOUT_S, 2 * estimate),
        compute=True,
        prefill_s=float(prefill_s[best] - queued_s[best]),
    )
    return pull, estimate
