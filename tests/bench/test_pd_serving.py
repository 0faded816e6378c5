"""bench/pd_serving.py's fleet roles and its goodput: a request counts when it meets both SLOs,
per second of the run's makespan, in simulated seconds."""

from __future__ import annotations

import argparse

import pytest

from bench.cache_routing import Outcome
from bench.pd_serving import FLEET, prefill_split, request_itl_p99, roles, summarize


def test_the_prefill_workers_are_the_first_of_their_kinds_and_every_precision_has_one():
    split = prefill_split("H100:2,A100:1")
    assert split == {"H100": 2, "A100": 1}
    assigned = roles(split, disaggregated=True)
    by_kind = {
        gpu: [r for (g, _), r in zip(FLEET, assigned, strict=True) if g == gpu] for gpu, _ in FLEET
    }
    assert by_kind["H100"] == ["prefill", "prefill", "decode", "decode"]
    assert by_kind["A100"] == ["prefill", "decode", "decode", "decode"]
    assert by_kind["H200"] == by_kind["H800"] == ["decode"] * 4
    assert roles(split, disaggregated=False) == ["both"] * len(FLEET)
    # the A100s (BF16) would decode with nobody to prefill for them
    with pytest.raises(argparse.ArgumentTypeError, match="the bf16 workers have no prefill one"):
        prefill_split("H100:2")
    for bad in ("B200:1", "H100:4", "H100:x"):
        with pytest.raises(argparse.ArgumentTypeError, match="KIND:N"):
            prefill_split(bad)


def test_a_requests_itl_p99_is_its_longest_gap_under_100_gaps():
    assert request_itl_p99([0.01] * 50 + [0.5]) == 0.5
    assert request_itl_p99([0.01] * 199 + [0.5]) == 0.01
    assert request_itl_p99([]) == 0.0


def test_goodput_counts_the_requests_meeting_both_slos_in_simulated_seconds():
    scale = 4.0
    outcomes = [
        Outcome(ttft_s=1.0 * scale, done_s=5.0 * scale, itl_s=[0.05 * scale] * 10),  # good
        Outcome(ttft_s=3.0 * scale, done_s=8.0 * scale, itl_s=[0.05 * scale] * 10),  # late
        Outcome(ttft_s=0.5 * scale, done_s=10.0 * scale, itl_s=[0.2 * scale] * 10),  # stalls
        Outcome(error="UNAVAILABLE"),
    ]
    r = summarize(outcomes, scale)
    assert r["good_share"] == 0.25 and r["goodput"] == pytest.approx(1 / 10.0)
    assert r["errors"] == 1 and r["error_codes"] == "UNAVAILABLE"
    assert r["ttft_p50"] == pytest.approx(1.0)


def test_every_mode_is_counted_over_one_window_failures_included():
    """A mode whose slow requests end late is not flattered by a shorter makespan: goodput is
    per second of the window every mode shares, and a failed request counts as a miss."""
    scale = 1.0
    quick = [Outcome(ttft_s=0.5, done_s=4.0, itl_s=[0.01] * 5) for _ in range(2)]
    quick += [Outcome(error="UNAVAILABLE")] * 2
    slow = [Outcome(ttft_s=0.5, done_s=20.0, itl_s=[0.01] * 5) for _ in range(2)]
    window = max(summarize(o, scale)["makespan"] for o in (quick, slow))
    assert window == 20.0
    quick_r, slow_r = summarize(quick, scale, window), summarize(slow, scale, window)
    assert quick_r["goodput"] == pytest.approx(2 / 20) and quick_r["good_share"] == 0.5
    assert slow_r["goodput"] == pytest.approx(2 / 20) and slow_r["good_share"] == 1.0
    # its own makespan alone would have given the quick mode 2 / 4
    assert summarize(quick, scale)["goodput"] == pytest.approx(2 / 4)
    # a mode whose every request failed is counted, not a crash
    assert summarize([Outcome(error="UNAVAILABLE")] * 2, scale, window)["goodput"] == 0
