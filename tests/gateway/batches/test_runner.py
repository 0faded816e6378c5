"""The batch runner across gateway processes: a gateway killed mid-batch (SIGKILL, its claims left
behind) loses and repeats no line, and bills each line once; another gateway, sharing Redis and the
file store, takes its lines over once their claims run out."""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import time

import openai

from gateway.accounts.keys import key_id
from gateway.batches.records import batch_key
from infermesh.ports import free_port
from infermesh.tasks import cancel_and_wait
from infermesh.usage import usage_key
from router_svc.config import FairQueueSection
from tests.helpers import MODEL
from tests.helpers.batches import batch_ended, chat_line, submit
from tests.helpers.gateway import (
    batch_config,
    gateway_process,
    listening,
    sdk,
    start_gateway,
)
from tests.helpers.inprocess import running_router, running_worker, sim_engine

_LINES = 24
_LEASE_S = 1.0
_LONGER = {"max_tokens": 32}
_ASK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **_LONGER}


async def test_a_gateway_killed_mid_batch_loses_and_repeats_no_line(
    redis_server, redis_client, tmp_path, api_key
):
    files_dir = str(tmp_path / "files")
    async with (
        running_router(redis_url=redis_server.url) as router,
        running_worker(sim_engine(max_parallel=8), router),
    ):
        port = free_port()
        proc = gateway_process(
            {
                "INFERMESH_GATEWAY_SERVER_PORT": str(port),
                "INFERMESH_GATEWAY_REDIS_URL": redis_server.url,
                "INFERMESH_GATEWAY_ROUTER_ADDRESS": router.address,
                "INFERMESH_GATEWAY_FILES_DIRECTORY": files_dir,
                "INFERMESH_GATEWAY_BATCHES_CONCURRENCY": "4",
                "INFERMESH_GATEWAY_BATCHES_LEASE_S": str(_LEASE_S),
                "INFERMESH_GATEWAY_BATCHES_POLL_S": "0.05",
            }
        )
        try:
            await listening(proc)
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0
            )
            batch = await submit(client, [chat_line(f"l{i}", max_tokens=24) for i in range(_LINES)])
            record = batch_key(key_id(api_key), batch.id)
            # killed once some lines are done and others in flight, their claims held (a loaded
            # machine may find either at any moment: both are waited for)
            while (
                await client.batches.retrieve(batch.id)
            ).request_counts.completed < 4 or not await redis_client.hlen(f"{record}:claims"):
                await asyncio.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
            held = await redis_client.hlen(f"{record}:claims")
            settled_at_kill = int(await redis_client.hget(record, "completed"))
            await client.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        assert held >= 1 and settled_at_kill < _LINES, "killed with no line in flight"
        config = batch_config(
            redis_server.url,
            router.address,
            files_dir,
            lease_s=_LEASE_S,
            concurrency=8,
        )
        survivor = await start_gateway(config)
        try:
            async with openai.AsyncOpenAI(
                base_url=str(survivor.make_url("/v1")), api_key=api_key, max_retries=0
            ) as client:
                ended = await client.batches.retrieve(batch.id)
                while ended.status != "completed":
                    await asyncio.sleep(0.05)
                    ended = await client.batches.retrieve(batch.id)
                output = (await client.files.content(ended.output_file_id)).content
        finally:
            await survivor.close()
    outputs = [json.loads(line) for line in output.splitlines()]
    custom_ids = [o["custom_id"] for o in outputs]
    assert sorted(custom_ids) == sorted(f"l{i}" for i in range(_LINES)), "a line lost or repeated"
    assert ended.request_counts.completed == _LINES and ended.request_counts.failed == 0
    billed = await redis_client.hgetall(usage_key(key_id(api_key)))
    for field in ("prompt_tokens", "completion_tokens"):
        in_output = sum(o["response"]["body"]["usage"][field] for o in outputs)
        assert int(billed[field.encode()]) == in_output, f"{field} billed twice for a line"
    assert int(billed[b"requests"]) == _LINES


async def test_a_live_request_goes_before_a_batchs_waiting_lines(redis_server, tmp_path, api_key):
    """A batch keeps more lines in the router's fair queue than the worker has slots; a live
    request of the same key waits for one slot to free, not behind the batch's waiting lines
    (first in, first out it would wait for all of them: the baseline it must beat)."""
    slots, waiting_lines = 2, 10
    async with (
        running_router(
            redis_url=redis_server.url, fair_queue=FairQueueSection(enabled=True)
        ) as router,
        running_worker(sim_engine(max_parallel=slots), router, max_parallel=slots),
    ):
        config = batch_config(
            redis_server.url, router.address, str(tmp_path), concurrency=slots + waiting_lines
        )
        gateway = await start_gateway(config)
        try:
            async with sdk(gateway, api_key, timeout=60) as client:
                alone_started = time.monotonic()
                await client.chat.completions.create(**_ASK)
                line_s = time.monotonic() - alone_started  # one request's whole time alone
                batch = await submit(client, [chat_line(f"l{i}", **_LONGER) for i in range(40)])
                while (await client.batches.retrieve(batch.id)).request_counts.completed < 1:
                    await asyncio.sleep(0.02)
                waits = []
                for _ in range(3):
                    started = time.monotonic()
                    stream = await client.chat.completions.create(**_ASK, stream=True)
                    async for _chunk in stream:
                        waits.append(time.monotonic() - started)
                        break
                    await stream.close()
                still_waiting = (await client.batches.retrieve(batch.id)).request_counts
                await client.batches.cancel(batch.id)
        finally:
            await gateway.close()
    assert still_waiting.completed < 40 - waiting_lines, "the batch was no longer backlogged"
    fifo_wait_s = waiting_lines / slots * line_s
    assert statistics.median(waits) < 1.5 * line_s < fifo_wait_s / 3, (waits, line_s)


