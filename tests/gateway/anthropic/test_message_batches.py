"""Anthropic's Message Batches API through the real gateway, a real router, a simulated worker
and Redis, with the official anthropic SDK, on the runner OpenAI's batches use."""

from __future__ import annotations

import asyncio

import anthropic
import pytest

from gateway.accounts.keys import create_key
from tests.helpers import MODEL


def _client(gateway, key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=str(gateway.make_url("")), api_key=key, max_retries=0, timeout=10
    )


def _request(custom_id: str, **params: object) -> dict[str, object]:
    ask = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": custom_id}]}
    return {"custom_id": custom_id, "params": {**ask, **params}}


async def test_a_message_batch_ends_with_every_result(sim_served, redis_client, api_key):
    # a model no worker serves: a valid request, refused only when it runs
    requests = [_request(f"r{i}") for i in range(4)] + [_request("bad", model="no-such-model")]
    async with _client(sim_served, api_key) as client:
        created = await client.messages.batches.create(requests=requests)
        assert created.processing_status == "in_progress"
        assert created.request_counts.processing == 5 and created.results_url is None
        batch = created
        while batch.processing_status != "ended":
            await asyncio.sleep(0.05)
            batch = await client.messages.batches.retrieve(created.id)
        results = [r async for r in await client.messages.batches.results(created.id)]
        listed = [b.id async for b in client.messages.batches.list()]
        async with _client(sim_served, await create_key(redis_client, "other")) as other:
            with pytest.raises(anthropic.NotFoundError):
                await other.messages.batches.retrieve(created.id)
    counts = batch.request_counts
    assert (counts.succeeded, counts.errored, counts.processing) == (4, 1, 0)
    assert batch.ended_at is not None and batch.results_url.endswith(f"{created.id}/results")
    by_id = {r.custom_id: r.result for r in results}
    assert sorted(by_id) == ["bad", "r0", "r1", "r2", "r3"]
    for i in range(4):
        message = by_id[f"r{i}"]
        assert message.type == "succeeded" and message.message.type == "message"
        assert message.message.usage.output_tokens >= 1
    assert by_id["bad"].type == "errored"
    assert by_id["bad"].error.error.type == "not_found_error"
    assert listed == [created.id]


async def test_a_bad_request_refuses_the_whole_batch_and_stores_nothing(sim_served, api_key):
    async with _client(sim_served, api_key) as client:
        for requests, says in (
            ([_request("a"), _request("a")], "Duplicate custom_id 'a'"),
            ([_request("a", stream=True)], "cannot stream"),
            ([_request("not ok!")], "custom_id"),
            # each request's params checked as POST /v1/messages checks its body
            ([_request("a"), _request("b", temperature=7)], "requests.1.params: Invalid value"),
            ([_request("a", messages=[])], "requests.0.params: Invalid value for 'messages'"),
            ([{"custom_id": "a", "params": {"model": MODEL}}], "requests.0.params: Missing"),
            ([_request("a", container="c")], "requests.0.params: 'container' is not supported"),
        ):
            with pytest.raises(anthropic.BadRequestError) as refused:
                await client.messages.batches.create(requests=requests)
            assert refused.value.body["type"] == "error"
            assert refused.value.body["error"]["type"] == "invalid_request_error"
            assert says in refused.value.body["error"]["message"]
        assert [b.id async for b in client.messages.batches.list()] == []
