"""The Worker gRPC service on loopback, asked over Worker.Serve as the mesh asks it: admission,
cancellation, malformed input, usage and logprobs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from infermesh.pb import common_pb2, worker_pb2
from infermesh.ports import free_port
from tests.helpers import MODEL
from tests.helpers.inprocess import (
    PLAINTEXT,
    eventually,
    running_router,
    running_worker,
    sim_engine,
    wait_for_workers,
)
from tests.helpers.worker_client import loopback_worker, worker_client
from worker_svc.config import (
    DEFAULT_MODEL_PATH,
    ParallelSection,
    RouterSection,
    WorkerConfig,
    WorkerServerSection,
)
from worker_svc.engine.meters import PrefillSpeedMeter
from worker_svc.service.main import create_server as create_worker_server
from worker_svc.service.registration import Registration
from worker_svc.torch_engine.engine import Engine


def _request(prompt: str = "Hello there", **sampling) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        request_id="r",
        model=MODEL,
        prompt=prompt,
        sampling=common_pb2.SamplingParams(temperature=0, **sampling),
    )


async def test_usage_logprobs_and_cached_prompt_tokens_reach_the_proto(tiny_engine: Engine):
    async with loopback_worker(tiny_engine) as worker:
        prompt = "A long shared system prompt about latent attention. " * 6
        responses = [
            r
            async for r in worker.generate(
                _request(prompt, max_tokens=4, logprobs=True, top_logprobs=2)
            )
        ]
        again = [r async for r in worker.generate(_request(prompt, max_tokens=4))]
    # one logprob per token, however many tokens a chunk carries (a loaded machine merges them)
    assert [len(r.logprobs) for r in responses] == [len(r.token_ids) for r in responses]
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert len(logprobs) == 4 and all(len(lp.top) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert responses[0].logprobs[0].bytes == responses[0].logprobs[0].token.encode()
    assert (
        responses[-1].usage.completion_tokens == 4 and responses[-1].usage.cached_prompt_tokens == 0
    )
    assert again[-1].usage.cached_prompt_tokens > 0 and not again[0].logprobs
    assert [t for r in again for t in r.token_ids] == [t for r in responses for t in r.token_ids]


async def test_tokenize_counts_the_prompt_as_generate_bills_it(tiny_engine: Engine):
    chat = common_pb2.GenerateRequest(
        request_id="r",
        model=MODEL,
        messages=[common_pb2.ChatMessage(role="user", content="weather in Paris?")],
        tools=[common_pb2.Tool(name="get_weather", parameters_json='{"type": "object"}')],
        sampling=common_pb2.SamplingParams(max_tokens=2),
    )
    async with loopback_worker(tiny_engine) as worker:
        stub = worker.stub
        counted = await stub.Tokenize(chat)
        chunks = [r async for r in worker.generate(chat)]
        without_tools = common_pb2.GenerateRequest(request_id="r", model=MODEL)
        without_tools.messages.extend(chat.messages)
        fewer = await stub.Tokenize(without_tools)
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.Tokenize(common_pb2.GenerateRequest(request_id="r", model="nope"))
        with pytest.raises(grpc.aio.AioRpcError) as empty:
            await stub.Tokenize(common_pb2.GenerateRequest(request_id="r", model=MODEL))
    # the first chunk brings the prompt's count (the last the whole usage)
    assert chunks[0].usage.prompt_tokens == chunks[-1].usage.prompt_tokens == counted.prompt_tokens
    assert fewer.prompt_tokens < counted.prompt_tokens  # the tool definitions are counted
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_cancelled_request_frees_the_cache(tiny_engine: Engine):
    async with loopback_worker(tiny_engine) as worker:
        calls = [worker.generate(_request(f"stream {i}")) for i in range(3)]
        for call in calls:
            await anext(call)
        load = await worker.load()
        assert load.running == 3 and load.kv_cache_usage > 0
        for call in calls:
            await call.aclose()
        await eventually(lambda: tiny_engine.load().running == 0)
        load = await worker.load()
        assert load.running == 0 and load.kv_cache_usage == 0


async def test_invalid_utf8_is_invalid_argument_and_the_worker_keeps_serving(tiny_engine: Engine):
    async with (
        loopback_worker(tiny_engine) as worker,
        grpc.aio.insecure_channel(worker.address) as channel,
    ):
        opened = worker_pb2.StreamRequest(
            open=[worker_pb2.OpenRequest(id=1, request=_request("hi"))]
        )
        raw = opened.SerializeToString().replace(b"hi", b"\xff\xfe")
        serve = channel.stream_stream(
            "/infermesh.v1.Worker/Serve",
            request_serializer=lambda b: b,
            response_deserializer=worker_pb2.StreamResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [r async for r in serve(iter([raw]))]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in (
            err.value.details() or ""
        )
        # chunks that queued up while the stream was busy come merged: count tokens, not messages
        assert sum([len(r.token_ids) async for r in worker.generate(_request(max_tokens=3))]) == 3


async def test_bad_requests_are_invalid_argument_beside_good_streams(tiny_engine: Engine):
    async with loopback_worker(tiny_engine) as worker:
        good = worker.generate(_request(max_tokens=8))
        first = await anext(good)
        for request, detail in [
            (_request(stop=[str(i) for i in range(17)]), "at most 16"),
            (_request("word " * tiny_engine.max_model_len), "prompt is too long"),
            (_request(max_tokens=tiny_engine.max_model_len), "exceed context limit"),
            (
                common_pb2.GenerateRequest(
                    request_id="r",
                    model=MODEL,
                    prompt="hi",
                    batching=common_pb2.BatchingHints(max_parallel=0),
                ),
                "max_parallel",
            ),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [r async for r in worker.generate(request)]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and detail in (
                err.value.details() or ""
            )
        assert len(first.token_ids) + sum([len(r.token_ids) async for r in good]) == 8


async def test_past_the_waiting_bound_the_worker_answers_resource_exhausted(
    tiny_dir: Path, worker_dtype: str
):
    engine = Engine.from_checkpoint(
        tiny_dir, dtype=worker_dtype, parallel=ParallelSection(max_parallel=1, max_waiting=0)
    )
    try:
        async with loopback_worker(engine) as worker:
            running = worker.generate(_request())
            await anext(running)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [r async for r in worker.generate(_request(max_tokens=2))]
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in (
                err.value.details() or ""
            )
            await running.aclose()
            await eventually(lambda: engine.load().running == 0)
            tokens = [len(r.token_ids) async for r in worker.generate(_request(max_tokens=2))]
            assert sum(tokens) == 2
    finally:
        await engine.close()


async def test_batching_hints_reach_the_engine(tiny_engine: Engine):
    async with loopback_worker(tiny_engine) as worker:
        alone = common_pb2.GenerateRequest(
            request_id="alone",
            model=MODEL,
            prompt="one",
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=6),
            batching=common_pb2.BatchingHints(max_parallel=1, dynamic_batch_timeout_ms=50),
        )
        running: list[int] = []

        async def watch(request: common_pb2.GenerateRequest) -> None:
            async for chunk in worker.generate(request):  # merged chunks: one entry per token
                running.extend([tiny_engine.load().running] * len(chunk.token_ids))

        await asyncio.gather(watch(alone), watch(_request("two", max_tokens=6)))
    assert len(running) == 12 and max(running) == 1


async def test_a_whole_request_answers_one_message_equal_to_the_stream(tiny_engine: Engine):
    async with loopback_worker(tiny_engine) as worker:
        streamed = [r async for r in worker.generate(_request(max_tokens=6, logprobs=True))]
        whole = await worker.complete(_request(max_tokens=6, logprobs=True))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await worker.complete(_request(prompt="x", max_tokens=tiny_engine.max_model_len + 1))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await worker.load()).running == 0
    assert whole.text == "".join(r.text for r in streamed)
    assert list(whole.token_ids) == [t for r in streamed for t in r.token_ids]
    assert [lp.token for lp in whole.logprobs] == [lp.token for r in streamed for lp in r.logprobs]
    assert whole.finish_reason == streamed[-1].finish_reason and whole.usage == streamed[-1].usage


async def test_a_cancelled_whole_request_frees_the_sequence(tiny_engine: Engine):
    async with loopback_worker(tiny_engine) as worker:
        # no max_tokens: to the context's end
        call = asyncio.create_task(worker.complete(_request(prompt="go on")))
        await eventually(lambda: tiny_engine.load().running == 1)
        call.cancel()
        await eventually(lambda: tiny_engine.load().running == 0)


async def test_a_worker_registers_again_within_a_second_of_the_routers_return(redis_server):
    """The router is down past the heartbeat TTL, so the worker must register again; its
    channel's reconnect backoff must not have grown with the outage."""
    address = f"127.0.0.1:{free_port()}"
    engine = sim_engine()
    server, servicer = await create_worker_server(
        WorkerConfig(
            server=WorkerServerSection(port=0, worker_id="comeback"),
            router=RouterSection(address=address),
            tls=PLAINTEXT,
        ),
        engine,
    )
    reporter = asyncio.create_task(Registration(address, servicer, PLAINTEXT).run())
    loop = asyncio.get_running_loop()
    try:
        for outage_s in (0.0, 4.0):
            await asyncio.sleep(outage_s)
            async with running_router(
                ttl_s=1.0, redis_url=redis_server.url, port=int(address.rsplit(":", 1)[1])
            ) as router:
                back = loop.time()
                await wait_for_workers(router, lambda ids: "comeback" in ids)
                registered_s = loop.time() - back
        assert registered_s < 1.5
    finally:
        reporter.cancel()
        await server.stop(grace=None)
        await engine.close()


