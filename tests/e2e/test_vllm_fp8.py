"""An FP8 checkpoint through vLLM workers: where vLLM's FP8 kernels do not run, a worker serves
its dequantized copy (worker_svc/model/dequant_cache.py) and says so; where they do, FP8 weights.

The checkpoint is the tiny DeepSeek-V3 with DeepSeek's attention head sizes and FP8 block-quantized
weights, as the real one ships. `[quantization] use_native_fp8 = false` forces the BF16 branch, so
it runs on every machine (a CPU with AMX would run FP8), and `[model] dtype = "bfloat16"` makes it
BF16 on every CPU (the policy picks FP32 without AVX512-BF16). One mesh: that vLLM worker, and a
torch worker on the same FP8 checkpoint in bfloat16, which dequantizes at load to the same bits;
on a CPU with AMX tiles (the check vLLM's CPU FP8 kernels make) a third worker, vLLM left to the
policy, which serves FP8 there (without AMX it would be one more BF16 start of 10-50 s, so the
machines that cannot run FP8 start only the two). Two more starts of a vLLM worker alone, each
overlapping the module's other work, since a vLLM start is tens of seconds: one that cannot start,
beside the mesh's start, and one reusing the copy, from the mesh's start on.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
import torch

from devtools.mesh import Mesh, MeshSpec
from devtools.redis_server import RedisServer
from devtools.tiny_model import write_tiny_checkpoint
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from infermesh.ports import free_port
from tests.helpers.e2e import new_key
from tests.helpers.worker_client import complete_once

MODEL = "tiny-deepseek-v3-mla-fp8"
VLLM, TORCH, NATIVE = "vllm-worker", "torch-worker", "vllm-fp8-worker"
AMX = torch.cpu._is_amx_tile_supported()
_VLLM_ENGINE_ENV = {
    "INFERMESH_WORKER_ENGINE_KIND": "vllm",
    "INFERMESH_WORKER_ATTENTION_MAX_MODEL_LEN": "1024",
    "INFERMESH_WORKER_ENGINE_VLLM": '{"enforce_eager": true}',  # see tests/e2e/test_vllm.py
}
_VLLM_ENV = {**_VLLM_ENGINE_ENV, "INFERMESH_WORKER_QUANTIZATION_USE_NATIVE_FP8": "false"}
# vLLM left to the policy, which picks FP8 where vLLM runs it
_NATIVE_ENV = {
    **_VLLM_ENGINE_ENV,
    "INFERMESH_WORKER_SERVER_WORKER_ID": NATIVE,
    "INFERMESH_WORKER_MODEL_DTYPE": "auto",
}
_PROMPTS = ("Say hello to the mesh.", "What is the capital of France?", "Count to five.")
_GREEDY_TOKENS = 16
# two engines' BF16 arithmetic on the same weights: log-probabilities differ by up to this much
# (BF16 keeps 8 bits: near -6, a 16k vocabulary's, one step is 0.03, and the two engines' sums
# drift apart by a few steps over a continuation)
_BF16_LOGPROB = 0.1
# FP8 weights against their BF16 dequantization: vLLM's AMX kernels turn the FP8 weights to BF16
# tile by tile (W8A16) and sum in their own order, up to 0.08 apart measured on an AMX Xeon; where
# the CPU also has AMX-FP8, vLLM quantizes the activations to FP8 too (W8A8), which moves them more
_FP8_LOGPROB = 0.15


@dataclass(frozen=True)
class _Served:
    """A vLLM worker of the mesh and what it serves."""

    worker_id: str
    index: int  # in the mesh's workers
    precision: common_pb2.Precision
    header: str  # x-infermesh-precision
    reason: str  # the policy's, in its start-up log
    logprob_tolerance: float


_SERVED = (
    _Served(
        VLLM,
        0,
        common_pb2.PRECISION_BF16,
        "bf16",
        "vLLM on cpu: serving bf16 ([model] dtype = 'bfloat16'; FP8 weights dequantized)",
        _BF16_LOGPROB,
    ),
    *(
        [
            _Served(
                NATIVE,
                2,
                common_pb2.PRECISION_FP8,
                "fp8",
                "vLLM on cpu: serving fp8 (FP8 checkpoint, and FP8 GEMMs run here)",
                _FP8_LOGPROB,
            )
        ]
        if AMX
        else []
    ),
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fp8") / MODEL, mla=True)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dequant-cache")


@dataclass(frozen=True)
class _LoneStart:
    """A vLLM worker started alone, and its log."""

    worker: subprocess.Popen[bytes]
    log: Path


@pytest.fixture(scope="module", autouse=True)
def failed_start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_LoneStart]:
    """A vLLM worker on a truncated shard, started before the mesh (autouse, defined first) so
    that its failure runs beside the mesh's start."""
    workdir = tmp_path_factory.mktemp("broken")
    broken = Path(shutil.copytree("models/tiny-deepseek-v3-mla", workdir / "checkpoint"))
    shard = broken / "model.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    start = _LoneStart(
        _vllm_worker(broken, workdir / "cache", workdir / "worker.log"), workdir / "worker.log"
    )
    yield start
    _stop(start.worker)


