"""KV blocks between two real torch workers over mutual TLS, each with its own worker identity
(Worker.KVBlocks, and an open's KVPull): a prompt's cached prefix pulled from the peer gives the
tokens computing it gives; only a worker may fetch blocks; a block not held is NOT_FOUND; a
block that is not the prompt's is refused and computed; a dead peer or a spent deadline falls
back to computing, unseen by the caller; a pull's rate is measured per peer for the heartbeats.
Prefill on P, decode on D: a decode worker takes the
blocks a prefill worker computes for it, and gives the tokens one worker doing both gives."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from devtools.certs import role_tls, write_certs
from infermesh.config import ConfigError
from infermesh.pb import common_pb2, router_pb2, worker_pb2
from infermesh.ports import free_port
from infermesh.prefix_hash import BLOCK_TOKENS, chain
from infermesh.tls import TlsSection
from router_svc.config import RoutingSection
from telemetry import metrics
from tests.helpers import MODEL as CONFIGURED_MODEL
from tests.helpers.inprocess import eventually, running_router, running_worker
from tests.helpers.worker_client import loopback_worker, serving_as_worker, worker_client
from worker_svc.config import CacheSection, EngineSection, WorkerConfig
from worker_svc.config import load as load_worker_config
from worker_svc.engine.api import GenerationRequest, PeerBlock, PeerPrefix, RawTensor
from worker_svc.engine.prompt_ids import prompt_token_ids
from worker_svc.service.kv_transfer import LinkRates
from worker_svc.service.wire import to_engine
from worker_svc.sim_engine.engine import SimEngine
from worker_svc.torch_engine.engine import Engine

# DeepSeek-V3's MLA sizes (kv_lora_rank 512, qk_rope_head_dim 64) in two layers
MLA_MODEL = "models/tiny-deepseek-v3-mla"
MODEL = Path(MLA_MODEL).name
# an idle D: only the "always" rule splits its prompt (router_svc/phases.py)
_ALWAYS_SPLIT = RoutingSection(phase_split="always")


@dataclasses.dataclass
class Pair:
    """The peer holding a prefix (P) and the worker that pulls it (D), served over TLS."""

    p: Engine
    d: Engine
    p_address: str
    d_address: str
    certs: Path

    def tls(self, stem: str) -> TlsSection:
        return dataclasses.replace(
            role_tls(self.certs, "worker"),
            cert_file=str(self.certs / f"{stem}.crt"),
            key_file=str(self.certs / f"{stem}.key"),
        )


@pytest.fixture(scope="module")
def engines(worker_dtype: str) -> Iterator[tuple[Engine, Engine]]:
    pair = [Engine.from_checkpoint(MLA_MODEL, dtype=worker_dtype, max_model_len=4096) for _ in "pd"]
    yield pair[0], pair[1]
    for engine in pair:
        asyncio.run(engine.close())


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    write_certs(directory, workers={"p": [], "d": []})
    return directory


@pytest.fixture
async def pair(engines: tuple[Engine, Engine], certs: Path) -> AsyncIterator[Pair]:
    async with (
        serving_as_worker(engines[0], "p", MLA_MODEL, certs) as p,
        serving_as_worker(engines[1], "d", MLA_MODEL, certs) as d,
    ):
        yield Pair(engines[0], engines[1], p, d, certs)


def _request(tag: str, words: int = 100) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        request_id=tag,
        model=MODEL,
        prompt=" ".join(f"{tag}{i}" for i in range(words)),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=6),
    )


def _prompt_ids(engine: Engine, request: common_pb2.GenerateRequest) -> list[int]:
    return list(prompt_token_ids(engine.tokenizer, to_engine(request)))


def _pull(address: str, hashes: list[int], timeout_ms: int = 30_000) -> common_pb2.KVPull:
    return common_pb2.KVPull(
        worker_id="p", address=address, prefix_hashes=hashes, timeout_ms=timeout_ms
    )


async def _complete(
    pair: Pair,
    address: str,
    request: common_pb2.GenerateRequest,
    pull: common_pb2.KVPull | None = None,
) -> common_pb2.GenerateResponse:
    """The whole completion from the worker at ``address``, asked as the gateway asks."""
    async with worker_client(role_tls(pair.certs, "gateway")) as client:
        return await client.complete(address, request, pull=pull)


def _pulls(outcome: str) -> float:
    return metrics.KV_PULLS.labels("p", "d", outcome)._value.get()


async def test_a_prefix_pulled_from_the_peer_gives_the_tokens_computing_it_gives(pair: Pair):
    request = _request("exact")
    computed = await _complete(pair, pair.p_address, request)  # P computes and caches the prompt
    hashes = chain(_prompt_ids(pair.p, request))
    assert len(hashes) >= 8
    before = metrics.KV_PULL_BLOCKS.labels("p", "d")._value.get()
    pulled = await _complete(pair, pair.d_address, request, _pull(pair.p_address, hashes))
    assert list(pulled.token_ids) == list(computed.token_ids)
    assert pulled.text == computed.text
    # D had none of it: every whole block but the one holding the last token came from P
    assert pulled.usage.cached_prompt_tokens >= (len(hashes) - 1) * BLOCK_TOKENS
    assert metrics.KV_PULL_BLOCKS.labels("p", "d")._value.get() - before == len(hashes)
    # the blocks taken are D's prefix cache now: published as its own
    assert pair.d.cache_events.held_prefix(hashes) == len(hashes)


async def test_only_a_worker_may_fetch_blocks(pair: Pair):
    request = _request("authz", words=20)
    await _complete(pair, pair.p_address, request)
    hashes = chain(_prompt_ids(pair.p, request))
    ask = worker_pb2.KVBlocksRequest(prefix_hashes=hashes)
    async with worker_client(role_tls(pair.certs, "gateway")) as gateway:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in gateway.stub(pair.p_address).KVBlocks(ask):
                pass
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with worker_client(pair.tls("worker-d")) as peer:
        blocks = [b async for m in peer.stub(pair.p_address).KVBlocks(ask) for b in m.blocks]
    assert [b.prefix_hash for b in blocks] == hashes
    shape = [2, BLOCK_TOKENS, 512 + 64]
    assert all(list(b.tensors[0].shape) == shape for b in blocks)


async def test_a_block_not_held_is_not_found_after_the_blocks_before_it(pair: Pair):
    request = _request("evicted", words=20)
    await _complete(pair, pair.p_address, request)
    hashes = chain(_prompt_ids(pair.p, request))
    ask = worker_pb2.KVBlocksRequest(prefix_hashes=[*hashes[:2], 12345, *hashes[2:]])
    got: list[int] = []
    async with worker_client(pair.tls("worker-d")) as peer:
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            async for message in peer.stub(pair.p_address).KVBlocks(ask):
                got += [b.prefix_hash for b in message.blocks]
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert "0000000000003039" in (missing.value.details() or "")
    assert got == hashes[:2]


def _cut_short(block: PeerBlock) -> PeerBlock:
    bad = block.tensors[0]
    return dataclasses.replace(block, tensors=(RawTensor(bad.data[:-2], bad.dtype, bad.shape),))


def _misnamed(block: PeerBlock) -> PeerBlock:
    return dataclasses.replace(block, prefix_hash=block.prefix_hash ^ 1)


@pytest.mark.parametrize("spoil", [_cut_short, _misnamed])
async def test_a_block_that_is_not_the_prompts_is_refused_and_computed(
    pair: Pair, spoil: Callable[[PeerBlock], PeerBlock]
):
    request = _request(f"corrupt-{spoil.__name__}")
    computed = await _complete(pair, pair.p_address, request)
    hashes = chain(_prompt_ids(pair.p, request))
    blocks = await pair.p.export_blocks(hashes)
    # block 4 cut short, or named as another prefix's: it and those after it are computed, the
    # four before it taken
    blocks[4] = spoil(blocks[4])
    refused = metrics.KV_PULL_REFUSED_BLOCKS._value.get()
    served = to_engine(request)
    engine_request: GenerationRequest = dataclasses.replace(
        served, request_id=f"corrupt-d-{spoil.__name__}", peer_prefix=PeerPrefix(0, tuple(blocks))
    )
    tokens: list[int] = []
    cached = 0
    async for chunk in pair.d.generate(engine_request):
        tokens += chunk.token_ids
        cached = chunk.cached_prompt_tokens
    assert tokens == list(computed.token_ids)
    assert cached == 4 * BLOCK_TOKENS
    assert metrics.KV_PULL_REFUSED_BLOCKS._value.get() - refused == len(blocks) - 4


async def test_a_dead_peer_or_a_spent_deadline_falls_back_to_computing(pair: Pair):
    request = _request("dead")
    computed = await _complete(pair, pair.p_address, request)
    hashes = chain(_prompt_ids(pair.p, request))
    unavailable = _pulls("UNAVAILABLE")
    dead = _pull(f"127.0.0.1:{free_port()}", hashes)
    fallback = await _complete(pair, pair.d_address, request, dead)
    assert list(fallback.token_ids) == list(computed.token_ids)
    assert fallback.usage.cached_prompt_tokens == 0
    assert _pulls("UNAVAILABLE") - unavailable == 1
    late = _pulls("DEADLINE_EXCEEDED")
    request = _request("late")
    computed = await _complete(pair, pair.p_address, request)
    hashes = chain(_prompt_ids(pair.p, request))
    spent = await _complete(
        pair, pair.d_address, request, _pull(pair.p_address, hashes, timeout_ms=1)
    )
    assert list(spent.token_ids) == list(computed.token_ids)
    assert _pulls("DEADLINE_EXCEEDED") - late == 1


def _routed(engine: Engine, tag: str, words: int, max_tokens: int) -> common_pb2.GenerateRequest:
    """A request as a gateway sends it through the router: its prompt's block hashes, and the
    model as the workers' configuration names it (their engines run the MLA one)."""
    request = _request(tag, words)
    request.model = CONFIGURED_MODEL
    request.sampling.max_tokens = max_tokens
    request.prefix_hashes[:] = chain(_prompt_ids(engine, request))
    return request


