"""Sampling as tiny pure functions of one step's logits.

`sample_batch` takes the logits of every sequence that samples in a step: rows that are greedy
without penalties share one argmax; the others get penalties, temperature, top-k, top-p and a
draw from their own seeded generator.
"""

from __future__ import annotations

import torch

from worker_svc.engine.api import SamplingParams


def apply_penalties(
    logits: torch.Tensor, output_ids: list[int], presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's presence/frequency penalties over the tokens generated so far. logits: [vocab]."""
    if not output_ids or (presence == 0 and frequency == 0):
        return logits
    counts = torch.bincount(torch.tensor(output_ids), minlength=logits.size(-1)).to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.size(-1):
        return logits
    kth = logits.topk(k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= p  # the mass before this token already reaches p
    return logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, output_ids: list[int]
) -> int:
    """logits: [vocab] float32 of one sequence -> one token id."""
    logits = apply_penalties(logits, output_ids, params.presence_penalty, params.frequency_penalty)
    if params.temperature == 0:
        return int(logits.argmax())
    logits = apply_top_p(apply_top_k(logits / params.temperature, params.top_k), params.top_p)
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    output_ids: list[list[int]],
) -> list[int]:
    """logits: [N, vocab] float32, row i of sequence i -> N token ids (greedy rows share one
    argmax)."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.temperature != 0 or p.has_penalties:
            tokens[i] = sample(logits[i], p, generators[i], output_ids[i])
    return tokens


def token_logprobs(
    logits: torch.Tensor, token_id: int, top_n: int
) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of the sampled token, and its `top_n` best alternatives as (id,
    logprob).

    logits: [vocab], before penalties and temperature (the model's own distribution, as OpenAI
    reports it).
    """
    logprobs = logits.log_softmax(-1)
    top = logprobs.topk(top_n) if top_n > 0 else None
    alternatives = [] if top is None else [(int(i), float(v)) for v, i in zip(*top, strict=True)]
    return float(logprobs[token_id]), alternatives
