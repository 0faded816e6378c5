"""The real gateway app under test on a loopback port, and what requests to it carry."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import openai
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from gateway.config import (
    CONFIG,
    AdminSection,
    BatchesSection,
    FilesSection,
    GatewayConfig,
    HttpServerSection,
    RedisSection,
    RouterSection,
)
from gateway.http.server import GatewayRunner
from infermesh.ports import free_port
from tests.helpers.inprocess import tls_of

ADMIN_TOKEN = "test-admin-token-0123456789"


def make_config(
    redis_url: str, router_address: str | None = None, certs: Path | None = None, **server: Any
) -> GatewayConfig:
    """The gateway's config; ``certs``: over TLS with that directory's gateway certificate,
    None: plaintext."""
    return GatewayConfig(
        server=HttpServerSection(**server),
        # generous: 200 concurrent requests share this one event loop in the limit tests
        redis=RedisSection(url=redis_url, timeout_s=3.0),
        router=RouterSection(address=router_address or f"127.0.0.1:{free_port()}"),
        admin=AdminSection(token=ADMIN_TOKEN),
        tls=tls_of(certs, "gateway"),
    )


def batch_config(
    redis_url: str,
    router_address: str,
    files_dir: str,
    max_file_bytes: int = FilesSection.max_file_bytes,
    **batches: Any,
) -> GatewayConfig:
    """``make_config``'s, with its files in ``files_dir`` and a batch runner that looks for work
    every 50 ms (``batches``: more [batches] keys)."""
    return dataclasses.replace(
        make_config(redis_url, router_address),
        files=FilesSection(directory=files_dir, max_file_bytes=max_file_bytes),
        batches=BatchesSection(**{"poll_s": 0.05, **batches}),
    )


class GatewayTestServer(TestServer):
    """The app served as ``python -m gateway`` serves it: through ``GatewayRunner``."""

    async def _make_runner(self, **kwargs: Any) -> GatewayRunner:
        return GatewayRunner(self.app, self.app[CONFIG].server, **kwargs)


async def start_gateway(config: GatewayConfig) -> TestClient[web.Request, web.Application]:
    client = TestClient(GatewayTestServer(create_app(config)))
    await client.start_server()
    return client


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def prompt_tokens(usage: Any) -> int:
    """A Messages answer's whole prompt: Anthropic's ``input_tokens`` leave out the cached."""
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0))


def sdk(
    gateway: TestClient[web.Request, web.Application],
    key: str,
    base_path: str = "/v1",
    timeout: float = 10,
) -> openai.AsyncOpenAI:
    """The official SDK pointed at the gateway, without retries."""
    return openai.AsyncOpenAI(
        base_url=str(gateway.make_url(base_path)), api_key=key, max_retries=0, timeout=timeout
    )


def with_server(config: GatewayConfig, **server: Any) -> GatewayConfig:
    return dataclasses.replace(config, server=HttpServerSection(**server))


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


_REPO = Path(__file__).resolve().parents[2]


def gateway_process(env: Mapping[str, str], *args: str) -> subprocess.Popen[str]:
    """``python -m gateway [args]`` as the mesh runs it, configured by ``env`` (plaintext gRPC,
    no tracing); its output on the process's stdout (``listening`` waits for its line)."""
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", *args],
        cwd=_REPO,
        text=True,
        env={
            **os.environ,
            "OTEL_SDK_DISABLED": "true",
            "INFERMESH_GATEWAY_TLS_PLAINTEXT": "true",
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


async def listening(proc: subprocess.Popen[str]) -> None:
    """Waits for a gateway process's "listening" line; its later output is read and dropped
    (a thread), so that a full pipe never stalls the process."""
    stdout = proc.stdout
    assert stdout is not None
    while True:
        line = await asyncio.to_thread(stdout.readline)
        assert line, "the gateway process ended before listening"
        if "listening" in line:
            break
    threading.Thread(target=lambda: all(stdout), daemon=True).start()
