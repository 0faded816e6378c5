"""The simulated engine's KV blocks with peers, through a real router and real worker servers:
prefill on P, decode on D (D's time to first token holds P's prefill and the blocks' time over
the link); a busy holder's prefix pulled over a fast link, computed over a slow one; blocks not
the prompt's refused; time scaled."""

from __future__ import annotations

import time
from typing import Any

import pytest

from infermesh.kv_link import kv_transfer_s
from infermesh.pb import common_pb2
from infermesh.prefix_hash import BLOCK_TOKENS, chain
from infermesh.sim_tokens import BYTES_PER_TOKEN, prompt_text, sim_token_ids
from router_svc.config import RoutingSection
from telemetry import metrics
from tests.helpers import MODEL
from tests.helpers.inprocess import (
    eventually,
    gateway_complete,
    running_router,
    running_worker,
    sim_engine,
)
from tests.helpers.worker_client import worker_client
from worker_svc.engine.api import (
    GenerationRequest,
    PeerBlock,
    PeerPrefix,
    RawTensor,
    SamplingParams,
)

# DeepSeek-V3 on 8 x H200: 37B active weights in FP8, 61 layers x 576 latent values in BF16
V3: dict[str, Any] = {"model": "DeepSeek-V3", "gpu": "H200"}
V3_BYTES_PER_TOKEN = 61 * 576 * 2


def _request(tag: str, tokens: int, max_tokens: int) -> common_pb2.GenerateRequest:
    """A prompt of ``tokens`` simulated tokens, with its block hashes as the gateway sends them."""
    prompt = (f"{tag} " * tokens * BYTES_PER_TOKEN)[: tokens * BYTES_PER_TOKEN]
    return common_pb2.GenerateRequest(
        request_id=tag,
        model=MODEL,
        prompt=prompt,
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
        prefix_hashes=chain(sim_token_ids(prompt_text(None, prompt))),
    )


async def _first_token_s(stub, request: common_pb2.GenerateRequest):
    """Seconds to the first chunk of the router's relay, the worker it names, the last chunk."""
    sent = time.monotonic()
    first_s, worker, last = None, "", None
    async for chunk in stub.Generate(request):
        if first_s is None:
            first_s, worker = time.monotonic() - sent, chunk.route.worker_id
        last = chunk
    return first_s, worker, last


def test_a_sim_engine_sends_and_takes_blocks_of_its_models_kv_size():
    engine = sim_engine(**V3)
    assert engine.capabilities.kv_transfer_bytes_per_token == V3_BYTES_PER_TOKEN
    assert sim_engine(**V3, time_scale=4).capabilities.prefill_tokens_per_second == pytest.approx(
        engine.capabilities.prefill_tokens_per_second / 4
    )
    assert sim_engine(**V3, time_scale=4).capabilities.decode_tokens_per_second == pytest.approx(
        engine.capabilities.decode_tokens_per_second / 4
    )


async def test_prefill_on_p_decode_on_d_spends_the_transfer_before_ds_first_token():
    # 4,000 tokens of V3's KV: 2.25 Gb, 0.56 s over 4 Gb/s; P prefills them in ~20 ms
    link_gbps = 4.0
    p, d = (sim_engine(**V3, link_gbps=link_gbps) for _ in "pd")
    request = _request("pd", 4000, 4)
    hashes = list(request.prefix_hashes)
    transfer_s = kv_transfer_s(len(hashes) * BLOCK_TOKENS, V3_BYTES_PER_TOKEN, link_gbps)
    assert 0.5 < transfer_s < 0.6
    async with (
        # an idle D: only the "always" rule splits its prompt (router_svc/phases.py)
        running_router(routing=RoutingSection(link_gbps=link_gbps, phase_split="always")) as router,
        running_worker(p, router, "p", role="prefill"),
        running_worker(d, router, "d", role="decode"),
    ):
        blocks = metrics.KV_PULL_BLOCKS.labels("p", "d")._value.get()
        ttft_s, worker, last = await _first_token_s(router.stub, request)
    assert worker == "d"
    assert metrics.KV_PULL_BLOCKS.labels("p", "d")._value.get() - blocks == len(hashes)
    # P computed the prompt; D took its whole blocks but the last token's, a prefix hit
    assert p.cache_events.held_prefix(hashes) == len(hashes)
    assert d.cache_events.held_prefix(hashes) == len(hashes)
    assert last.usage.cached_prompt_tokens == 4000 - 1
    prefill_s = p.roofline.prefill_s(4000)
    assert transfer_s + prefill_s < ttft_s < transfer_s + prefill_s + 0.5