async def test_the_router_has_a_free_worker_pull_the_prefix_a_full_one_holds(
    engines: tuple[Engine, Engine],
):
    """A P/D request through the router's relay: the worker holding the prompt's prefix is at
    its max_parallel, so the other takes the prefix from it and gives the tokens the holder's
    own computation gives."""
    # the load decides between the two (a second of prefill weighs little); a 10 Gb/s link
    routing = RoutingSection(link_gbps=10, prefill_weight=0.01)
    async with (
        running_router(routing=routing) as router,
        running_worker(engines[0], router, "w1", max_parallel=1),
        running_worker(engines[1], router, "w2", max_parallel=1),
    ):
        # ~1,900 tokens: long enough that computing them takes longer than the holder's step
        # and the pull's round trip, whatever prefill speed the workers measured meanwhile (the
        # pull's deadline)
        held = _routed(engines[0], "shared", 1000, 1)
        holder = (await router.stub.Complete(held)).route.worker_id
        entry = router.resources.registry.fleet.get(holder)
        assert entry is not None
        index = router.resources.index
        await eventually(lambda: index.blocks(entry.slot) >= len(held.prefix_hashes))
        # the holder busy with a long generation (at its max_parallel once the router hears)
        busy = _routed(engines[0], "busy", 20, 200)
        async with worker_client() as client:
            stream = client.generate(entry.info.address, busy)
            await anext(stream)
            fleet = router.resources.registry.fleet
            await eventually(lambda: fleet.busy_now[entry.slot] >= 1)
            puller = "w2" if holder == "w1" else "w1"
            pulled_before = metrics.KV_PULL_BLOCKS.labels(holder, puller)._value.get()
            request = _routed(engines[0], "shared", 1010, 6)
            request.request_id = "pd"
            # the gateway's way: the decision on its route stream carries the pull
            route_stream = router.stub.RouteStream()
            await route_stream.write(
                router_pb2.RouteStreamRequest(asks=[router_pb2.RouteAsk(id=1, request=request)])
            )
            (decision,) = (await route_stream.read()).decisions
            chosen = decision.workers[0]
            await route_stream.write(router_pb2.RouteStreamRequest(unused=[chosen.worker_id]))
            await route_stream.done_writing()
            assert await route_stream.read() is grpc.aio.EOF
            assert chosen.worker_id == puller and chosen.pull.worker_id == holder
            assert chosen.pull.address == entry.info.address and chosen.pull.timeout_ms > 0
            prefix = list(chosen.pull.prefix_hashes)
            assert prefix == request.prefix_hashes[: len(prefix)] and len(prefix) >= 2
            # and the router's own relay pulls
            answer = await router.stub.Complete(request)
            await stream.aclose()
    assert answer.route.worker_id == puller
    pulled = metrics.KV_PULL_BLOCKS.labels(holder, puller)._value.get() - pulled_before
    # every block of the held prompt (its last one's tokens may end differently in the longer)
    assert pulled >= len(held.prefix_hashes) - 1
    assert answer.usage.cached_prompt_tokens >= pulled * BLOCK_TOKENS - BLOCK_TOKENS
    # computed alone, on the holder: the same tokens
    reference = dataclasses.replace(to_engine(request), request_id="reference")
    tokens = [t async for chunk in engines[0].generate(reference) for t in chunk.token_ids]
    assert list(answer.token_ids) == tokens


