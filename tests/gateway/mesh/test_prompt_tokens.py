"""The gateway's one tokenization per request, through the real gateway, router and worker on
the tiny model with the official openai SDK: the ids the gateway sends are the worker's own
rendering of the same request (chat with tools, raw prompt, a multi-turn history with tool
calls), from the first request on (which waits for the tokenizer being loaded), and in front of
workers whose tokenizer it cannot load."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from gateway.mesh.route_stream_client import without_ids
from gateway.mesh.state import PROMPT_TOKENS
from infermesh.pb import common_pb2
from infermesh.prefix_hash import BLOCK_TOKENS, chain
from infermesh.sim_tokens import SIM_TOKENIZER, prompt_text, sim_token_ids
from tests.helpers import MODEL
from tests.helpers.gateway import make_config, sdk, start_gateway
from tests.helpers.inprocess import eventually, running_worker, sim_engine, wait_for_workers
from tests.helpers.tools import TOOLS
from worker_svc.config import DEFAULT_MODEL_PATH
from worker_svc.engine.api import GenerationChunk, GenerationRequest
from worker_svc.engine.prompt_ids import prompt_token_ids
from worker_svc.torch_engine.engine import Engine

_HISTORY = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    {"role": "assistant", "content": "21 degrees in Paris."},
    {"role": "user", "content": "and in Rome? " + "Some more context. " * 20},
]


class _Recording:
    """The real engine, keeping the requests it was asked to generate (the test reads what
    the gateway sent, as the worker received it)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.requests: list[GenerationRequest] = []

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        self.requests.append(request)
        return self._engine.generate(request)


@pytest.fixture
def recording(tiny_engine) -> _Recording:
    return _Recording(tiny_engine)


@pytest.fixture
async def gateway(
    redis_server, router, recording
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async with running_worker(recording, router):
        client = await start_gateway(make_config(redis_server.url, router.address))
        yield client
        await client.close()


def _own_rendering(engine: Engine, request: GenerationRequest) -> list[int]:
    return prompt_token_ids(
        engine.tokenizer, dataclasses.replace(request, prompt_token_ids=(), tokenizer="")
    )


async def test_the_gateways_ids_are_the_workers_own_rendering(
    gateway, api_key, recording, tiny_engine
):
    async with sdk(gateway, api_key, timeout=60) as client:
        # right after the gateway started: it waits for the tokenizer being loaded
        first = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert first.choices[0].message is not None
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "weather in Paris?"}],
            tools=TOOLS,
            max_tokens=2,
        )
        await client.completions.create(model=MODEL, prompt="Once upon a time " * 8, max_tokens=2)
        await client.chat.completions.create(
            model=MODEL, messages=_HISTORY, tools=TOOLS, max_tokens=2
        )
    digest = tiny_engine.tokenizer.text_files.digest
    sent = recording.requests
    assert len(sent) == 4
    assert sent[1].constraints.tools and sent[2].prompt is not None and len(sent[3].messages) == 6
    for request in sent:
        assert request.tokenizer == digest
        assert list(request.prompt_token_ids) == _own_rendering(tiny_engine, request)


async def test_prefix_hashes_chain_the_ids(gateway, api_key):
    prompt_tokens = gateway.app[PROMPT_TOKENS]
    prompt_tokens.renderer(MODEL)  # starts learning it
    await eventually(lambda: prompt_tokens.renderer(MODEL) is not None, timeout_s=60)
    request = common_pb2.GenerateRequest(model=MODEL, prompt="Once upon a time " * 40)
    await prompt_tokens.fill(request)
    ids = list(request.prompt_token_ids)
    assert len(ids) > 3 * BLOCK_TOKENS
    assert list(request.prefix_hashes) == chain(ids) and len(ids) // BLOCK_TOKENS == len(
        request.prefix_hashes
    )
    unknown = common_pb2.GenerateRequest(model="not-served", prompt="hello")
    await prompt_tokens.fill(unknown)
    assert not unknown.prompt_token_ids and not unknown.tokenizer and not unknown.prefix_hashes


async def test_the_gateway_follows_the_fleet_to_a_new_tokenizer(
    redis_server, router, api_key, tiny_engine, worker_dtype, tmp_path
):
    """Workers restarted with another chat template (another digest): the gateway loads theirs
    at its next look, and what it sends is their rendering."""
    template = tmp_path / "template.jinja"
    template.write_text(
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    )
    renewed = await asyncio.to_thread(
        Engine.from_checkpoint, DEFAULT_MODEL_PATH, dtype=worker_dtype, chat_template=str(template)
    )
    new_digest = renewed.tokenizer.text_files.digest
    assert new_digest != tiny_engine.tokenizer.text_files.digest
    config = make_config(redis_server.url, router.address)
    config = dataclasses.replace(
        config, router=dataclasses.replace(config.router, tokenizer_refresh_s=0.2)
    )
    client = await start_gateway(config)
    prompt_tokens = client.app[PROMPT_TOKENS]

    def digest_now() -> str | None:
        renderer = prompt_tokens.renderer(MODEL)
        return None if renderer is None else renderer.digest

    try:
        async with running_worker(tiny_engine, router, worker_id="old"):
            await eventually(lambda: digest_now() == tiny_engine.tokenizer.text_files.digest, 60)
        recording = _Recording(renewed)
        async with running_worker(recording, router, worker_id="new"):
            await wait_for_workers(router, lambda ids: ids == {"new"}, timeout_s=10)
            await eventually(lambda: digest_now() == new_digest, 60)
            async with sdk(client, api_key, timeout=60) as openai_client:
                await openai_client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
        (sent,) = recording.requests
        assert sent.tokenizer == new_digest
        assert list(sent.prompt_token_ids) == _own_rendering(renewed, sent)
        assert "[user] hi" in renewed.tokenizer.hf.decode(list(sent.prompt_token_ids))
    finally:
        await client.close()
        await renewed.close()


async def test_a_simulated_fleet_gets_its_simulated_tokens(redis_server, router, api_key):
    """No files to fetch: from the gateway's first look at the fleet, its requests carry the
    simulated engine's own tokens, which it serves."""
    recording = _Recording(sim_engine())
    async with running_worker(recording, router):
        client = await start_gateway(make_config(redis_server.url, router.address))
        try:
            prompt_tokens = client.app[PROMPT_TOKENS]
            prompt_tokens.renderer(MODEL)  # starts its look at the fleet
            await eventually(lambda: prompt_tokens.renderer(MODEL) is not None)
            messages = [{"role": "user", "content": "hi " * 30}]
            async with sdk(client, api_key) as openai_client:
                answer = await openai_client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=3
                )
        finally:
            await client.close()
    (sent,) = recording.requests
    assert sent.tokenizer == SIM_TOKENIZER
    assert list(sent.prompt_token_ids) == sim_token_ids(prompt_text(messages, None))
    assert answer.usage.prompt_tokens == len(sent.prompt_token_ids)
    assert answer.usage.completion_tokens == 3


def test_the_router_is_asked_with_the_prefix_hashes_not_the_prompt_ids():
    request = common_pb2.GenerateRequest(
        prompt_token_ids=list(range(40)), prefix_hashes=chain(list(range(40)))
    )
    assert not without_ids(request).prompt_token_ids and len(request.prefix_hashes) == 2
    # no hashes (a prompt under one block): the ids are all the router has to count it by
    short = common_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3])
    assert list(without_ids(short).prompt_token_ids) == [1, 2, 3]
