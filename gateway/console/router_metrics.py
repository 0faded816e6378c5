"""The router's routing figures for the Fleet page, read from the router's own Prometheus
exposition (``[console] router_metrics_url``: its ``[metrics]`` port) and parsed with
prometheus_client: its decisions by policy and by what chose the worker, requests routed with
prompt prefix hashes, how many went to a worker that had part of the prompt cached (cache hits, as
the router's index predicted them), the cached tokens per worker, and its fair queue by tier."""

from __future__ import annotations

import dataclasses

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class RouterFigures:
    # requests placed, by (policy, basis: what chose the worker; router_svc.routing.Decision)
    decisions: dict[tuple[str, str], int]
    routed_with_prefix: int  # requests the router routed with prompt prefix hashes
    cache_hits: int  # of those, routed to a worker holding part of the prompt
    cached_tokens: int
    cached_tokens_by_worker: dict[str, int]
    queued_by_tier: dict[str, int]
    rejected_by_tier: dict[str, int]

    @property
    def tiers(self) -> list[str]:
        return sorted({*self.queued_by_tier, *self.rejected_by_tier})


async def read_router_figures(url: str) -> RouterFigures:
    """The figures from the exposition at ``url``; aiohttp.ClientError or TimeoutError when it
    cannot be read, ValueError when it is not Prometheus text."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S)) as session,
        session.get(url) as response,
    ):
        response.raise_for_status()
        text = await response.text()
    samples = [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]

    def total(name: str, **labels: str) -> int:
        return round(
            sum(v for n, tags, v in samples if n == name and labels.items() <= tags.items())
        )

    def by(name: str, label: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for n, tags, v in samples:
            if n == name and label in tags:
                out[tags[label]] = out.get(tags[label], 0) + round(v)
        return dict(sorted(out.items()))

    histogram = "infermesh_router_prefix_tokens_saved_per_request"
    routed = total(f"{histogram}_count")
    decisions = {
        (tags["policy"], tags["basis"]): round(v)
        for n, tags, v in samples
        if n == "infermesh_router_decisions_total"
    }
    return RouterFigures(
        decisions=dict(sorted(decisions.items())),
        routed_with_prefix=routed,
        cache_hits=routed - total(f"{histogram}_bucket", le="0.0"),
        cached_tokens=total(f"{histogram}_sum"),
        cached_tokens_by_worker=by("infermesh_router_prefix_tokens_saved_total", "worker"),
        queued_by_tier=by("infermesh_router_queue_depth", "tier"),
        rejected_by_tier=by("infermesh_router_queue_rejected_total", "tier"),
    )