@pytest.mark.parametrize(("link_gbps", "pulled"), [(400.0, True), (1.0, False)])
async def test_a_busy_holders_prefix_is_pulled_over_a_fast_link_and_computed_over_a_slow_one(
    link_gbps: float, pulled: bool
):
    # 3,000 tokens: ~14 ms of prefill on 8 x H200; 0.2 Gb of KV: 4 ms over 400 Gb/s, 1.7 s over 1
    holder_engine, other_engine = (
        sim_engine(**V3, max_parallel=1, link_gbps=link_gbps) for _ in "ho"
    )
    async with (
        running_router(routing=RoutingSection(link_gbps=link_gbps)) as router,
        running_worker(holder_engine, router, "holder", max_parallel=1),
        running_worker(other_engine, router, "other", max_parallel=1),
    ):
        held = _request("shared", 3000, 1)
        fleet = router.resources.registry.fleet
        answer = await gateway_complete(router, held)
        holder = fleet.get(answer.route.worker_id)
        assert holder is not None
        other = "other" if holder.worker_id == "holder" else "holder"
        index = router.resources.index
        await eventually(lambda: index.blocks(holder.slot) >= len(held.prefix_hashes))
        # the holder busy with a long generation, at its max_parallel once the router hears
        async with worker_client() as client:
            busy = client.generate(holder.info.address, _request("busy", 20, 30_000))
            await anext(busy)
            await eventually(lambda: fleet.busy_now[holder.slot] >= 1)
            before = metrics.KV_PULL_BLOCKS.labels(holder.worker_id, other)._value.get()
            request = _request("shared", 3000, 4)
            request.prompt += " and a question"
            request.prefix_hashes[:] = chain(sim_token_ids(prompt_text(None, request.prompt)))
            answer = await gateway_complete(router, request)
            await busy.aclose()
    assert answer.route.worker_id == other
    taken = metrics.KV_PULL_BLOCKS.labels(holder.worker_id, other)._value.get() - before
    if pulled:
        assert taken == len(held.prefix_hashes)
        assert answer.usage.cached_prompt_tokens == len(held.prefix_hashes) * BLOCK_TOKENS
    else:
        assert taken == 0 and answer.usage.cached_prompt_tokens == 0


async def test_blocks_not_the_prompts_are_refused_and_computed():
    engine = sim_engine(**V3)
    prompt = "word " * 400
    names = chain(sim_token_ids(prompt))
    refused = metrics.KV_PULL_REFUSED_BLOCKS._value.get()
    wrong = [PeerBlock(names[0], ()), PeerBlock(names[1] ^ 1, ()), PeerBlock(names[2], ())]
    request = GenerationRequest(
        request_id="r",
        messages=None,
        prompt=prompt,
        sampling=SamplingParams(max_tokens=1),
        peer_prefix=PeerPrefix(0, tuple(wrong)),
    )
    chunks = [c async for c in engine.generate(request)]
    # the first block taken, the misnamed one and the one after it computed
    assert chunks[-1].cached_prompt_tokens == BLOCK_TOKENS
    assert metrics.KV_PULL_REFUSED_BLOCKS._value.get() - refused == 2
    await engine.close()


async def test_an_export_waits_for_the_step_under_way_and_scales_the_link_time():
    engine = sim_engine(**V3, link_gbps=10.0, time_scale=3.0)
    prompt = "word " * 800
    names = chain(sim_token_ids(prompt))
    request = GenerationRequest(
        request_id="r", messages=None, prompt=prompt, sampling=SamplingParams(max_tokens=1)
    )
    assert [c async for c in engine.generate(request)][-1].finish_reason == "length"
    assert list(engine.blocks_to_pull(names)) == []
    assert list(engine.blocks_to_pull([*names, 7])) == [len(names)]
    started = time.monotonic()
    blocks = await engine.export_blocks([*names, 7])
    took = time.monotonic() - started
    assert [b.prefix_hash for b in blocks] == names and all(not b.tensors for b in blocks)
    expected = 3 * kv_transfer_s(len(names) * BLOCK_TOKENS, V3_BYTES_PER_TOKEN, 10.0)
    assert expected <= took < expected + 0.2
    await engine.close()


async def test_the_prefill_speed_it_reports_is_what_its_steps_took():
    """A long prompt's attention makes its tokens dearer than the one-token estimate the
    capabilities give: the load reports the speed measured over the steps, in wall time."""
    engine = sim_engine(**V3, attention_flops_per_key=61 * 128 * 2 * 1088, time_scale=2.0)
    assert engine.load().prefill_tokens_per_second == 0.0
    prompt = "word " * 24_000  # 30,000 tokens
    request = GenerationRequest(
        request_id="r", messages=None, prompt=prompt, sampling=SamplingParams(max_tokens=1)
    )
    [c async for c in engine.generate(request)]
    measured = engine.load().prefill_tokens_per_second
    assert measured == pytest.approx(30_000 / (2 * engine.roofline.prefill_s(30_000)))
    assert measured < engine.capabilities.prefill_tokens_per_second / 3
    await engine.close()


def _taking(prompt: str, blocks: list[PeerBlock]) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        messages=None,
        prompt=prompt,
        sampling=SamplingParams(max_tokens=1),
        peer_prefix=PeerPrefix(0, tuple(blocks)),
    )


async def test_blocks_carry_their_bytes_when_asked_and_are_taken_as_simulated_ones():
    sender, taker = sim_engine(**V3, kv_block_bytes=True), sim_engine(**V3)
    prompt = "word " * 400
    names = chain(sim_token_ids(prompt))
    [_ async for _ in sender.generate(_taking(prompt, []))]
    blocks = await sender.export_blocks(names[:4])
    size = BLOCK_TOKENS * V3_BYTES_PER_TOKEN
    assert [[len(t.data) for t in b.tensors] for b in blocks] == [[size]] * 4
    refused = metrics.KV_PULL_REFUSED_BLOCKS._value.get()
    chunks = [c async for c in taker.generate(_taking(prompt, blocks))]
    assert chunks[-1].cached_prompt_tokens == 4 * BLOCK_TOKENS
    # a block of another size is no simulated block: refused, computed
    wrong = PeerBlock(names[0], (RawTensor(bytes(8), "uint8", (8,)),))
    other = sim_engine(**V3)
    chunks = [c async for c in other.generate(_taking(prompt, [wrong]))]
    assert chunks[-1].cached_prompt_tokens == 0
    assert metrics.KV_PULL_REFUSED_BLOCKS._value.get() - refused == 1
    for engine in (sender, taker, other):
        await engine.close()
