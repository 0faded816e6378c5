"""OpenAI's Files and Batch APIs through the real gateway, a real router, a simulated worker and
Redis, with the official openai SDK: a batch's lines run through the gateway's own API, at the
``batch`` tier, and end in its output and error files."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import openai
import pytest

from gateway.accounts.keys import create_key, key_id
from gateway.batches.records import BatchLine, new_record
from gateway.batches.state import BATCH_RECORDS
from gateway.config import BatchesSection, FilesSection
from gateway.http.loopback import BATCH_KEY_HEADER, LOOPBACK_HEADER
from infermesh.usage import usage_key
from tests.helpers import MODEL
from tests.helpers.batches import batch_ended, chat_line, jsonl, jsonl_of, upload_lines
from tests.helpers.gateway import batch_config, make_config, sdk, start_gateway
from tests.helpers.inprocess import running_router, running_worker, sim_engine


async def test_a_batch_of_chat_lines_with_one_bad_line_ends_with_outputs_and_an_errorchat_line(
    sim_served, redis_client, api_key
):
    lines = [chat_line(f"ok-{i}") for i in range(5)] + [chat_line("bad", temperature=-3)]
    async with sdk(sim_served, api_key) as client:
        input_id = await upload_lines(client, lines)
        created = await client.batches.create(
            input_file_id=input_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"job": "nightly"},
        )
        assert created.status == "in_progress" and created.request_counts.total == 6
        batch = await batch_ended(client, created.id)
        assert batch.status == "completed", batch
        assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 1)
        assert batch.metadata == {"job": "nightly"}
        outputs = await jsonl_of(client, batch.output_file_id)
        errors = await jsonl_of(client, batch.error_file_id)
        listed = [b.id async for b in client.batches.list()]
    assert sorted(o["custom_id"] for o in outputs) == [f"ok-{i}" for i in range(5)]
    for output in outputs:
        response = output["response"]
        assert response["status_code"] == 200 and output["error"] is None
        assert response["body"]["object"] == "chat.completion"
        assert response["body"]["usage"]["completion_tokens"] >= 1
        assert response["request_id"].startswith(created.id)
    (error,) = errors
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "temperature"
    usage = batch.usage
    assert usage.input_tokens == sum(
        o["response"]["body"]["usage"]["prompt_tokens"] for o in outputs
    )
    assert batch.model_extra["billed_tokens"] == round(usage.total_tokens * 0.5)
    assert listed == [created.id]
    usage = await redis_client.hgetall(usage_key(key_id(api_key)))
    assert int(usage[b"batch_requests"]) == 6
    assert int(usage[b"batch_billed_tokens"]) == batch.model_extra["billed_tokens"]


async def test_a_batch_past_its_window_expires_with_its_unrun_lines_in_the_error_file(
    sim_served, api_key
):
    kid = key_id(api_key)
    lines = [
        BatchLine(f"l{i}", "/v1/chat/completions", chat_line(f"l{i}")["body"]) for i in range(2)
    ]
    record = new_record(
        "openai", "batch_late", kid, "/v1/chat/completions", "file-x", 2, BatchesSection()
    )
    await sim_served.app[BATCH_RECORDS].create(
        dataclasses.replace(record, expires_at=int(time.time()) - 1), lines
    )
    async with sdk(sim_served, api_key) as client:
        batch = await batch_ended(client, "batch_late")
        errors = await jsonl_of(client, batch.error_file_id)
    assert batch.status == "expired" and batch.expired_at is not None
    assert batch.output_file_id is None
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("l0", "batch_expired"),
        ("l1", "batch_expired"),
    ]


async def test_a_batch_lines_credentials_work_only_on_the_process_own_socket(sim_served, api_key):
    """The runner's header over TCP, even with a key's id, is no key: 401."""
    response = await sim_served.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        headers={LOOPBACK_HEADER: "guessed", BATCH_KEY_HEADER: key_id(api_key)},
    )
    assert response.status == 401
    assert (await response.json())["error"]["code"] == "invalid_api_key"


async def test_lines_that_are_not_json_another_endpoint_a_repeated_id_or_too_large_fail_validation(
    sim_served, api_key
):
    lines = [
        chat_line("a"),
        b"{not json",
        chat_line("b", url="/v1/completions"),
        chat_line("a"),
        chat_line("big", messages=[{"role": "user", "content": "x" * (4 * 1024 * 1024)}]),
    ]
    async with sdk(sim_served, api_key) as client:
        upload = await client.files.create(file=("in.jsonl", jsonl(lines[:4])), purpose="batch")
        batch = await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await asyncio.sleep(0.2)
        again = await client.batches.retrieve(batch.id)
        with pytest.raises(openai.APIStatusError) as too_large:
            await upload_lines(client, lines)  # the 4 MiB line passes the file limit too
    assert batch.status == again.status == "failed" and batch.request_counts.total == 0
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_json_line"),
        (3, "mismatched_endpoint"),
        (4, "duplicate_custom_id"),
    ]
    assert too_large.value.status_code == 413
    assert too_large.value.body["code"] == "file_too_large"


async def test_a_line_over_the_body_limit_fails_validation(redis_server, tmp_path, api_key):
    config = dataclasses.replace(
        make_config(redis_server.url, max_body_bytes=2048),
        files=FilesSection(directory=str(tmp_path)),
    )
    gateway = await start_gateway(config)
    try:
        async with sdk(gateway, api_key) as client:
            big = chat_line("big", messages=[{"role": "user", "content": "x" * 4096}])
            upload = await upload_lines(client, [chat_line("small"), big])
            batch = await client.batches.create(
                input_file_id=upload, endpoint="/v1/chat/completions", completion_window="24h"
            )
    finally:
        await gateway.close()
    assert batch.status == "failed"
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "request_too_large")]


async def test_another_key_sees_no_file_nor_batch_of_this_key(sim_served, redis_client, api_key):
    other_key = await create_key(redis_client, "other")
    async with sdk(sim_served, api_key) as mine, sdk(sim_served, other_key) as theirs:
        file_id = await upload_lines(mine, [chat_line("a")])
        batch = await mine.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        for attempt in (
            theirs.files.retrieve(file_id),
            theirs.files.content(file_id),
            theirs.files.delete(file_id),
            theirs.batches.retrieve(batch.id),
            theirs.batches.cancel(batch.id),
            theirs.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                await attempt
        assert [f.id async for f in theirs.files.list()] == []
        assert [b.id async for b in theirs.batches.list()] == []
        assert (await mine.files.retrieve(file_id)).bytes == len(jsonl([chat_line("a")]))
        assert (await mine.files.delete(file_id)).deleted
        with pytest.raises(openai.NotFoundError):
            await mine.files.retrieve(file_id)


async def test_cancel_stops_a_running_batch(redis_server, tmp_path, api_key):
    """One line at a time on a slow worker: cancelled after its first lines, the batch ends
    cancelled with the lines that ran, and never runs the rest."""
    async with (
        running_router(redis_url=redis_server.url) as router,
        running_worker(sim_engine(max_parallel=4), router),
    ):
        config = batch_config(redis_server.url, router.address, str(tmp_path), concurrency=1)
        gateway = await start_gateway(config)
        try:
            async with sdk(gateway, api_key) as client:
                lines = [chat_line(f"l{i}", max_tokens=64) for i in range(40)]
                batch = await client.batches.create(
                    input_file_id=await upload_lines(client, lines),
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                )
                while (await client.batches.retrieve(batch.id)).request_counts.completed < 1:
                    await asyncio.sleep(0.02)
                cancelling = await client.batches.cancel(batch.id)
                ended = await batch_ended(client, batch.id)
                outputs = await jsonl_of(client, ended.output_file_id)
        finally:
            await gateway.close()
    assert cancelling.status == "cancelling"
    assert ended.status == "cancelled" and ended.cancelled_at is not None
    ran = ended.request_counts.completed
    assert 1 <= ran < 5, f"{ran} lines ran after the cancel"
    assert len(outputs) == ran and ended.request_counts.failed == 0
