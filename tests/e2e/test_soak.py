"""The soak's short version (bench/soak.py runs the 10-minute one): a mixed load with
clients dropping streams, on the real processes; nothing fails and nothing grows."""

from __future__ import annotations

import asyncio

from bench.soak import SERVICES, run

# The probe leaves out the Redis pools' connections, which a new peak of concurrent calls may add
# (bounded by [redis] max_connections): not a leak. What else may differ by a descriptor or two
# between two idle moments (a keep-alive connection closing late) is not one either.
_FD_SLACK = 2


async def test_a_short_soak_leaves_no_error_and_nothing_grown(tmp_path):
    result = await asyncio.to_thread(run, tmp_path, duration_s=8.0, window_s=2.0, concurrency=64)
    outcomes = [o for _, window in result.windows for o in window]
    assert len(outcomes) > 200
    assert sum(1 for o in outcomes if o.kind == "disconnect") > 0
    assert result.warmup  # counted too: errors() holds the warm-up's
    assert result.errors() == []
    # measured from the requests' times: closed-loop clients keep at most their number in flight
    assert all(0 < f.mean <= 64 and f.least <= 64 for f in result.in_flight), result.in_flight
    before, after = result.idle_before, result.idle_after
    for name in SERVICES:
        assert after.tasks[name] <= before.tasks[name], (name, before.tasks, after.tasks)
        assert after.fds[name] <= before.fds[name] + _FD_SLACK, (name, before.fds, after.fds)
    assert after.redis_keys == before.redis_keys
    assert after.leases == 0