@pytest.fixture(scope="module", autouse=True)
def second_start(
    fleet: Mesh, cache_dir: Path, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[_LoneStart, dict[str, int]]]:
    """Once the mesh's vLLM worker wrote the copy: what it wrote (names, mtimes), and another
    start on the same checkpoint and cache, which runs beside the module's tests."""
    (copy,) = cache_dir.iterdir()
    written = {p.name: p.stat().st_mtime_ns for p in copy.iterdir()}
    log = tmp_path_factory.mktemp("second-start") / "worker.log"
    start = _LoneStart(_vllm_worker(checkpoint, cache_dir, log), log)
    yield start, written
    _stop(start.worker)


def _stop(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        worker.terminate()
        worker.wait(timeout=120)


@pytest.fixture(scope="module")
def fleet(
    module_redis: RedisServer,
    checkpoint: Path,
    cache_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Mesh]:
    spec = MeshSpec(
        redis_url=module_redis.url,
        model_path=str(checkpoint),
        gateway_port=free_port(),
        router_port=free_port(),
        worker_ports=tuple(free_port() for _ in range(len(_SERVED) + 1)),  # vLLM's and torch's
        env={
            "INFERMESH_WORKER_MODEL_DTYPE": "bfloat16",
            "INFERMESH_ROUTER_METRICS_PORT": str(free_port()),
        },
        worker_env=(
            {
                **_VLLM_ENV,
                "INFERMESH_WORKER_SERVER_WORKER_ID": VLLM,
                "INFERMESH_WORKER_QUANTIZATION_DEQUANT_CACHE_DIR": str(cache_dir),
                "INFERMESH_WORKER_METRICS_PORT": str(free_port()),
            },
            {
                "INFERMESH_WORKER_SERVER_WORKER_ID": TORCH,
                "INFERMESH_WORKER_ATTENTION_MAX_MODEL_LEN": "1024",
            },
            *([_NATIVE_ENV] if AMX else []),
        ),
        log_dir=tmp_path_factory.mktemp("vllm-fp8-mesh"),
    )
    mesh = Mesh(spec)
    try:  # stopped whatever happens: a half-started vLLM leaves engine processes behind
        try:
            mesh.start(timeout_s=280)
        except Exception as e:
            raise RuntimeError(f"mesh did not start: {e}\n{mesh.log('worker0')[-4000:]}") from e
        yield mesh
    finally:
        mesh.stop()


def _worker(fleet: Mesh, i: int) -> worker_pb2_grpc.WorkerStub:
    return worker_pb2_grpc.WorkerStub(
        grpc.insecure_channel(f"127.0.0.1:{fleet.spec.worker_ports[i]}")
    )


def _greedy(fleet: Mesh, i: int, prompt: str) -> common_pb2.GenerateResponse:
    request = common_pb2.GenerateRequest(
        request_id=f"greedy-{i}-{time.monotonic_ns()}",
        model=MODEL,
        messages=[common_pb2.ChatMessage(role="user", content=prompt)],
        sampling=common_pb2.SamplingParams(
            temperature=0, max_tokens=_GREEDY_TOKENS, logprobs=True, top_logprobs=2
        ),
    )
    return complete_once(f"127.0.0.1:{fleet.spec.worker_ports[i]}", request, timeout_s=120)


def test_the_vllm_worker_serves_the_copy_in_bf16_and_says_so(fleet: Mesh) -> None:
    info = _worker(fleet, 0).Info(worker_pb2.InfoRequest(), timeout=10).worker
    assert info.worker_id == VLLM and list(info.models) == [MODEL]
    assert info.capabilities.precision == common_pb2.PRECISION_BF16
    assert "writing its torch.bfloat16 copy" in fleet.log("worker0")


@pytest.mark.parametrize("served", _SERVED, ids=lambda s: s.header)
def test_each_vllm_worker_tells_the_router_its_precision(fleet: Mesh, served: _Served) -> None:
    with grpc.insecure_channel(fleet.spec.router_address) as channel:
        listed = router_pb2_grpc.RouterStub(channel).ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=10
        )
    precisions = {w.worker.worker_id: w.worker.capabilities.precision for w in listed.workers}
    assert precisions.get(served.worker_id) == served.precision, precisions
    log = fleet.log(f"worker{served.index}")
    assert served.reason in log
    assert re.search(rf"vLLM serving \S+ in {served.header} on ", log)  # what vLLM's config says