async def test_a_batch_waits_out_a_router_that_is_down_and_loses_no_line(
    redis_server, tmp_path, api_key
):
    """Lines answered 503 while the router is down are run again once it is back, never kept
    as their result."""
    router_port = free_port()
    config = batch_config(
        redis_server.url, f"127.0.0.1:{router_port}", str(tmp_path), concurrency=4
    )
    gateway = await start_gateway(config)
    try:
        async with sdk(gateway, api_key) as client:
            batch = await submit(client, [chat_line(f"l{i}") for i in range(6)])
            await asyncio.sleep(0.5)  # lines tried, and refused, meanwhile
            while_down = await client.batches.retrieve(batch.id)
            async with (
                running_router(redis_url=redis_server.url, port=router_port) as router,
                running_worker(sim_engine(zero_latency=True), router),
            ):
                ended = await client.batches.retrieve(batch.id)
                while ended.status != "completed":
                    await asyncio.sleep(0.05)
                    ended = await client.batches.retrieve(batch.id)
    finally:
        await gateway.close()
    assert while_down.status == "in_progress"
    assert (while_down.request_counts.completed, while_down.request_counts.failed) == (0, 0)
    assert (ended.request_counts.completed, ended.request_counts.failed) == (6, 0)
    assert ended.error_file_id is None


async def test_two_gateways_share_a_batch_and_run_each_line_once(
    redis_server, redis_client, tmp_path, api_key
):
    async with (
        running_router(redis_url=redis_server.url) as router,
        running_worker(sim_engine(max_parallel=8), router),
    ):
        config = batch_config(redis_server.url, router.address, str(tmp_path), concurrency=2)
        replicas = [await start_gateway(config) for _ in range(2)]
        try:
            async with sdk(replicas[0], api_key) as client:
                batch = await submit(client, [chat_line(f"l{i}", **_LONGER) for i in range(16)])
                claims = f"{batch_key(key_id(api_key), batch.id)}:claims"
                owners: set[bytes] = set()
                ended = batch
                while ended.status != "completed":
                    owners |= {c.partition(b":")[2] for c in await redis_client.hvals(claims)}
                    await asyncio.sleep(0.02)
                    ended = await client.batches.retrieve(batch.id)
                output = (await client.files.content(ended.output_file_id)).content
        finally:
            for replica in replicas:
                await replica.close()
    assert len(owners) == 2, f"lines claimed by {owners}"
    custom_ids = sorted(json.loads(line)["custom_id"] for line in output.splitlines())
    assert custom_ids == sorted(f"l{i}" for i in range(16))


async def test_a_runner_starts_no_line_while_its_event_loop_lags(
    redis_server, redis_client, tmp_path, api_key
):
    """Live requests first: with the process's event loop held up (a callback that blocks it
    4 ms at a time, past a 1 ms bound), the runner claims no line of a new batch; once the loop
    runs freely, the batch runs to its end."""

    async def hold_up_the_loop() -> None:
        while True:
            time.sleep(0.004)
            await asyncio.sleep(0)

    async with (
        running_router(redis_url=redis_server.url) as router,
        running_worker(sim_engine(zero_latency=True), router),
    ):
        config = batch_config(
            redis_server.url, router.address, str(tmp_path), concurrency=4, max_loop_lag_ms=1.0
        )
        gateway = await start_gateway(config)
        try:
            async with sdk(gateway, api_key) as client:
                holding = asyncio.create_task(hold_up_the_loop())
                await asyncio.sleep(0.2)  # the lag's average climbs past the bound
                batch = await submit(client, [chat_line(f"l{i}") for i in range(6)])
                await asyncio.sleep(0.5)
                claimed_while_lagging = await redis_client.hget(
                    batch_key(key_id(api_key), batch.id), "next"
                )
                await cancel_and_wait(holding)
                ended = await batch_ended(client, batch.id)
        finally:
            await gateway.close()
    assert claimed_while_lagging in (None, b"0"), claimed_while_lagging
    assert (ended.request_counts.completed, ended.request_counts.failed) == (6, 0)
