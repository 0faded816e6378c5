"""The batch runner: every gateway process runs one, and together they run every batch's lines.

A runner claims lines of the running batches in Redis (``BatchRecords.claim``), up to ``[batches]
concurrency`` at once, and sends each as a request to its own process's API
(``gateway.http.loopback``), acting for the batch's key at the ``batch`` tier: the line crosses the
same validation, limits, router path (its fair queue, at ``[batches] weight``) and settlement as
live traffic, and its answer, success or error, is the line's result, kept once
(``BatchRecords.settle``), and billed to the key with it, in the same Redis script: the line's
request settles the key's limits but bills nothing, so a line that ran twice is billed once. Claims
are renewed while their lines run; a runner that dies leaves claims that run out, and another runner
takes the lines again, so no line is lost, and one that two runners ran is kept once. A line whose
request could not be made (this process stopping) is given back at once; one answered 429 or 5xx
(the router restarting, no worker, the key's limits) is given back after ``[batches] poll_s``, to be
run again, never kept as its result (until the batch expires).

When a batch has every line settled, or is cancelled or expired with no line running, one runner
(the first to take its ``:final`` lock) finalizes it: the batch's API writes its outputs from the
results (a ``Finalizer``), and the batch ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp

from gateway.accounts.usage import TokenUsage
from gateway.batches.files import Files
from gateway.batches.records import BatchLine, BatchRecord, BatchRecords, LineResult, batch_key
from gateway.config import BatchesSection
from gateway.http.loopback import BATCH_KEY_HEADER, LOOPBACK_HEADER, Loopback
from infermesh.redis_client import REDIS_ERRORS
from infermesh.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

# How an API writes an ended batch's outputs (the record given with the status it ends in): the
# record's changes (the output files' ids).
Finalizer = Callable[
    [Files, BatchRecord, list[BatchLine], Mapping[int, LineResult]], Awaitable[dict[str, Any]]
]

_LINE_FAILURES = (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError)
_LAG_SAMPLE_S = 0.01  # how often the event loop's lag is measured
_LAG_WEIGHT = 0.2  # the newest sample's weight in the lag's moving average
# Free slots are refilled this many at a time (a share of [batches] concurrency): each refill is
# a few Redis round trips (the batches, their records, a claim), paid per chunk, not per line.
_REFILL_SHARE = 4


def _mesh_failed(status: int) -> bool:
    """An answer that says nothing of the line itself: the mesh or the key's limits refused it
    for now (429, 5xx)."""
    return status == 429 or status >= 500


def line_usage(body: Any) -> TokenUsage:
    """The tokens of a line's answer, in any of its APIs' usage shapes (chat and completions',
    Responses', Anthropic's)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return TokenUsage()
    if "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details") or {}
        return TokenUsage(
            int(usage["prompt_tokens"]),
            int(usage.get("completion_tokens") or 0),
            int(details.get("cached_tokens") or 0),
        )
    if "input_tokens_details" in usage:  # Responses: input_tokens counts the cached ones
        cached = int((usage["input_tokens_details"] or {}).get("cached_tokens") or 0)
        return TokenUsage(
            int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0), cached
        )
    cached = int(usage.get("cache_read_input_tokens") or 0)  # Anthropic's: input_tokens does not
    return TokenUsage(
        int(usage.get("input_tokens") or 0) + cached, int(usage.get("output_tokens") or 0), cached
    )


class LoopLag:
    """How late this process's event loop runs a timer, as a moving average (s): the ready work
    a live request's next chunk waits behind. ``run`` until cancelled."""

    def __init__(self) -> None:
        self.lag_s = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(_LAG_SAMPLE_S)
            late = max(0.0, loop.time() - started - _LAG_SAMPLE_S)
            self.lag_s += _LAG_WEIGHT * (late - self.lag_s)


