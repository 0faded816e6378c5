"""The simulated engine prefills in chunks as the torch engine's scheduler does: a long prompt
beside a decoding sequence takes a step per [parallel] prefill_chunk_size tokens, each of which
also decodes that sequence, and the worker reports the chunk to the router."""

from __future__ import annotations

import asyncio

from infermesh.sim_tokens import BYTES_PER_TOKEN
from tests.helpers.inprocess import sim_engine
from worker_svc.engine.api import GenerationRequest, SamplingParams


def _request(tag: str, tokens: int, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        request_id=tag,
        messages=None,
        prompt=(f"{tag} " * tokens)[: tokens * BYTES_PER_TOKEN],
        sampling=SamplingParams(max_tokens=max_tokens),
    )


async def test_a_long_prompt_beside_a_decoding_sequence_is_prefilled_in_chunks():
    # zero latency: steps take no time, their order is what is counted
    engine = sim_engine(model="DeepSeek-V3", gpu="H200", zero_latency=True)
    assert engine.capabilities.prefill_chunk_tokens == 256
    events: list[str] = []
    decoding = engine.generate(_request("decoding", 20, 200))
    await anext(decoding)

    async def decode() -> None:
        async for _ in decoding:
            events.append("decoded")
            if "prefilled" in events:
                return

    async def prefill() -> None:
        async for _ in engine.generate(_request("long", 1024, 1)):
            events.append("prefilled")

    await asyncio.gather(decode(), prefill())
    # 1,024 tokens in chunks of 256: the decoding sequence's tokens of the three steps before the
    # last chunk's (a whole-prompt prefill would have none)
    assert events.index("prefilled") >= 3
    await engine.close()
