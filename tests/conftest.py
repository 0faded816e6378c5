"""Fixtures shared by every test package: real servers on loopback ports."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from infermesh.redis_server import RedisServer
from worker_svc.config import DEFAULT_MODEL_PATH
from worker_svc.engine import Engine


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A throwaway redis-server on a free port; never a Redis the test did not start."""
    with RedisServer(workdir=tmp_path) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_engine() -> Iterator[Engine]:
    """The engine on the tiny default model, shared by the tests that serve it."""
    engine = Engine.from_checkpoint(DEFAULT_MODEL_PATH)
    yield engine
    asyncio.run(engine.close())
