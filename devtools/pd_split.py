"""How many of a fleet's workers of one GPU kind to give role "prefill" and how many "decode"
(prefill on P, decode on D: router_svc/kv_pull.py), from the cost the router and the simulated
workers use (worker_svc/sim_engine/roofline.py): prefill is compute, decode is memory bandwidth.

For a request of ``prompt`` tokens and ``output`` tokens, on a worker of the kind:

- a prefill worker spends ``prefill_s(prompt)`` on it (weights' and attention's FLOPs / FLOP/s);
- a decode worker runs ``batch`` sequences a step (its max_parallel, or what its KV cache holds
  of contexts of prompt + output), each step ``decode_step_s(batch, batch x (prompt + output /
  2))`` (weights and every sequence's KV read / bandwidth), so it spends ``output x step /
  batch`` of its time on the request.

The workers are split in the ratio of those times, so that prefill and decode keep pace:
``prefill share = prefill_s / (prefill_s + output x step / batch)``, the prefill count rounded
and kept between 1 and workers - 1. Prefix-cache hits shorten the prefill (give ``prompt`` the
uncached tokens); the KV blocks' transfer (infermesh.kv_link) overlaps both and is not counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from worker_svc.sim_engine.roofline import Roofline


@dataclass(frozen=True)
class PdSplit:
    prefill_s: float  # one request's prefill on a prefill worker
    decode_s: float  # one request's share of a decode worker's time
    batch: int  # sequences a decode worker runs at once
    prefill_workers: int
    decode_workers: int

    @property
    def prefill_share(self) -> float:
        return self.prefill_s / (self.prefill_s + self.decode_s)


def pd_split(
    roofline: Roofline, prompt: int, output: int, workers: int, max_parallel: int
) -> PdSplit:
    """The split of ``workers`` (>= 2) workers of ``roofline``'s kind for requests of ``prompt``
    and ``output`` tokens, a decode worker running at most ``max_parallel`` sequences."""
    if workers < 2 or prompt < 1 or output < 1 or max_parallel < 1:
        raise ValueError("a split needs >= 2 workers, prompt and output >= 1, max_parallel >= 1")
    context = prompt + output
    batch = max(1, min(max_parallel, roofline.kv_capacity_tokens // context))
    contexts = batch * (prompt + output // 2)
    attended = batch * roofline.attended(prompt + output // 2)
    step = roofline.decode_step_s(batch, contexts, attended)
    prefill_s = roofline.prefill_s(prompt)
    decode_s = output * step / batch
    prefill = min(workers - 1, max(1, round(workers * prefill_s / (prefill_s + decode_s))))
    return PdSplit(prefill_s, decode_s, batch, prefill, workers - prefill)


def decode_without_prefill(roles: Mapping[str, str], precisions: Mapping[str, str]) -> list[str]:
    """The precisions (of ``precisions``: worker or kind -> precision) whose "decode" workers of
    ``roles`` have no "prefill" worker of theirs: KV blocks go to no other precision, so their
    prompts would be computed where they decode."""
    decoding = {precisions[w] for w, role in roles.items() if role == "decode"}
    prefilling = {precisions[w] for w, role in roles.items() if role == "prefill"}
    return sorted(decoding - prefilling)