async def test_prefill_on_p_decode_on_d_gives_the_aggregated_tokens(
    engines: tuple[Engine, Engine],
):
    """A decode worker (role "decode") has its prompts prefilled on the prefill worker, which
    sends it the blocks; the tokens are those one worker doing both phases gives. The prefill
    worker decodes nothing."""
    async with (
        running_router(routing=_ALWAYS_SPLIT) as router,
        running_worker(engines[0], router, "p", role="prefill"),
        running_worker(engines[1], router, "d", role="decode"),
    ):
        for tag in ("pd1", "pd2"):
            request = _routed(engines[0], tag, 100, 6)
            hashes = list(request.prefix_hashes)
            ok, blocks = _pulls("OK"), metrics.KV_PULL_BLOCKS.labels("p", "d")._value.get()
            answer = await router.stub.Complete(request)
            assert answer.route.worker_id == "d"
            assert _pulls("OK") - ok == 1
            assert metrics.KV_PULL_BLOCKS.labels("p", "d")._value.get() - blocks == len(hashes)
            # P computed the prompt (its cache holds it), D took every whole block but the
            # last token's
            assert engines[0].cache_events.held_prefix(hashes) == len(hashes)
            assert answer.usage.cached_prompt_tokens >= (len(hashes) - 1) * BLOCK_TOKENS
            # one worker doing both phases: the same tokens
            aggregated = dataclasses.replace(to_engine(request), request_id=f"{tag}-aggregated")
            tokens = [t async for c in engines[0].generate(aggregated) for t in c.token_ids]
            assert list(answer.token_ids) == tokens