class BatchRunner:
    """This process's share of the batch work; ``run`` until cancelled.

    Live requests go first, here as in the router: while the event loop lags past ``[batches]
    max_loop_lag_ms`` the runner starts no new line (those running finish), and it refills free
    slots a chunk at a time, not one round of Redis calls per line."""

    def __init__(
        self,
        records: BatchRecords,
        files: Files,
        loopback: Loopback,
        config: BatchesSection,
        finalizers: Mapping[str, Finalizer],
    ) -> None:
        self._records = records
        self._files = files
        self._loopback = loopback
        self._config = config
        self._finalizers = finalizers
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._held: dict[str, tuple[BatchRecord, set[int]]] = {}  # by BatchRecord.ref
        self._lines: dict[str, list[BatchLine]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._lag = LoopLag()
        self._refill = max(1, config.concurrency // _REFILL_SHARE)

    @property
    def running(self) -> int:
        return len(self._tasks)

    def wake(self) -> None:
        """Looks for work now (a batch was created) rather than at the next poll."""
        self._wake.set()

    def _free_slots(self) -> int:
        """Lines to start now: none while the event loop lags past its bound, or while fewer
        slots than a refill's chunk are free."""
        if self._lagging():
            return 0
        free = self._config.concurrency - self.running
        return free if free >= self._refill else 0

    def _lagging(self) -> bool:
        """Whether the event loop lags past ``[batches] max_loop_lag_ms`` (0: never)."""
        bound_ms = self._config.max_loop_lag_ms
        return bool(bound_ms) and self._lag.lag_s * 1000 > bound_ms

    async def run(self) -> None:
        renewals = asyncio.create_task(self._renew_forever())
        lag = asyncio.create_task(self._lag.run())
        session: aiohttp.ClientSession | None = None
        try:
            while True:
                if session is None and self._loopback.path:
                    session = aiohttp.ClientSession(
                        connector=aiohttp.UnixConnector(self._loopback.path, limit=0),
                        timeout=aiohttp.ClientTimeout(total=None),
                    )
                found = False
                try:
                    found = await self._round(session)
                except REDIS_ERRORS as e:
                    logger.warning("batch runner: Redis unavailable: %s", type(e).__name__)
                except Exception:  # the runner goes on: a batch it could not handle stays for later
                    logger.exception("batch runner: a round failed")
                if not found:
                    # lagging: looks again once the loop may have caught up, not a poll later
                    timeout_s = _LAG_SAMPLE_S if self._lagging() else self._config.poll_s
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout_s)
                self._wake.clear()
        finally:
            await cancel_and_wait(lag)
            await cancel_and_wait(renewals)
            for task in list(self._tasks):
                await cancel_and_wait(task)
            if session is not None:
                await session.close()

    async def _round(self, session: aiohttp.ClientSession | None) -> bool:
        """One look through the running batches: finalizes those due, claims lines of the
        others while slots are free. Whether any line was claimed."""
        refs = await self._records.active()
        running = {f"{kid}/{batch_id}" for kid, batch_id in refs}
        for ref in set(self._lines) - running:  # ended meanwhile (here or on another replica)
            del self._lines[ref]
        random.shuffle(refs)  # replicas start on different batches
        found = False
        for kid, batch_id in refs:
            record = await self._records.get(kid, batch_id)
            if record is None or await self._finalize_if_due(record):
                continue
            free = self._free_slots()
            if free <= 0 or session is None:
                break
            lines = await self._records.claim(record, self._owner, free, self._config.lease_s)
            for line in lines:
                self._start(session, record, line)
            found = found or bool(lines)
        return found

    def _start(self, session: aiohttp.ClientSession, record: BatchRecord, line: int) -> None:
        held = self._held.setdefault(record.ref, (record, set()))[1]
        held.add(line)
        task = asyncio.create_task(self._run_line(session, record, line))
        self._tasks.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            held.discard(line)
            if not held:
                self._held.pop(record.ref, None)
            if not self._tasks or self._config.concurrency - self.running >= self._refill:
                self._wake.set()

        task.add_done_callback(done)

    async def _run_line(self, session: aiohttp.ClientSession, record: BatchRecord, i: int) -> None:
        try:
            line = (await self._batch_lines(record))[i]
            result = await self._send(session, record, line, f"{record.id}-{i}")
        except asyncio.CancelledError:
            await asyncio.shield(self._give_back(record, i))
            raise
        except _LINE_FAILURES as e:
            logger.warning(
                "batch %s line %d not run (given back): %s", record.id, i, type(e).__name__
            )
            await self._give_back(record, i)
            return
        if _mesh_failed(result.status_code):
            # the mesh's failure, not the line's (the router restarting, no worker free, the
            # key's rate limit): run again later, never settled as the line's answer
            logger.info("batch %s line %d answered %d: run again", record.id, i, result.status_code)
            await asyncio.sleep(self._config.poll_s)
            await self._give_back(record, i)
            return
        try:
            await self._records.settle(record, i, result, line_usage(result.body))
        except REDIS_ERRORS as e:  # its claim runs out: the line is run again
            logger.warning("batch %s line %d not settled: %s", record.id, i, type(e).__name__)

    async def _send(
        self, session: aiohttp.ClientSession, record: BatchRecord, line: BatchLine, request_id: str
    ) -> LineResult:
        headers = {
            LOOPBACK_HEADER: self._loopback.token,
            BATCH_KEY_HEADER: record.owner,
            "x-request-id": request_id,
        }
        async with session.post(f"http://gateway{line.url}", json=line.body, headers=headers) as r:
            body = await r.json(content_type=None)
            return LineResult(line.custom_id, r.status, r.headers.get("x-request-id", ""), body)

    async def _give_back(self, record: BatchRecord, line: int) -> None:
        with contextlib.suppress(*REDIS_ERRORS):  # else its claim runs out
            await self._records.give_back(record, self._owner, line)

    async def _batch_lines(self, record: BatchRecord) -> list[BatchLine]:
        if record.ref not in self._lines:
            self._lines[record.ref] = await self._records.lines(record)
        return self._lines[record.ref]

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._config.lease_s / 3)
            for record, lines in list(self._held.values()):
                try:
                    await self._records.renew(
                        record, self._owner, sorted(lines), self._config.lease_s
                    )
                except REDIS_ERRORS as e:
                    logger.warning("batch claims not renewed: %s", type(e).__name__)

    async def _finalize_if_due(self, record: BatchRecord) -> bool:
        """Ends ``record`` when it is due (whether it was due)."""
        outcome = await self._outcome(record)
        if outcome is None:
            return False
        lock = f"{batch_key(record.owner, record.id)}:final"
        redis = self._records.redis
        if not await redis.set(lock, self._owner, nx=True, px=int(self._config.lease_s * 1000)):
            return True  # another runner is finalizing it
        now = int(time.time())
        if outcome == "completed":
            record = await self._records.set(record, status="finalizing", finalizing_at=now)
        results = await self._records.results(record)
        lines = await self._batch_lines(record)
        ending = dataclasses.replace(record, status=outcome)
        changes = await self._finalizers[record.api](self._files, ending, lines, results)
        await self._records.set(record, status=outcome, **{f"{outcome}_at": now}, **changes)
        await self._records.ended(record)
        self._lines.pop(record.ref, None)
        logger.info(
            "batch %s %s: %d of %d lines settled", record.id, outcome, len(results), record.total
        )
        return True

    async def _outcome(self, record: BatchRecord) -> str | None:
        """How ``record`` ends now, if it is due to."""
        if record.status == "finalizing" or (
            record.status == "in_progress" and record.settled >= record.total
        ):
            return "completed"
        if record.status == "cancelling" and not await self._records.live_claims(record):
            return "cancelled"
        if (
            record.status == "in_progress"
            and time.time() >= record.expires_at
            and not await self._records.live_claims(record)
        ):
            return "expired"
        return None
