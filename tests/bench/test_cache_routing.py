"""bench/cache_routing.py's oracle: one per workload, whatever a policy did with it."""

from __future__ import annotations

import dataclasses

from bench.cache_routing import Outcome, oracle_tokens
from infermesh.prefix_hash import BLOCK_TOKENS, chain


def _sent(ids: list[int], order: tuple[int, float], answer: list[int]) -> Outcome:
    return Outcome(
        prompt_tokens=len(ids),
        order=order,
        prompt_ids=ids,
        prompt_hashes=chain(ids),
        token_ids=answer,
    )


def _workload() -> list[Outcome]:
    """Two agent sessions on one 4-block system prompt: a's first turn (5 whole blocks, an
    8-token answer), b's first turn, then a's second turn, which resends a's first and its
    answer (6 whole blocks)."""
    system = list(range(1000, 1000 + 4 * BLOCK_TOKENS))
    a_first = [*system, *range(1, 25)]
    a_answer = list(range(100, 108))
    a_second = [*a_first, *a_answer, *range(200, 240)]
    b_first = [*system, *range(300, 324)]
    return [
        _sent(a_first, (0, 0.4), a_answer),
        _sent(b_first, (0, 1.7), list(range(400, 408))),
        _sent(a_second, (1, 0.4), list(range(500, 508))),
    ]


def test_the_oracle_is_the_same_whatever_the_policy_placed_and_cached():
    # nothing before a's first turn; b's first shares the system prompt; a's second shares a's
    # first turn and its answer
    expected = 0 + 4 * BLOCK_TOKENS + 6 * BLOCK_TOKENS
    # one policy kept everything on one worker and hit; another spread the turns, missed, and
    # sent them in another order (a's second turn before b's first, as a fast worker allows)
    together = [
        dataclasses.replace(o, worker="w0", cached_tokens=o.prompt_tokens - 8) for o in _workload()
    ]
    spread = [
        dataclasses.replace(o, worker=f"w{i}", cached_tokens=0)
        for i, o in enumerate(reversed(_workload()))
    ]
    assert oracle_tokens(together) == oracle_tokens(spread) == expected


def test_the_oracle_counts_the_answer_a_later_turn_resends():
    a_first, b_first, a_second = _workload()
    unanswered = dataclasses.replace(a_first, token_ids=[])
    # a's first prompt alone is 5 whole blocks; its answer completes the sixth
    assert oracle_tokens([unanswered, b_first, a_second]) == (4 + 5) * BLOCK_TOKENS
