"""Fuzzing a live gateway: schemathesis against its ``/openapi.json`` (every operation,
positive and negative cases), raw malformed bodies and headers, slow and idle clients.

Used by ``bench/fuzz.py`` (the full run) and ``tests/e2e/test_fuzz.py`` (a short one).
A failure is a response with status 5xx, a 4xx not in the error shape of its API
(OpenAI's, or Anthropic's on /v1/messages), a raw malformed request served as if valid
(two Authorization headers, say), a request the server did not answer, or a slow client
whose connection was kept. Every response body is kept for the secrets scan.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import grpc
import hypothesis
import requests
import schemathesis
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from schemathesis import Case, GenerationMode
from schemathesis.core.result import Err
from schemathesis.schemas import APIOperation

from gateway.http.errors import AnthropicErrorBody, ErrorBody
from infermesh.pb import router_pb2, router_pb2_grpc
from infermesh.ports import free_port
from tests.helpers import rawhttp

_HEALTH_CHECKS = list(hypothesis.HealthCheck)
_CHAT = "/v1/chat/completions"


def mesh_env(admin_token: str, timeout_s: float) -> dict[str, str]:
    """The mesh under fuzzing: one zero-latency simulated worker (the gateway is what is fuzzed),
    metrics on free ports, the admin API on, and read timeouts of ``timeout_s`` for the slow
    clients."""
    return {
        "INFERMESH_ROUTER_METRICS_PORT": str(free_port()),
        "INFERMESH_WORKER_METRICS_PORT": str(free_port()),
        "INFERMESH_WORKER_ENGINE_KIND": "sim",
        "INFERMESH_WORKER_ENGINE_ZERO_LATENCY": "true",
        "INFERMESH_GATEWAY_ADMIN_TOKEN": admin_token,
        "INFERMESH_GATEWAY_SERVER_HEADER_TIMEOUT_S": str(timeout_s),
        "INFERMESH_GATEWAY_SERVER_BODY_TIMEOUT_S": str(timeout_s),
        "INFERMESH_GATEWAY_SERVER_KEEPALIVE_TIMEOUT_S": str(timeout_s),
    }


@dataclasses.dataclass
class FuzzReport:
    cases: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)
    bodies: list[bytes] = dataclasses.field(default_factory=list)
    statuses: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)

    def check(self, what: str, path: str, status: int, body: bytes) -> None:
        """Counts one answered case; records it as a failure when it is one."""
        self.cases += 1
        self.bodies.append(body)
        self.statuses[status] += 1
        problem = answer_problem(path, status, body)
        if problem:
            self.failures.append(f"{what}: {problem}")

    def fail(self, what: str, problem: str) -> None:
        self.cases += 1
        self.failures.append(f"{what}: {problem}")


def answer_problem(path: str, status: int, body: bytes) -> str | None:
    """Why an answer is wrong, or None."""
    if status >= 500:
        return f"status {status}: {body[:300]!r}"
    if 400 <= status < 500:
        shape: type[BaseModel] = AnthropicErrorBody if "/v1/messages" in path else ErrorBody
        try:
            shape.model_validate_json(body)
        except ValidationError:
            return f"status {status} not in {shape.__name__} shape: {body[:300]!r}"
    return None


@dataclasses.dataclass(frozen=True)
class Target:
    base: str  # http://host:port
    port: int
    api_key: str
    admin_token: str
    model: str  # a model the mesh serves: positive cases are steered to it half the time

    def headers_for(self, path: str) -> dict[str, str]:
        token = self.admin_token if path.startswith("/admin") else self.api_key
        return {"Authorization": f"Bearer {token}"}


def served_model(router_address: str) -> str:
    """The first model the mesh serves, as the router lists it."""
    with grpc.insecure_channel(router_address) as channel:
        reply = router_pb2_grpc.RouterStub(channel).ListModels(
            router_pb2.ListModelsRequest(), timeout=5
        )
    model_id: str = reply.models[0].id
    return model_id


def schema_cases(target: Target, max_examples: int, report: FuzzReport) -> None:
    """schemathesis's cases for every operation of the document, positive and negative."""
    schema = schemathesis.openapi.from_url(f"{target.base}/openapi.json")
    session = requests.Session()
    for result in schema.get_all_operations():
        if isinstance(result, Err):  # a document schemathesis cannot read: its own error
            raise result.err()
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _run_operation(target, operation, mode, max_examples, session, report)
    session.close()


