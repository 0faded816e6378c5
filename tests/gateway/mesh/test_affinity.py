"""Session affinity: an agent's turns share one system prompt with every other session, so the
session they name (a header, or ``prompt_cache_key``) decides their worker, not the prompt's head.
Real router, two simulated workers and Redis, the official SDK."""

from __future__ import annotations

import collections

from gateway.accounts.keys import key_id
from gateway.mesh.affinity import affinity_key
from gateway.openai.responses_store import ResponseStore
from tests.helpers import MODEL
from tests.helpers.gateway import make_config, sdk, start_gateway
from tests.helpers.inprocess import running_router, running_worker, sim_engine

_SYSTEM = "You are a coding agent. Use the tools to read and edit files. " * 40


def test_the_key_comes_from_the_body_hint_then_the_session_headers_scoped_by_api_key():
    codex = {"session-id": "s1"}
    claude = {"x-claude-code-session-id": "s1", "session-id": "other"}
    assert affinity_key("k1", codex) == affinity_key("k1", claude) != ""
    assert affinity_key("k1", codex, "s1") == affinity_key("k1", {}, "s1")
    assert affinity_key("k1", codex, "s2") != affinity_key("k1", codex)
    assert affinity_key("k2", codex) != affinity_key("k1", codex), "sessions are per API key"
    assert affinity_key("k1", {}) == "" and affinity_key("k1", {"session-id": ""}) == ""
    assert len(affinity_key("k1", {"session-id": "x" * 4096})) == 32
    assert "s1" not in affinity_key("k1", codex)


async def test_sessions_stay_on_their_worker_and_spread_over_the_fleet(redis_server, api_key):
    async with running_router(redis_url=redis_server.url) as router:
        engines = [sim_engine(zero_latency=True, max_parallel=64) for _ in range(2)]
        async with (
            running_worker(engines[0], router, "w0", max_parallel=64),
            running_worker(engines[1], router, "w1", max_parallel=64),
        ):
            gateway = await start_gateway(make_config(redis_server.url, router.address))
            try:
                async with sdk(gateway, api_key) as client:
                    placed = collections.defaultdict(set)
                    for turn in range(3):
                        for session in range(16):
                            history = [{"role": "system", "content": _SYSTEM}] + [
                                {"role": "user", "content": f"session {session} turn {t}"}
                                for t in range(turn + 1)
                            ]
                            hint = {"prompt_cache_key": f"c{session}"} if session % 2 else {}
                            raw = await client.chat.completions.with_raw_response.create(
                                model=MODEL,
                                messages=history,
                                max_tokens=2,
                                extra_headers={"session-id": f"s{session}"},
                                extra_body=hint,
                            )
                            placed[session].add(raw.headers["x-infermesh-worker"])
            finally:
                await gateway.close()
    assert all(len(workers) == 1 for workers in placed.values()), placed
    used = collections.Counter(next(iter(w)) for w in placed.values())
    assert set(used) == {"w0", "w1"}, f"16 sessions behind one system prompt: {used}"


async def test_a_response_chain_is_one_session(redis_server, redis_client, api_key):
    """Continued with previous_response_id, a chain keeps the session its first request named,
    else its first response's id: one affinity key for all its turns."""
    async with (
        running_router(redis_url=redis_server.url) as router,
        running_worker(sim_engine(zero_latency=True), router),
    ):
        gateway = await start_gateway(make_config(redis_server.url, router.address))
        try:
            async with sdk(gateway, api_key) as client:
                chains = []
                for first in ({}, {"prompt_cache_key": "c1"}, {"store": False}):
                    ask = {"model": MODEL, "max_output_tokens": 2}
                    response = await client.responses.create(**ask, input="turn 0", **first)
                    chain = [response.id]
                    while response.store and len(chain) < 3:
                        response = await client.responses.create(
                            **ask, input="next turn", previous_response_id=response.id
                        )
                        chain.append(response.id)
                    chains.append(chain)
        finally:
            await gateway.close()
    store = ResponseStore(redis_client, ttl_s=60, retry_after_s=1)
    kid = key_id(api_key)
    own, named, unstored = chains
    assert {(await store.load(kid, i)).session for i in own} == {own[0]}
    assert {(await store.load(kid, i)).session for i in named} == {"c1"}
    assert await store.load(kid, unstored[0]) is None
