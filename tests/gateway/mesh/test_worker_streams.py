"""Many requests over one long-lived Worker.Serve stream per gateway-worker pair: real gateway,
router, worker (simulated engine) and Redis, the official SDK as the client."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import socket
import warnings
from collections.abc import AsyncIterator
from typing import Any

import grpc
import openai
import pytest
from prometheus_client import REGISTRY

from gateway.config import GatewayConfig
from gateway.mesh.state import MESH
from infermesh.channels import WorkerChannels
from infermesh.pb import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from infermesh.serve_client import ServeClient
from tests.helpers import MODEL
from tests.helpers.gateway import make_config, sdk, start_gateway
from tests.helpers.inprocess import (
    PLAINTEXT,
    RunningRouter,
    RunningWorker,
    eventually,
    running_worker,
    sim_engine,
)
from worker_svc.sim_engine.engine import SimEngine


def _config(redis_url: str, router_address: str, **router: Any) -> GatewayConfig:
    config = make_config(redis_url, router_address)
    return dataclasses.replace(config, router=dataclasses.replace(config.router, **router))


def _chat(max_tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    """A simulated H100 (a few ms per step), 128 sequences at once."""
    engine = sim_engine("H100", max_parallel=128, max_waiting=128)
    yield engine
    await engine.close()


@pytest.fixture
async def sim_worker(router, engine) -> AsyncIterator[RunningWorker]:
    async with running_worker(engine, router, "sim") as worker:
        yield worker


async def test_many_concurrent_requests_share_one_stream_one_event_per_token(
    redis_server, router, sim_worker, api_key
):
    gateway = await start_gateway(_config(redis_server.url, router.address))
    before = _metrics()
    try:
        async with sdk(gateway, api_key) as client:

            async def streamed() -> list[str]:
                stream = await client.chat.completions.create(**_chat(8), stream=True)
                return [
                    c.choices[0].delta.content
                    async for c in stream
                    if c.choices and c.choices[0].delta.content
                ]

            async def whole() -> int:
                answer = await client.chat.completions.create(**_chat(8))
                assert answer.choices[0].finish_reason == "length"
                return answer.usage.completion_tokens

            results = await asyncio.gather(
                *(streamed() for _ in range(40)), *(whole() for _ in range(20))
            )
        # every token its own SSE event: the worker sends each engine step's chunk apart
        assert [len(events) for events in results[:40]] == [8] * 40
        assert results[40:] == [8] * 20
        streams = gateway.app[MESH].serve_client
        assert streams.streams(sim_worker.servicer.info.address) == 1
        change = _change(before)
        # one engine step of every request open on the stream per message: far fewer
        # messages than the 340 chunks (40 x 8 tokens, 20 whole answers)
        assert 0 < change["received"] < 340
        assert 0 < change["sent"] <= 60  # opens batched the same way
        assert change["requests_open"] == 0 and change["streams_open"] == 1
    finally:
        await gateway.close()
    assert _change(before)["streams_open"] == 0


def _metrics() -> dict[str, float]:
    """The gateway's stream metrics now (the registry is the test process's, so tests look
    at changes)."""

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    return {
        "sent": value("infermesh_gateway_stream_messages_total", peer="worker", direction="sent"),
        "received": value(
            "infermesh_gateway_stream_messages_total", peer="worker", direction="received"
        ),
        "requests_open": value("infermesh_gateway_stream_requests_open"),
        "streams_open": value("infermesh_gateway_streams_open", peer="worker"),
        "breaks": value("infermesh_gateway_stream_breaks_total", peer="worker"),
        "slow_clients": value("infermesh_gateway_slow_clients_total"),
    }


def _change(before: dict[str, float]) -> dict[str, float]:
    return {name: value - before[name] for name, value in _metrics().items()}


def _open(request_id: int, max_tokens: int) -> worker_pb2.OpenRequest:
    return worker_pb2.OpenRequest(
        id=request_id,
        request=common_pb2.GenerateRequest(
            model=MODEL, prompt="count", sampling=common_pb2.SamplingParams(max_tokens=max_tokens)
        ),
    )


async def test_a_cancel_in_the_middle_of_a_batch_ends_only_that_request(sim_worker, engine):
    async with grpc.aio.insecure_channel(sim_worker.servicer.info.address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Serve()
        await call.write(worker_pb2.StreamRequest(open=[_open(i, 150) for i in (1, 2, 3)]))
        tokens = {1: 0, 2: 0, 3: 0}
        finished: set[int] = set()
        cancelled = False
        while finished != {1, 3}:
            response = await call.read()
            assert response is not grpc.aio.EOF
            for entry in response.chunks:
                assert not entry.code, entry.details
                tokens[entry.id] += len(entry.chunk.token_ids)
                if entry.chunk.finish_reason:
                    finished.add(entry.id)
            if not cancelled and all(tokens.values()):
                await call.write(worker_pb2.StreamRequest(cancel=[2]))
                cancelled = True
                await eventually(lambda: engine.load().running == 2)
        assert tokens[1] == tokens[3] == 150 and tokens[2] < 150
        assert 2 not in finished
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF  # every request ended: the worker ends the stream


async def test_a_bad_open_fails_that_request_not_the_stream(sim_worker):
    async with grpc.aio.insecure_channel(sim_worker.servicer.info.address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Serve()
        wrong = worker_pb2.OpenRequest(
            id=7, request=common_pb2.GenerateRequest(model="nope", prompt="x")
        )
        await call.write(worker_pb2.StreamRequest(open=[wrong, _open(8, 2)]))
        await call.done_writing()
        entries = [entry async for response in call for entry in response.chunks]
        assert (entries[0].id, grpc.StatusCode.NOT_FOUND.value[0]) == (7, entries[0].code)
        assert "not served here" in entries[0].details
        assert entries[-1].id == 8 and entries[-1].chunk.finish_reason


async def test_a_worker_that_dies_with_50_requests_open_fails_each_cleanly(
    redis_server, router, api_key
):
    engine = sim_engine("H100", max_parallel=64, max_waiting=64)
    gateway = await start_gateway(_config(redis_server.url, router.address))
    before = _metrics()
    try:
        async with (
            running_worker(engine, router, "doomed") as worker,
            sdk(gateway, api_key) as client,
        ):
            started = 0

            async def one() -> BaseException | None:
                nonlocal started
                stream = await client.chat.completions.create(**_chat(3000), stream=True)
                try:
                    first = True
                    async for _ in stream:
                        if first:
                            started, first = started + 1, False
                except openai.APIError as e:
                    return e
                return None

            requests = [asyncio.create_task(one()) for _ in range(50)]
            await eventually(lambda: started == 50, timeout_s=20)
            await worker.server.stop(grace=None)
            errors = await asyncio.wait_for(asyncio.gather(*requests), timeout=10)
        assert all(
            isinstance(e, openai.APIError) and "failed mid-stream" in e.message for e in errors
        ), errors
        change = _change(before)
        assert (change["breaks"], change["requests_open"]) == (1, 0)
    finally:
        await gateway.close()
        await engine.close()


class _RogueWorker(worker_pb2_grpc.WorkerServicer):
    """A worker that ends each of its Serve streams in the middle of requests: it takes the
    opens of up to ten requests, sends the first token of every other one, then ends the
    stream (returns from its handler, or aborts it, as a crashing worker would)."""

    def __init__(self, aborts: bool) -> None:
        self.aborts = aborts
        self.opened: list[int] = []  # every request opened on it, over all its streams
        self.started: list[int] = []  # those it sent a first token

    async def Serve(
        self,
        requests: AsyncIterator[worker_pb2.StreamRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[worker_pb2.StreamResponse]:
        opened: list[int] = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):  # however few the requests routed here
                async for message in requests:
                    opened += [o.id for o in message.open]
                    if len(opened) >= 10:
                        break
        started = opened[::2]
        self.opened += opened
        self.started += started
        first = common_pb2.GenerateResponse(text="x", token_ids=[1])
        yield worker_pb2.StreamResponse(
            chunks=[worker_pb2.StreamChunk(id=i, chunk=first) for i in started]
        )
        await asyncio.sleep(0.3)  # the first tokens reach the clients before the end
        if self.aborts:
            await context.abort(grpc.StatusCode.INTERNAL, "the rogue worker crashed")


@contextlib.asynccontextmanager
async def _rogue_worker(router: RunningRouter, aborts: bool) -> AsyncIterator[_RogueWorker]:
    """A rogue worker on loopback, registered with ``router`` as the fastest worker there, so
    that requests go to it first."""
    rogue = _RogueWorker(aborts)
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(rogue, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await router.stub.Register(
            router_pb2.RegisterRequest(
                worker=common_pb2.WorkerInfo(
                    worker_id="rogue",
                    address=f"127.0.0.1:{port}",
                    models=[MODEL],
                    capabilities=common_pb2.Capabilities(
                        max_parallel=64, decode_tokens_per_second=1e6
                    ),
                )
            )
        )
        yield rogue
    finally:
        await server.stop(grace=None)


@pytest.mark.parametrize("aborts", [False, True], ids=["returns", "aborts"])
async def test_a_worker_that_ends_its_stream_mid_requests_fails_them_cleanly(
    redis_server: Any, router: RunningRouter, api_key: str, caplog: Any, aborts: bool
) -> None:
    """Requests the rogue never started fall back to the healthy worker and finish; those it
    sent a first token end with an error event; and the gateway's stream client leaves no
    task or generator pending behind the ended stream."""
    caplog.set_level(logging.WARNING)
    engine = sim_engine("H100", max_parallel=64, max_waiting=64, zero_latency=True)
    gateway = await start_gateway(_config(redis_server.url, router.address))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            async with (
                _rogue_worker(router, aborts) as rogue,
                running_worker(engine, router, "healthy"),
                sdk(gateway, api_key) as client,
            ):

                async def one() -> tuple[list[str], str | None]:
                    texts: list[str] = []
                    try:
                        stream = await client.chat.completions.create(
                            model=MODEL,
                            messages=[{"role": "user", "content": "hi"}],
                            max_tokens=20,
                            stream=True,
                        )
                        async for c in stream:
                            if c.choices and c.choices[0].delta.content:
                                texts.append(c.choices[0].delta.content)
                    except openai.APIError as e:
                        return texts, e.message
                    return texts, None

                results = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(20))), 20)
        finally:
            await gateway.close()
            await engine.close()
        gc.collect()  # a task or generator left pending is reported when collected
        await asyncio.sleep(0.1)
    failed = [(texts, error) for texts, error in results if error is not None]
    finished = [texts for texts, error in results if error is None]
    assert len(rogue.opened) > len(rogue.started) > 0  # both kinds of request were open on it
    # each request the rogue started ends after its first token with an error event
    assert len(failed) == len(rogue.started)
    # the worker's own failure, named as the worker's, with its status
    ended = (
        "worker rogue failed mid-stream: the rogue worker crashed (INTERNAL)"
        if aborts
        else "worker rogue failed mid-stream: the worker ended the stream"
    )
    assert all(texts == ["x"] and ended in error for texts, error in failed), failed
    # the others (those it never started among them) finish on the healthy worker
    assert len(finished) == 20 - len(rogue.started)
    assert all(len(texts) == 20 for texts in finished)
    leftovers = [
        r.getMessage()
        for r in caplog.records
        if r.name == "asyncio" or "already running" in r.getMessage()
    ]
    assert leftovers == [] and [str(w.message) for w in warned] == []


async def _slow_reader(port: int, api_key: str, body: dict[str, object]) -> socket.socket:
    """An HTTP client that sends a streamed request, then does not read: a tiny receive
    buffer, so that the gateway's writes soon wait for it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    data = json.dumps(body).encode()
    await asyncio.get_running_loop().sock_sendall(
        sock,
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        + data,
    )
    return sock