def _run_operation(
    target: Target,
    operation: APIOperation[Any, Any, Any, Any],
    mode: GenerationMode,
    max_examples: int,
    session: requests.Session,
    report: FuzzReport,
) -> None:
    steer = mode == GenerationMode.POSITIVE

    @hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=_HEALTH_CHECKS,
        derandomize=False,
        phases=[hypothesis.Phase.generate],
    )
    @hypothesis.given(
        case=operation.as_strategy(generation_mode=mode),
        served=st.booleans() if steer else st.just(False),
    )
    def run(case: Case[Any], served: bool) -> None:
        if served and isinstance(case.body, dict) and "model" in case.body:
            _to_served_model(case.body, target.model)
        what = f"{mode.value} {operation.method.upper()} {operation.path}"
        try:
            response = case.call(
                base_url=target.base,
                session=session,
                headers=target.headers_for(operation.path),
                timeout=30,
            )
        except requests.RequestException as e:
            report.fail(what, f"no answer: {type(e).__name__}")
            return
        report.check(what, case.formatted_path, response.status_code, response.content)

    # an operation without inputs (GET /health) has no negative cases
    with contextlib.suppress(hypothesis.errors.Unsatisfiable):
        run()


def _to_served_model(body: dict[str, Any], model: str) -> None:
    """A valid case on the served model, kept small: the simulated worker then generates."""
    body["model"] = model
    for field, cap in (("max_tokens", 16), ("max_completion_tokens", 16), ("n", 2)):
        if isinstance(body.get(field), int) and not isinstance(body[field], bool):
            body[field] = min(body[field], cap)
    if isinstance(body.get("best_of"), int) and not isinstance(body["best_of"], bool):
        body["best_of"] = body.get("n", 1)


