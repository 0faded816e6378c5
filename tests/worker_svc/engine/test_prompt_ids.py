"""The worker's side of one tokenization per request: its tokenizer's files over
Worker.TextFiles (digest, chunks, a simulated engine's NOT_FOUND), and the prompt ids a caller
sends: served when their digest is the worker's, rendered again when it is another."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import pytest

from infermesh.pb import common_pb2, worker_pb2
from infermesh.text.text_files import CHUNK_BYTES, SERVED_TEMPLATE, TextFiles, assembled
from tests.helpers import MODEL
from tests.helpers.inprocess import sim_engine
from tests.helpers.worker_client import LoopbackWorker, loopback_worker
from worker_svc.torch_engine.engine import Engine


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


async def _answer(
    worker: LoopbackWorker, request: common_pb2.GenerateRequest
) -> tuple[list[int], int]:
    reply = await worker.complete(request)
    return list(reply.token_ids), reply.usage.prompt_tokens


async def test_text_files_come_in_chunks_and_make_the_digest_the_worker_reports(
    tiny_engine: Engine,
):
    async with loopback_worker(tiny_engine) as worker:
        chunks = [c async for c in worker.stub.TextFiles(worker_pb2.TextFilesRequest(), timeout=30)]
    digest = worker.info.capabilities.tokenizer
    assert digest.startswith("sha256:") and digest == tiny_engine.tokenizer.text_files.digest
    assert all(len(c.data) <= CHUNK_BYTES for c in chunks)
    assert len(chunks) > len({c.name for c in chunks if c.name})  # tokenizer.json: > 1 MiB
    files = assembled((c.name, c.data) for c in chunks)
    assert {"tokenizer.json", "tokenizer_config.json", SERVED_TEMPLATE} <= set(files)
    assert TextFiles.of(files).digest == digest
    assert files[SERVED_TEMPLATE].decode() == tiny_engine.tokenizer.hf.chat_template


async def test_a_simulated_worker_has_no_text_files():
    async with loopback_worker(sim_engine()) as worker:
        assert worker.info.capabilities.tokenizer == "bytes:4"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [c async for c in worker.stub.TextFiles(worker_pb2.TextFilesRequest(), timeout=10)]
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
    async with loopback_worker(tiny_engine) as worker:
        digest = worker.info.capabilities.tokenizer
        own = await _answer(worker, _request(text))
        of_other = await _answer(worker, _request(other))
        assert own != of_other
        assert await _answer(worker, _request(text, other_ids, digest)) == of_other
        # another tokenizer's ids: the worker renders the text itself, and answers it right
        assert await _answer(worker, _request(text, other_ids, "sha256:" + "0" * 64)) == own
        assert own[1] == len(tokenizer.encode(text))
        count = await worker.stub.Tokenize(_request(text, other_ids, digest), timeout=30)
        assert count.prompt_tokens == len(other_ids)


async def test_ids_outside_the_vocabulary_are_invalid_argument(tiny_engine: Engine):
    vocab = tiny_engine.tokenizer.vocab_size
    async with loopback_worker(tiny_engine) as worker:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.complete(_request("hi", [1, vocab], worker.info.capabilities.tokenizer))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{vocab} is not a token id" in (refused.value.details() or "")
        assert (await _answer(worker, _request("hi")))[1] > 0  # and it keeps serving


async def test_a_simulated_worker_serves_simulated_ids_it_is_sent():
    async with loopback_worker(sim_engine()) as worker:
        ids = list(range(1, 41))
        own = await worker.stub.Tokenize(_request("hi"), timeout=10)
        sent = await worker.stub.Tokenize(
            _request("hi", ids, worker.info.capabilities.tokenizer), timeout=10
        )
        other = await worker.stub.Tokenize(_request("hi", ids, "sha256:" + "0" * 64), timeout=10)
    assert own.prompt_tokens == 1 and sent.prompt_tokens == 40 and other.prompt_tokens == 1