async def test_a_dead_prefill_worker_falls_back_to_the_decode_worker_computing_it(
    engines: tuple[Engine, Engine],
):
    async with (
        running_router(routing=_ALWAYS_SPLIT) as router,
        running_worker(engines[1], router, "d", role="decode") as d,
    ):
        dead = common_pb2.WorkerInfo()
        dead.CopyFrom(d.servicer.info)
        dead.worker_id, dead.address = "dead-p", f"127.0.0.1:{free_port()}"
        dead.capabilities.role = "prefill"
        await router.stub.Register(router_pb2.RegisterRequest(worker=dead))
        unavailable = metrics.KV_PULLS.labels("dead-p", "d", "UNAVAILABLE")._value.get()
        request = _routed(engines[1], "pd-dead", 100, 6)
        answer = await router.stub.Complete(request)
    assert answer.route.worker_id == "d"
    assert metrics.KV_PULLS.labels("dead-p", "d", "UNAVAILABLE")._value.get() - unavailable == 1
    assert answer.usage.cached_prompt_tokens == 0
    computed = dataclasses.replace(to_engine(request), request_id="pd-dead-computed")
    tokens = [t async for c in engines[0].generate(computed) for t in c.token_ids]
    assert list(answer.token_ids) == tokens


def test_a_bad_role_is_a_config_error_naming_the_file_and_key(tmp_path: Path):
    path = tmp_path / "worker.toml"
    path.write_text('[worker]\nrole = "prefil"\n')
    with pytest.raises(ConfigError, match=r"\[worker\].*role.*'prefil'") as error:
        load_worker_config(str(path))
    assert str(path) in str(error.value)