def raw_requests(target: Target) -> Iterator[tuple[str, str, bytes]]:
    """(name, path, request bytes): malformed bodies and headers no schema generates."""
    auth = ("Authorization", f"Bearer {target.api_key}")
    json_type = ("Content-Type", "application/json")
    chat = {"model": target.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    bodies = {
        "truncated_json": json.dumps(chat).encode()[:-7],
        "deep_nesting": b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "deep_objects": b'{"a": ' * 20_000 + b"1" + b"}" * 20_000,
        "huge_float": json.dumps({**chat, "temperature": 1})
        .encode()
        .replace(b'"temperature": 1', b'"temperature": 1e999'),
        "huge_int": json.dumps(chat)
        .encode()
        .replace(b'"max_tokens": 4', b'"max_tokens": ' + b"9" * 5000),
        "huge_seed": json.dumps(chat).encode().replace(b'"max_tokens": 4', b'"seed": ' + b"9" * 40),
        "invalid_utf8": json.dumps(chat).encode().replace(b"hi", b"h\xff\xfei"),
        "lone_surrogate": json.dumps(chat).encode().replace(b"hi", b"h\\ud800i"),
        "nul_in_content": json.dumps(chat).encode().replace(b"hi", b"h\\u0000i"),
        "raw_nul_byte": json.dumps(chat).encode().replace(b"hi", b"h\x00i"),
        "ten_mb_string": json.dumps({**chat, "user": "x" * 10_000_000}).encode(),
        "not_an_object": b"[1, 2, 3]",
        "empty": b"",
        "nan": json.dumps(chat).encode().replace(b'"max_tokens": 4', b'"temperature": NaN'),
    }
    for name, body in bodies.items():
        yield name, _CHAT, rawhttp.request("POST", _CHAT, [auth, json_type], body)
    yield (
        "text_plain_body",
        _CHAT,
        rawhttp.request("POST", _CHAT, [auth, ("Content-Type", "text/plain")], b"hello"),
    )
    yield (
        "form_body",
        _CHAT,
        rawhttp.request(
            "POST", _CHAT, [auth, ("Content-Type", "application/x-www-form-urlencoded")], b"a=b"
        ),
    )
    yield (
        "json_as_xml",
        "/admin/keys",
        rawhttp.request(
            "POST",
            "/admin/keys",
            [
                ("Authorization", f"Bearer {target.admin_token}"),
                ("Content-Type", "application/xml"),
            ],
            b"<a/>",
        ),
    )
    yield (
        "many_headers",
        "/v1/models",
        rawhttp.request("GET", "/v1/models", [auth] + [(f"X-F{i}", "v") for i in range(500)]),
    )
    yield (
        "long_header",
        "/v1/models",
        rawhttp.request("GET", "/v1/models", [auth, ("X-Long", "v" * 70_000)]),
    )
    yield "long_url", "/v1/models", rawhttp.request("GET", "/v1/models?" + "q" * 70_000, [auth])
    yield (
        "two_authorizations",
        "/v1/models",
        rawhttp.request("GET", "/v1/models", [auth, ("Authorization", "Bearer sk-bogus")]),
    )
    yield (
        "bogus_then_valid",
        "/v1/models",
        rawhttp.request("GET", "/v1/models", [("Authorization", "Bearer sk-bogus"), auth]),
    )
    yield (
        "key_then_nul",
        "/v1/models",
        rawhttp.request("GET", "/v1/models", [(auth[0], auth[1] + "\x00")]),
    )
    yield (
        "key_in_long_line",
        "/v1/models",
        rawhttp.request("GET", "/v1/models", [(auth[0], auth[1] + "k" * 9000)]),
    )
    yield "tls_hello", "/", bytes.fromhex("16030100f5010000f10303") + bytes(60)
    yield (
        "chunked_garbage",
        _CHAT,
        rawhttp.request(
            "POST", _CHAT, [auth, json_type, ("Transfer-Encoding", "chunked")], b"zz\r\nab\r\n"
        ),
    )
    yield (
        "gzip_garbage",
        _CHAT,
        rawhttp.request(
            "POST", _CHAT, [auth, json_type, ("Content-Encoding", "gzip")], b"not gzip"
        ),
    )
    yield (
        "content_length_lies_short",
        _CHAT,
        rawhttp.request(
            "POST", _CHAT, [auth, json_type, ("Content-Length", "5")], json.dumps(chat).encode()
        ),
    )


# Raw requests a correct gateway may serve; every other one must be refused (4xx).
_RAW_SERVABLE = {"nul_in_content"}


async def raw_cases(target: Target, report: FuzzReport) -> None:
    for name, path, data in raw_requests(target):
        try:
            response = await rawhttp.exchange(target.port, data, timeout_s=30)
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as e:
            report.fail(f"raw {name}", f"no answer: {type(e).__name__}")
            continue
        report.check(f"raw {name}", path, response.status, response.body)
        if response.status < 400 and name not in _RAW_SERVABLE:
            report.failures.append(f"raw {name}: status {response.status}, not refused")


async def slow_clients(
    target: Target, clients: int, idle: int, timeout_s: float, report: FuzzReport
) -> None:
    """``clients`` sending headers and ``clients`` a body a byte every 0.2 s, and ``idle``
    keep-alive connections left idle: each must be answered 408 or closed within
    ``timeout_s`` (the gateway's timeouts) plus a margin."""
    limit = timeout_s + 5
    body = json.dumps(
        {"model": target.model, "messages": [{"role": "user", "content": "x" * 300}]}
    ).encode()
    body_head = rawhttp.request(
        "POST",
        _CHAT,
        [
            ("Authorization", f"Bearer {target.api_key}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
        ],
    )
    header_head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
    trickles = [
        _trickle(target.port, header_head, b"X-Slow: " + b"a" * 500, limit) for _ in range(clients)
    ]
    trickles += [_trickle(target.port, body_head, body, limit) for _ in range(clients)]
    idles = [_idle(target.port, limit) for _ in range(idle)]
    results = await asyncio.gather(*trickles, *idles)
    for i, (status, body_bytes, problem) in enumerate(results):
        kind = "slow headers" if i < clients else "slow body" if i < 2 * clients else "idle"
        if problem:
            report.fail(f"{kind} client {i}", problem)
        elif status is not None:
            report.check(f"{kind} client {i}", _CHAT, status, body_bytes)
            if status != 408:
                report.failures.append(f"{kind} client {i}: status {status}, not 408")
        else:
            report.cases += 1


async def _trickle(
    port: int, head: bytes, rest: bytes, limit_s: float
) -> tuple[int | None, bytes, str | None]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    loop = asyncio.get_running_loop()
    started = loop.time()
    read = asyncio.ensure_future(rawhttp.read_response(reader))
    try:
        for i in range(len(rest)):
            if read.done() or loop.time() - started > limit_s:
                break
            writer.write(rest[i : i + 1])
            await asyncio.wait([read], timeout=0.2)
        try:
            response = await asyncio.wait_for(read, max(limit_s - (loop.time() - started), 0.1))
        except TimeoutError:
            return None, b"", f"not answered within {limit_s:g} s"
        except (asyncio.IncompleteReadError, ConnectionError):
            return None, b"", None  # closed without an answer: refused all the same
        return response.status, response.body, None
    finally:
        read.cancel()
        writer.close()


async def _idle(port: int, limit_s: float) -> tuple[int | None, bytes, str | None]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await rawhttp.read_response(reader)
        try:
            if await asyncio.wait_for(reader.read(), limit_s) != b"":
                return None, b"", "idle connection got unasked-for bytes"
        except TimeoutError:
            return None, b"", f"idle keep-alive connection kept past {limit_s:g} s"
        return None, b"", None
    finally:
        writer.close()


def leaked(secrets: list[str], texts: list[str], bodies: list[bytes]) -> list[str]:
    """Where a secret appears: 'log N' or 'body N'."""
    found = []
    for i, text in enumerate(texts):
        found += [f"log {i}" for s in secrets if s in text]
    for i, body in enumerate(bodies):
        found += [f"body {i}" for s in secrets if s.encode() in body]
    return found