async def test_a_torch_worker_tells_the_router_the_prefill_speed_it_measures(
    worker_dtype: str, redis_server
):
    """A torch engine knows no prefill speed until it prefills; then it measures one, and its
    worker registers again to tell the router, which weighs cached prefixes by it. (An engine of
    its own: the shared one has prefilled already.)"""
    engine = Engine.from_checkpoint(DEFAULT_MODEL_PATH, dtype=worker_dtype)
    try:
        async with (
            running_router(redis_url=redis_server.url) as router,
            running_worker(engine, router, "measuring") as worker,
        ):
            assert worker.servicer.info.capabilities.prefill_tokens_per_second == 0
            async with worker_client() as client:
                prefill = _request("a prompt to prefill " * 40, max_tokens=1)
                await client.complete(worker.servicer.info.address, prefill)

            def told() -> float:
                entry = router.resources.registry.fleet.get("measuring")
                return 0.0 if entry is None else entry.info.capabilities.prefill_tokens_per_second

            await eventually(lambda: told() > 0)
            assert told() == pytest.approx(engine.load().prefill_tokens_per_second, rel=1e-6)
            # told at most every 30 s, however it moves
            assert not worker.registration.take_prefill_speed()
    finally:
        await engine.close()


def test_the_prefill_speed_is_prompt_tokens_over_the_steps_that_prefilled():
    meter = PrefillSpeedMeter(steps=2, min_tokens=64)
    assert meter.speed() == 0
    meter.add(1000, 0.5)
    meter.add(8, 0.1)  # a step of a few prompt tokens is its fixed cost: not counted
    assert meter.speed() == 2000
    meter.add(3000, 0.5)
    assert meter.speed() == 4000
    meter.add(600, 0.3)  # the oldest step leaves the window
    assert meter.speed() == 3600 / 0.8