async def test_a_slow_client_ends_with_an_error_and_stalls_no_other(redis_server, router, api_key):
    engine = sim_engine("H100", max_parallel=64, max_waiting=64, zero_latency=True)
    # the fast streams are shorter than the bound: however slowly a loaded machine lets their
    # clients read, only the slow one can overflow
    gateway = await start_gateway(
        _config(redis_server.url, router.address, stream_buffer_chunks=256)
    )
    before = _metrics()
    try:
        async with running_worker(engine, router, "fast"), sdk(gateway, api_key) as client:
            slow = await _slow_reader(gateway.port, api_key, {**_chat(30_000), "stream": True})
            try:

                async def fast() -> int:
                    stream = await client.chat.completions.create(
                        **_chat(200), stream=True, stream_options={"include_usage": True}
                    )
                    return [c async for c in stream][-1].usage.completion_tokens

                # the slow request overflows its buffer and is cancelled on the worker
                # while the fast ones on the same stream finish
                assert await asyncio.gather(*(fast() for _ in range(10))) == [200] * 10
                await eventually(lambda: engine.load().running == 0, timeout_s=20)
                received = b""
                while chunk := await asyncio.get_running_loop().sock_recv(slow, 1 << 20):
                    received += chunk
            finally:
                slow.close()
        assert b'"code":"client_too_slow"' in received
        assert _change(before)["slow_clients"] == 1
        assert received.endswith(b"data: [DONE]\n\n") or received.endswith(b"0\r\n\r\n")
    finally:
        await gateway.close()
        await engine.close()


async def test_a_reader_slower_than_the_stall_timeout_is_no_stall(sim_worker):
    """Stalls are the worker's silence, timed where chunks arrive: a reader that pauses past
    the stall timeout while the worker keeps sending still gets every chunk."""
    channels = WorkerChannels(PLAINTEXT)
    streams = ServeClient(channels, per_worker=1, buffered_chunks=4096)
    request = _open(1, 60).request
    try:
        chunks = streams.chunks(
            sim_worker.servicer.info.address, request, whole=False, timeout_s=30, stall_s=0.1
        )
        tokens = len((await anext(chunks)).token_ids)
        await asyncio.sleep(0.5)  # five stall timeouts, while the worker goes on
        async for chunk in chunks:
            tokens += len(chunk.token_ids)
        assert tokens == 60
    finally:
        await streams.close()
        await channels.close()
