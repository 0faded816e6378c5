"""The simulated engine: roofline times per GPU profile, limits, prefix cache, determinism."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys

import pytest

from infermesh.config import ConfigError
from tests.helpers.inprocess import sim_engine
from worker_svc.config import load as load_worker_config
from worker_svc.engine.api import (
    Constraints,
    EngineClosedError,
    EngineOverloadedError,
    GenerationRequest,
    InvalidArgumentError,
    SamplingParams,
)
from worker_svc.hardware.gpu_profiles import gpu_profiles
from worker_svc.hardware.sizing import model_size_of
from worker_svc.sim_engine.engine import SimEngine
from worker_svc.sim_engine.roofline import Roofline


def request(
    prompt: str = "hello there", max_tokens: int | None = 8, seed: int | None = None, **sampling
) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        messages=None,
        prompt=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, seed=seed, **sampling),
    )


async def collect(engine, req: GenerationRequest):
    return [c async for c in engine.generate(req)]


def roofline(gpu: str) -> Roofline:
    return sim_engine(gpu).roofline


def test_profiles_hold_the_spec_figures_and_the_precision_policy():
    profiles = gpu_profiles()
    assert {"V100", "A100", "H100", "H200", "L40S", "MI100"} <= set(profiles)
    assert (
        profiles["H100"].bandwidth_bytes_per_s == 3.35e12 and profiles["H100"].peak_flops == 1979e12
    )
    assert profiles["H200"].memory_bytes == 141e9
    assert [profiles[g].precision for g in ("H100", "H200", "L40S", "A100", "MI100", "V100")] == [
        "fp8",
        "fp8",
        "bf16",
        "bf16",
        "bf16",
        "fp16",
    ]
    assert profiles["MI100"].device == "rocm" and profiles["MI100"].peak_flops == 92e12


def test_roofline_orders_the_gpus_and_grows_with_batch_and_prompt():
    h100, a100, v100 = roofline("H100"), roofline("A100"), roofline("V100")
    assert h100.prefill_s(1000) < a100.prefill_s(1000) < v100.prefill_s(1000)
    assert h100.decode_step_s(1, 0) < a100.decode_step_s(1, 0) < v100.decode_step_s(1, 0)
    assert h100.prefill_s(2000) == pytest.approx(2 * h100.prefill_s(1000))
    assert h100.decode_step_s(8, 0) > h100.decode_step_s(1, 0)
    assert h100.decode_step_s(1, 10_000) > h100.decode_step_s(1, 0)  # KV reads cost bandwidth
    # 8B weights in FP8 on 3.35 TB/s: about 2.4 ms a step
    assert h100.decode_step_s(1, 0) == pytest.approx(8e9 / 3.35e12, rel=0.05)


# DeepSeek-V3(.2) on 8 x H200, as the simulated fleet configures them: 61 layers of MLA with 128
# heads; a latent of 512 + 64 in BF16; V3.2's indexer: 64 heads of 128, keys in FP8 with one float32
# scale.
_MLA = {
    "total_params_b": 671,
    "active_params_b": 37,
    "gpu_count": 8,
    "kv_bytes_per_token": 61 * 576 * 2,
    "attention_flops_per_key": 61 * 128 * 2 * (576 + 512),
}
_DSA = {
    "index_topk": 2048,
    "index_bytes_per_token": 61 * (128 + 4),
    "index_flops_per_key": 61 * 64 * 2 * 128,
}


def test_sparse_attention_past_index_topk_costs_only_the_indexer():
    v3, v32 = sim_engine("H200", **_MLA).roofline, sim_engine("H200", **_MLA, **_DSA).roofline
    topk, profile = _DSA["index_topk"], v32.profile
    # the indexer's extra
    assert v32.decode_step_s(1, 1000, v32.attended(1000)) > v3.decode_step_s(1, 1000)
    batch = 64  # of 64k-token contexts: attention, not the weights, sets the step time
    assert (
        v32.decode_step_s(batch, batch * 64_000, batch * topk)
        < v3.decode_step_s(batch, batch * 64_000) / 3
    )
    # past index_topk each decode step grows by the indexer's bytes and FLOPs per token only
    per_token = (
        _DSA["index_bytes_per_token"] / profile.bandwidth_bytes_per_s
        + _DSA["index_flops_per_key"] / profile.peak_flops
    ) / 8
    grown = v32.decode_step_s(1, 32_000, topk) - v32.decode_step_s(1, 16_000, topk)
    assert grown == pytest.approx(16_000 * per_token)
    # prefill: whole prompts and a continuation after a cached prefix count each query's keys
    assert v32.prefill_s(4000) == pytest.approx(
        v32.prefill_s(1000) + v32.prefill_s(3000, start=1000)
    )
    assert v3.prefill_s(64_000) > 2 * v32.prefill_s(64_000)
    pairs = 1000 * 1001 // 2  # query-key pairs of a 1000-token prompt, all within index_topk
    indexer_s = pairs * _DSA["index_flops_per_key"] / (profile.peak_flops * 8)
    assert v32.prefill_s(1000) - v3.prefill_s(1000) == pytest.approx(indexer_s)
    # a long prompt: every query past index_topk attends to index_topk keys
    attended = sum(min(p + 1, topk) for p in range(5000, 9000))
    weights_s = 4000 * 2 * 37e9 / (profile.peak_flops * 8)
    expected = weights_s + (
        attended * _MLA["attention_flops_per_key"]
        + sum(range(5001, 9001)) * _DSA["index_flops_per_key"]
    ) / (profile.peak_flops * 8)
    assert v32.prefill_s(4000, start=5000) == pytest.approx(expected)


def test_capabilities_report_the_profile():
    caps = sim_engine("H100").capabilities
    assert (caps.device, caps.device_name, caps.compute_capability, caps.precision) == (
        "cuda",
        "NVIDIA H100 80GB HBM3",
        "9.0",
        "fp8",
    )
    assert caps.weight_bytes == 8e9 and caps.memory_total_bytes == 80e9
    assert caps.decode_tokens_per_second > sim_engine("V100").capabilities.decode_tokens_per_second
    assert sim_engine("MI100").capabilities.device == "rocm"


def test_a_model_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="leave no KV cache"):
        sim_engine("V100", total_params_b=70, active_params_b=70, gpu_count=1)


def test_a_model_that_does_not_fit_one_gpu_runs_on_the_fewest_that_hold_it():
    # 70B in FP16: 140 GB + 4 x 4096 tokens of 128 KiB (2.1 GB), 28.8 GB usable per V100
    engine = sim_engine("V100", total_params_b=70, active_params_b=70)
    assert engine.roofline.gpu_count == engine.capabilities.gpu_count == 5
    assert engine.capabilities.memory_total_bytes == 5 * 32e9
    # DeepSeek-V3: 673 GB in FP8 on H100s, twice that dequantized on A100s
    h100, a100 = sim_engine("H100", model="DeepSeek-V3"), sim_engine("A100", model="DeepSeek-V3")
    assert (h100.roofline.gpu_count, a100.roofline.gpu_count) == (10, 19)
    assert (
        h100.capabilities.weight_bytes * 2
        > a100.capabilities.weight_bytes
        > h100.capabilities.weight_bytes
    )
    assert sim_engine("H100").roofline.gpu_count == 1  # the default 8B model fits one


def test_a_model_config_that_cannot_be_read_names_the_key():
    with pytest.raises(ConfigError, match=r"model.*not found"):
        load_worker_config_with({"INFERMESH_WORKER_ENGINE_MODEL": "/nonexistent"})


def test_engine_config_section_errors_name_the_key():
    for env, message in [
        (
            {"INFERMESH_WORKER_ENGINE_KIND": "gpu"},
            "INFERMESH_WORKER_ENGINE_KIND: expected one of checkpoint, sim",
        ),
        ({"INFERMESH_WORKER_ENGINE_GPU": "B200"}, "gpu: unknown profile 'B200'"),
        ({"INFERMESH_WORKER_ENGINE_ACTIVE_PARAMS_B": "9"}, "active_params_b"),
        ({"INFERMESH_WORKER_ENGINE_INDEX_TOPK": "-1"}, "index_topk"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_worker_config_with(env)


def load_worker_config_with(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return load_worker_config(None)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


async def test_tokens_are_text_deterministic_per_seed_and_usage_counts_them():
    engine = sim_engine(zero_latency=True)
    try:
        one = await collect(engine, request(seed=7, max_tokens=12))
        two = await collect(engine, request(seed=7, max_tokens=12))
        other = await collect(engine, request(seed=8, max_tokens=12))
        text = "".join(c.text for c in one)
        assert text == "".join(c.text for c in two) != "".join(c.text for c in other)
        assert len(text.split()) == 12 and one[-1].finish_reason == "length"
        assert one[-1].completion_tokens == sum(len(c.token_ids) for c in one) == 12
        assert one[-1].prompt_tokens == 3  # 11 bytes at ~4 a token
    finally:
        await engine.close()


async def test_stop_strings_and_stop_tokens_end_the_stream():
    engine = sim_engine(zero_latency=True)
    try:
        free = "".join(c.text for c in await collect(engine, request(seed=1, max_tokens=20)))
        stop_word = free.split()[3]
        stopped = await collect(engine, request(seed=1, max_tokens=20, stop=(stop_word,)))
        text = "".join(c.text for c in stopped)
        assert (
            stopped[-1].finish_reason == "stop" and stop_word not in text and free.startswith(text)
        )
        first_token = (await collect(engine, request(seed=1, max_tokens=2)))[0].token_ids[0]
        ended = await collect(engine, request(seed=1, max_tokens=20, stop_token_ids=(first_token,)))
        assert ended[-1].finish_reason == "stop" and ended[-1].completion_tokens == 0
    finally:
        await engine.close()


async def test_bad_requests_get_clear_errors():
    engine = SimEngine(roofline("H100"), max_parallel=4, max_waiting=4, max_model_len=64)
    try:
        with pytest.raises(InvalidArgumentError, match="> 63 maximum"):
            await collect(engine, request(prompt="x" * 400))
        with pytest.raises(InvalidArgumentError, match="> 64, decrease"):
            await collect(engine, request(max_tokens=100))
        with pytest.raises(InvalidArgumentError, match="exactly one of messages and prompt"):
            await collect(engine, GenerationRequest("r", None, None, SamplingParams()))
        # the sampling bounds a real engine checks, in the same words
        with pytest.raises(InvalidArgumentError, match="stop has 17 strings; at most 16"):
            await collect(engine, request(stop=("x",) * 17))
        with pytest.raises(InvalidArgumentError, match="temperature must be >= 0"):
            await collect(engine, request(temperature=-1))
        with pytest.raises(
            InvalidArgumentError, match=r"stop_token_ids must be token ids in 0\.\.31"
        ):
            await collect(engine, request(stop_token_ids=(32,)))
        with pytest.raises(
            InvalidArgumentError, match="need a model engine; this worker is simulated"
        ):
            await collect(
                engine,
                GenerationRequest(
                    "r", None, "hi", SamplingParams(), constraints=Constraints(json_schema="{}")
                ),
            )
        assert engine.load().running == engine.load().waiting == 0
    finally:
        await engine.close()


async def test_prefix_cache_hits_shorten_prefill():
    engine = sim_engine("V100")
    system = "You are a careful assistant. " * 100  # ~725 tokens
    try:
        cold = await timed_first_token(engine, request(prompt=system + "first question"))
        warm = await timed_first_token(engine, request(prompt=system + "second question"))
        assert cold.cached == 0 and warm.cached >= 700
        assert warm.seconds < cold.seconds / 3, (cold, warm)
    finally:
        await engine.close()


class FirstToken:
    def __init__(self, seconds: float, cached: int) -> None:
        self.seconds, self.cached = seconds, cached

    def __repr__(self) -> str:
        return f"FirstToken({self.seconds:.4f} s, {self.cached} cached)"


async def timed_first_token(engine, req: GenerationRequest) -> FirstToken:
    loop = asyncio.get_running_loop()
    start = loop.time()
    chunks = engine.generate(req)
    first = await anext(chunks)
    seconds = loop.time() - start
    async for _ in chunks:
        pass
    return FirstToken(seconds, first.cached_prompt_tokens)


async def test_max_parallel_and_the_bounded_queue_are_enforced_and_cancellation_frees_the_cache():
    engine = sim_engine("V100", max_parallel=2, max_waiting=1)
    streams = [engine.generate(request(max_tokens=1000)) for _ in range(3)]
    try:
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.sleep(0.05)
        assert (engine.load().running, engine.load().waiting) == (2, 1)
        assert engine.load().kv_cache_usage > 0
        with pytest.raises(EngineOverloadedError, match="max_waiting 1"):
            await collect(engine, request())
        await asyncio.gather(*firsts[:2])
        await streams[0].aclose()  # a cancelled stream frees its place: the waiting one starts
        await firsts[2]
        assert (engine.load().running, engine.load().waiting) == (2, 0)
    finally:
        for s in streams:
            with contextlib.suppress(Exception):
                await s.aclose()
        assert engine.load().running == 0 and engine.load().kv_cache_usage == 0
        assert engine.peak_live == 3  # two running and one waiting; the refused one not counted
        await engine.close()


async def test_kv_capacity_bounds_the_running_batch():
    # 8B FP16 weights on a 32 GB V100 leave 12.8 GB: 12,800 tokens of 1 MB
    engine = sim_engine(
        "V100", max_parallel=8, max_waiting=8, kv_bytes_per_token=1_000_000, gpu_count=1
    )
    capacity = engine.roofline.kv_capacity_tokens
    assert capacity == 12_800
    streams = [engine.generate(request(max_tokens=capacity // 3)) for _ in range(4)]
    pending = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        await asyncio.sleep(0.05)
        assert (engine.load().running, engine.load().waiting) == (2, 2)
        assert engine.load().kv_cache_usage == pytest.approx(2 * (3 + capacity // 3) / capacity)
        with pytest.raises(InvalidArgumentError, match="KV cache"):
            await collect(engine, request(max_tokens=capacity))
    finally:
        for p in pending:
            p.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            await s.aclose()
        await engine.close()


async def test_close_ends_running_streams():
    engine = sim_engine("V100")
    stream = engine.generate(request(max_tokens=1000))
    await anext(stream)
    await engine.close()
    with pytest.raises(EngineClosedError, match="closed"):
        async for _ in stream:
            pass


def test_a_sim_worker_never_imports_torch():
    code = (
        "import sys, worker_svc.service.main, worker_svc.__main__; "
        "from worker_svc.config import load; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env={**os.environ, "INFERMESH_WORKER_ENGINE_KIND": "sim"},
    )


def test_bundled_models_have_the_published_sizes():
    """Counted from the config.json shapes: DeepSeek's own figures (total B, activated B per
    token)."""
    for name, total_b, active_b in [
        ("DeepSeek-V3", 671, 37),
        ("DeepSeek-V2", 236, 21),
        ("DeepSeek-V2.5", 236, 21),
        ("DeepSeek-V2-Lite", 15.7, 2.4),
    ]:
        assert model_size_of(name).params == pytest.approx(total_b * 1e9, rel=0.01), name
        assert model_size_of(name).active_params == pytest.approx(active_b * 1e9, rel=0.03), name
    # the BF16 latent cache: (kv_lora_rank 512 + rope 64) x layers x 2 bytes
    assert model_size_of("DeepSeek-V2-Lite").kv_bytes_per_token("bf16") == 576 * 27 * 2
    assert model_size_of("DeepSeek-V3").kv_bytes_per_token("bf16") == 576 * 61 * 2


def test_a_sim_worker_is_sized_by_a_bundled_model():
    lite = sim_engine("A100", model="DeepSeek-V2-Lite")
    assert lite.capabilities.weight_bytes == model_size_of("DeepSeek-V2-Lite").params * 2  # bf16
    # BF16 weights run BF16 on an H100 too (nothing to keep in FP8); DeepSeek-V3's FP8 weights run
    # FP8
    assert sim_engine("H100", model="DeepSeek-V2-Lite").capabilities.precision == "bf16"
    assert sim_engine("H100", model="DeepSeek-V3", gpu_count=16).capabilities.precision == "fp8"
    # 80 GB x 0.9 less ~31 GB of weights, 31104 bytes a token: about 1.3M tokens of cache
    assert lite.roofline.kv_capacity_tokens == pytest.approx((72e9 - 31.4e9) / 31104, rel=0.01)
    # 2.4B < 8B active
    assert lite.roofline.decode_step_s(1, 0) < sim_engine("A100").roofline.decode_step_s(1, 0)
    with pytest.raises(ValueError, match="leave no KV cache"):
        # 671 GB of FP8 weights on one 141 GB GPU
        sim_engine("H200", model="DeepSeek-V3", gpu_count=1)
    assert sim_engine("H200", model="DeepSeek-V3", gpu_count=8).roofline.kv_capacity_tokens > 0


def test_model_errors_name_the_key():
    for env, message in [
        ({"INFERMESH_WORKER_ENGINE_MODEL": "DeepSeek-V4"}, "model: DeepSeek-V4: not found"),
        (
            {
                "INFERMESH_WORKER_ENGINE_MODEL": "DeepSeek-V2-Lite",
                "INFERMESH_WORKER_ENGINE_TOTAL_PARAMS_B": "16",
            },
            "model: 'DeepSeek-V2-Lite' sets the sizes; total_params_b must be left unset",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_worker_config_with(env)
