"""The worker's side of one tokenization per request: its tokenizer's files over
Worker.TextFiles (digest, chunks, a simulated engine's NOT_FOUND), and the prompt ids a caller
sends: served when their digest is the worker's, rendered again when it is another."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest

from infermesh.pb import common_pb2, worker_pb2, worker_pb2_grpc
from infermesh.text.text_files import CHUNK_BYTES, SERVED_TEMPLATE, TextFiles, assembled
from tests.helpers import MODEL
from tests.helpers.inprocess import PLAINTEXT, sim_engine
from worker_svc import server as worker_server
from worker_svc.config import ServerSection, WorkerConfig
from worker_svc.engine_api import InferenceEngine
from worker_svc.torch_engine.engine import Engine


@contextlib.asynccontextmanager
async def _worker(
    engine: InferenceEngine,
) -> AsyncIterator[tuple[worker_pb2_grpc.WorkerStub, common_pb2.WorkerInfo]]:
    config = WorkerConfig(server=ServerSection(port=0), tls=PLAINTEXT)
    server, servicer = await worker_server.create_server(config, engine)
    try:
        async with grpc.aio.insecure_channel(servicer.info.address) as channel:
            yield worker_pb2_grpc.WorkerStub(channel), servicer.info
    finally:
        await server.stop(grace=None)


def _request(
    prompt: str, ids: Sequence[int] = (), tokenizer: str = ""
) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        request_id="r",
        model=MODEL,
        prompt=prompt,
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=8),
        prompt_token_ids=ids,
        tokenizer=tokenizer,
    )


async def _answer(stub, request) -> tuple[list[int], int]:
    reply = await stub.Complete(request, timeout=60)
    return list(reply.token_ids), reply.usage.prompt_tokens


async def test_text_files_come_in_chunks_and_make_the_digest_the_worker_reports(
    tiny_engine: Engine,
):
    async with _worker(tiny_engine) as (stub, info):
        chunks = [c async for c in stub.TextFiles(worker_pb2.TextFilesRequest(), timeout=30)]
    digest = info.capabilities.tokenizer
    assert digest.startswith("sha256:") and digest == tiny_engine.tokenizer.text_files.digest
    assert all(len(c.data) <= CHUNK_BYTES for c in chunks)
    assert len(chunks) > len({c.name for c in chunks if c.name})  # tokenizer.json: > 1 MiB
    files = assembled((c.name, c.data) for c in chunks)
    assert {"tokenizer.json", "tokenizer_config.json", SERVED_TEMPLATE} <= set(files)
    assert TextFiles.of(files).digest == digest
    assert files[SERVED_TEMPLATE].decode() == tiny_engine.tokenizer.hf.chat_template


async def test_a_simulated_worker_has_no_text_files():
    async with _worker(sim_engine()) as (stub, info):
        assert info.capabilities.tokenizer == "bytes:4"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [c async for c in stub.TextFiles(worker_pb2.TextFilesRequest(), timeout=10)]
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'bytes:4' has no files" in refused.value.details()


async def test_ids_of_the_workers_tokenizer_are_served_and_others_rendered_again(
    tiny_engine: Engine,
):
    """The request's text and its ids say different things, so the answer shows which one the
    worker served."""
    tokenizer = tiny_engine.tokenizer
    text, other = "The cat sat on the mat", "A completely different prompt, longer than the first"
    other_ids = tokenizer.encode(other)
    async with _worker(tiny_engine) as (stub, info):
        digest = info.capabilities.tokenizer
        own = await _answer(stub, _request(text))
        of_other = await _answer(stub, _request(other))
        assert own != of_other
        assert await _answer(stub, _request(text, other_ids, digest)) == of_other
        # another tokenizer's ids: the worker renders the text itself, and answers it right
        assert await _answer(stub, _request(text, other_ids, "sha256:" + "0" * 64)) == own
        assert own[1] == len(tokenizer.encode(text))
        count = await stub.Tokenize(_request(text, other_ids, digest), timeout=30)
        assert count.prompt_tokens == len(other_ids)


async def test_ids_outside_the_vocabulary_are_invalid_argument(tiny_engine: Engine):
    vocab = tiny_engine.tokenizer.vocab_size
    async with _worker(tiny_engine) as (stub, info):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Complete(_request("hi", [1, vocab], info.capabilities.tokenizer))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{vocab} is not a token id" in (refused.value.details() or "")
        assert (await _answer(stub, _request("hi")))[1] > 0  # and it keeps serving


async def test_a_simulated_worker_serves_simulated_ids_it_is_sent():
    async with _worker(sim_engine()) as (stub, info):
        ids = list(range(1, 41))
        own = await stub.Tokenize(_request("hi"), timeout=10)
        sent = await stub.Tokenize(_request("hi", ids, info.capabilities.tokenizer), timeout=10)
        other = await stub.Tokenize(_request("hi", ids, "sha256:" + "0" * 64), timeout=10)
    assert own.prompt_tokens == 1 and sent.prompt_tokens == 40 and other.prompt_tokens == 1