def test_the_gateway_reports_each_vllm_workers_precision(
    fleet: Mesh, module_redis: RedisServer
) -> None:
    client = openai.OpenAI(
        base_url=fleet.spec.base_url, api_key=new_key(module_redis.url), max_retries=0, timeout=120
    )
    seen: dict[str, str] = {}
    deadline = time.monotonic() + 90
    wanted = {s.worker_id for s in _SERVED}

    def ask(_: int) -> tuple[str, str]:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
        return raw.headers["x-infermesh-worker"], raw.headers["x-infermesh-precision"]

    # together, so the router spreads them: one at a time, each goes to the idle worker that
    # has the prompt's prefix cached
    with ThreadPoolExecutor(2 * len(_SERVED) + 2) as pool:
        while not wanted <= seen.keys() and time.monotonic() < deadline:
            seen.update(pool.map(ask, range(2 * len(_SERVED) + 2)))
    assert {s.worker_id: seen.get(s.worker_id) for s in _SERVED} == {
        s.worker_id: s.header for s in _SERVED
    }, seen


@pytest.mark.parametrize("served", _SERVED, ids=lambda s: s.header)
def test_greedy_continuations_match_the_torch_engine(fleet: Mesh, served: _Served) -> None:
    """The same weights on both (vLLM's FP8 ones or its copy's, the torch engine's dequantized at
    load) but two engines' arithmetic: they agree token for token, with log-probabilities equal to
    the served precision's, up to a near-tie, if any: two tokens whose log-probabilities differ by
    less than that precision on both engines, where either choice is right (past it the contexts
    differ). A wrong weight changes the first tokens' log-probabilities far beyond it."""
    tolerance = served.logprob_tolerance
    splits = []
    for prompt in _PROMPTS:
        ours, theirs = (_greedy(fleet, i, prompt) for i in (1, served.index))
        assert len(theirs.token_ids) == len(ours.token_ids) == _GREEDY_TOKENS
        split = next(
            (
                i
                for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids, strict=True))
                if a != b
            ),
            _GREEDY_TOKENS,
        )
        splits.append(split)
        assert [lp.logprob for lp in theirs.logprobs[:split]] == pytest.approx(
            [lp.logprob for lp in ours.logprobs[:split]], abs=tolerance
        ), prompt
        if split < _GREEDY_TOKENS:
            mine, vllms = ours.logprobs[split], theirs.logprobs[split]
            assert _near_tie(mine, vllms.token, tolerance) and _near_tie(
                vllms, mine.token, tolerance
            ), (prompt, split)
    # most of the text agrees: more than half of all the tokens come before the first near-tie
    # of their prompt (measured on an AMX Xeon: 48 of 48 in BF16, 29 of 48 in FP8)
    assert 2 * sum(splits) > len(splits) * _GREEDY_TOKENS, splits


def _near_tie(chosen: common_pb2.TokenLogprob, other: str, tolerance: float) -> bool:
    """`other` is the runner-up at this position, within `tolerance` of the chosen token."""
    return any(
        top.token == other and chosen.logprob - top.logprob < tolerance for top in chosen.top
    )


def _vllm_worker(checkpoint: Path, cache_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:  # the child holds its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "worker_svc"],
            stdout=output,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                **_VLLM_ENV,
                "INFERMESH_WORKER_MODEL_PATH": str(checkpoint),
                "INFERMESH_WORKER_MODEL_DTYPE": "bfloat16",
                "INFERMESH_WORKER_QUANTIZATION_DEQUANT_CACHE_DIR": str(cache_dir),
                "INFERMESH_WORKER_SERVER_PORT": str(free_port()),
                "INFERMESH_WORKER_TLS_PLAINTEXT": "true",
                # no router: the worker serves, or fails, without one
                "INFERMESH_WORKER_ROUTER_ADDRESS": f"127.0.0.1:{free_port()}",
            },
        )


def test_a_second_start_reuses_the_copy(
    second_start: tuple[_LoneStart, dict[str, int]], cache_dir: Path
) -> None:
    """The mesh's vLLM worker wrote the copy; another start finds it and writes nothing."""
    start, written = second_start
    deadline = time.monotonic() + 120
    while "reusing its torch.bfloat16 copy" not in start.log.read_text(errors="replace"):
        assert start.worker.poll() is None, start.log.read_text(errors="replace")[-4000:]
        assert time.monotonic() < deadline, "the second start never reached the copy"
        time.sleep(0.2)
    _stop(start.worker)
    (copy,) = cache_dir.iterdir()
    assert {p.name: p.stat().st_mtime_ns for p in copy.iterdir()} == written


def test_a_failed_start_names_its_cause(failed_start: _LoneStart) -> None:
    """vLLM's engine process fails on a truncated shard: the worker's message quotes that error
    instead of suggesting memory settings."""
    assert failed_start.worker.wait(timeout=280) != 0
    last = failed_start.log.read_text(errors="replace").strip().splitlines()[-1]
    assert "vLLM's engine failed to start: " in last and "SafetensorError" in last, last
    assert "max_model_len" not in last and "memory" not in last
