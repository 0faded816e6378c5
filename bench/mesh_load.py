"""Load for the reliability scenarios (bench/soak.py, bench/redis_failover.py), and the simulated
mesh they and bench/gateway_mesh.py run it against: closed-loop
clients sending chat completions to a gateway over plain HTTP, each request recorded as an
:class:`Outcome` (its x-request-id, when, status, error code, tokens served), never raising."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

import aiohttp

from devtools.mesh import MeshSpec
from infermesh.ports import free_port
from worker_svc.config import DEFAULT_MODEL_PATH

Kind = Literal["plain", "stream", "disconnect"]
_MESSAGES = [{"role": "user", "content": "Tell me about reliability."}]


@dataclasses.dataclass(frozen=True)
class Outcome:
    kind: Kind
    started: float  # time.monotonic()
    ended: float
    status: int  # HTTP status; 0: the connection failed
    code: str = ""  # error.code of an error body, or of a stream's error event
    tokens: int = 0  # usage.total_tokens the response reported (0 for a disconnect)
    request_id: str = ""  # the x-request-id it was sent with, unique per request

    @property
    def ok(self) -> bool:
        """Served as asked: a 200 whose stream (if any) ended without an error event."""
        return self.status == 200 and not self.code

    @property
    def latency_s(self) -> float:
        return self.ended - self.started


class MeshLoad:
    """Sends requests of the kinds ``pick()`` chooses to ``base_url`` with ``key``.
    A ``disconnect`` request is a stream the client drops after its first content chunk."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        key: str,
        model: str,
        max_tokens: int = 16,
    ) -> None:
        self._session = session
        self._url = f"{base_url}/chat/completions"
        self._headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self._model = model
        self._max_tokens = max_tokens

    async def one(self, kind: Kind) -> Outcome:
        stream = kind != "plain"
        body = {
            "model": self._model,
            "messages": _MESSAGES,
            "max_tokens": self._max_tokens,
            "temperature": 0,
            "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }
        request_id = f"load-{uuid.uuid4().hex}"
        headers = {**self._headers, "x-request-id": request_id}
        started = time.monotonic()

        def outcome(status: int, code: str = "", tokens: int = 0) -> Outcome:
            return Outcome(kind, started, time.monotonic(), status, code, tokens, request_id)

        try:
            async with self._session.post(self._url, json=body, headers=headers) as response:
                if response.status != 200:
                    return outcome(response.status, _error_code(await response.read()))
                if not stream:
                    return outcome(200, tokens=(await response.json())["usage"]["total_tokens"])
                code, tokens = await _read_stream(response, stop_early=kind == "disconnect")
                return outcome(200, code, tokens)
        except (TimeoutError, aiohttp.ClientError) as e:
            return outcome(0, type(e).__name__)

    async def run(
        self,
        concurrency: int,
        until: float,
        pick: Callable[[], Kind],
        outcomes: list[Outcome],
        pace_s: float = 0.0,
    ) -> None:
        """``concurrency`` clients send back to back (``pace_s`` apart) until ``until``
        (time.monotonic()), appending to ``outcomes``."""

        async def client() -> None:
            while time.monotonic() < until:
                outcomes.append(await self.one(pick()))
                if pace_s:
                    await asyncio.sleep(pace_s * random.uniform(0.5, 1.5))

        await asyncio.gather(*(client() for _ in range(concurrency)))


async def _read_stream(response: aiohttp.ClientResponse, stop_early: bool) -> tuple[str, int]:
    """(error code of an error event or "", usage.total_tokens) of an SSE stream; with
    ``stop_early`` returns after the first content chunk, leaving the rest unread."""
    code, tokens = "", 0
    async for line in response.content:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            code = event["error"].get("code") or "error"
        elif event.get("usage"):
            tokens = event["usage"]["total_tokens"]
        elif stop_early and event.get("choices"):
            return "", 0
    return code, tokens


def _error_code(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["code"] or "error"
    except (ValueError, KeyError, TypeError):
        return "not-json"


def simulated_mesh(redis_url: str, log_dir: Path, env: Mapping[str, str]) -> MeshSpec:
    """The gateway, the router and one simulated worker on ``redis_url`` (tracing off, quiet
    logs, room for 256 running and 1,024 waiting requests); ``env`` adds to that."""
    return MeshSpec(
        redis_url=redis_url,
        model_path=DEFAULT_MODEL_PATH,
        gateway_port=free_port(),
        router_port=free_port(),
        worker_ports=(free_port(),),
        log_dir=log_dir,
        env={
            "OTEL_SDK_DISABLED": "true",
            "INFERMESH_LOG_LEVEL": "WARNING",
            "INFERMESH_WORKER_ENGINE_KIND": "sim",
            "INFERMESH_WORKER_PARALLEL_MAX_PARALLEL": "256",
            "INFERMESH_WORKER_PARALLEL_MAX_WAITING": "1024",
            **env,
        },
    )
