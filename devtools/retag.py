"""One-off migration to the hash-tagged layout: the Redis keys an older gateway wrote for
each API key (``infermesh:key:<id>``, its limit state and usage) renamed to their tagged
names (``infermesh:key:{<id>}`` ...), so that keys, limits and usage keep working.

    python -m devtools.retag [--redis-url redis://127.0.0.1:6379/0]

Run it once on the Redis the older gateways used, before moving to a cluster (a rename
needs both names on one server; the older gateways could only use one server). Safe to
run again: a name already taken by the tagged layout is left alone and reported.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys

import redis.asyncio as redis

from gateway.accounts.keys import INDEX, key_tag
from infermesh.redis_client import RedisClient

_PER_KEY = (
    "infermesh:key:{}",
    "infermesh:rl:{}:rpm",
    "infermesh:rl:{}:tpm",
    "infermesh:rl:{}:inflight",
    "infermesh:quota:{}",
    "infermesh:usage:{}",
)


@dataclasses.dataclass
class RetagReport:
    renamed: int = 0
    conflicts: list[str] = dataclasses.field(default_factory=list)  # old names left in place


async def retag(client: RedisClient) -> RetagReport:
    """Renames every untagged key of every indexed API key to its tagged name."""
    report = RetagReport()
    for raw in await client.smembers(INDEX):
        kid = raw.decode() if isinstance(raw, bytes) else raw
        names = [pattern.format(kid) for pattern in _PER_KEY]
        names += [n.decode() async for n in client.scan_iter(match=f"infermesh:usage:{kid}:d:*")]
        for old in names:
            new = old.replace(kid, key_tag(kid), 1)
            if not await client.exists(old):
                continue
            if await client.renamenx(old, new):
                report.renamed += 1
            else:
                report.conflicts.append(old)
    return report


async def _main(redis_url: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        report = await retag(client)
    finally:
        await client.aclose()
    print(f"renamed {report.renamed} Redis keys to the hash-tagged layout")
    for name in report.conflicts:
        print(f"left {name}: its tagged name exists already", file=sys.stderr)
    return 1 if report.conflicts else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m devtools.retag", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="the single Redis the older gateways used",
    )
    sys.exit(asyncio.run(_main(parser.parse_args().redis_url)))