async def test_a_sparse_attention_models_blocks_carry_the_indexer_keys_too(v32_dir: Path):
    """DeepSeek-V3.2 caches each token's indexer key beside its latent: a block carries both,
    and the tokens are those computing the prompt gives."""
    p, d = (Engine.from_checkpoint(v32_dir, max_model_len=1024) for _ in "pd")
    try:
        request = to_engine(_request("sparse", words=60))
        tokens = [t async for chunk in p.generate(request) for t in chunk.token_ids]
        hashes = chain(prompt_token_ids(p.tokenizer, request))
        blocks = await p.export_blocks(hashes)
        assert [len(b.tensors) for b in blocks] == [2] * len(hashes)
        pulled = dataclasses.replace(request, peer_prefix=PeerPrefix(0, tuple(blocks)))
        cached = 0
        taken: list[int] = []
        async for chunk in d.generate(pulled):
            taken += chunk.token_ids
            cached = chunk.cached_prompt_tokens
        assert taken == tokens and cached >= (len(hashes) - 1) * BLOCK_TOKENS
    finally:
        await p.close()
        await d.close()


async def test_an_engine_without_kv_blocks_says_so():
    # a simulated engine's blocks are its prefix cache's: without one it has none to send
    uncached = SimEngine.from_config(
        WorkerConfig(
            engine=EngineSection(kind="sim"), cache=CacheSection(enable_prefix_caching=False)
        )
    )
    assert uncached.capabilities.kv_transfer_bytes_per_token == 0
    async with loopback_worker(uncached) as worker:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in worker.stub.KVBlocks(worker_pb2.KVBlocksRequest(prefix_hashes=[1])):
                pass
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "(SimEngine) sends no KV blocks" in (refused.value.details() or "")


def test_pulls_measure_each_peers_link_smoothed_keeping_the_latest_peers():
    rates = LinkRates()
    rates.measured("a", 125_000_000, 1.0)  # 1 Gb/s
    rates.measured("b", 2**19, 0.001)  # half a MiB: mostly the peer's step, not measured
    rates.measured("b", 2**20, 0.0)  # no time: not measured
    assert [(link.worker_id, link.gbps) for link in rates.links()] == [("a", 1.0)]
    rates.measured("a", 12_500_000, 1.0)  # 0.1 Gb/s: halfway there
    assert rates.links()[0].gbps == pytest.approx(0.55)
    for i in range(40):
        rates.measured(f"p{i}", 2**20, 0.01)
    # the 32 latest peers: a heartbeat's bound
    assert [link.worker_id for link in rates.links()] == [f"p{i}" for i in range(8, 40)]
